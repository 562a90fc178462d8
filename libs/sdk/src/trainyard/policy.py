"""When a rank saves: the checkpoint policy of the attempt, and the step boundary's one agreement."""

from __future__ import annotations

import logging
import time
from typing import Any

from trainyard.checkpoint import Checkpointer, CheckpointSchedule
from trainyard.context import Context
from trainyard.preemption import Boundary, CheckpointRequest, agreed, boundary_flags
from trainyard.runrecord import CheckpointPolicyRecord

__all__ = ["agree_at_boundary", "checkpoint_policy"]

log = logging.getLogger("trainyard")


def checkpoint_policy(job: Any) -> CheckpointPolicyRecord:
    """When this attempt saves: the allocation's ``checkpointEverySteps`` (``checkpointPolicy.auto``:
    the coordinator's Young/Daly advice) overrides the spec's ``everySteps`` / ``everyMinutes``."""
    spec_policy, advised = job.spec.checkpoint_policy, job.allocation.checkpoint_every_steps
    if advised is not None:
        log.info("checkpoint every %d steps: the platform's advice for checkpointPolicy.auto (the spec says "
                 "everySteps=%s everyMinutes=%s)", advised, spec_policy.every_steps, spec_policy.every_minutes)
        return CheckpointPolicyRecord(every_steps=advised, every_minutes=None,
                                      source="auto: the allocation's checkpointEverySteps (Young/Daly advice)")
    return CheckpointPolicyRecord(every_steps=spec_policy.every_steps, every_minutes=spec_policy.every_minutes,
                                  source="spec")


def agree_at_boundary(ctx: Context, schedule: CheckpointSchedule, checkpointer: Checkpointer,
                      request: CheckpointRequest, step: int) -> Boundary:
    """The step's one collective (world > 1): MAX over ranks of [save due, requested, the pending
    save not done, it failed]. Any rank's clock or request makes everyone save at this step."""
    pending, not_done, failed = checkpointer.local_status()
    flags = boundary_flags(due=schedule.due(step, time.monotonic()), requested=request.requested(),
                           pending=pending, not_done=not_done, failed=failed)
    return agreed(ctx.agree_max(flags))
