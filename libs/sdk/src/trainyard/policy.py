"""When a rank saves: the checkpoint policy of the attempt, and the step boundary's one agreement."""

from __future__ import annotations

import logging
import time
from typing import Any

from trainyard.checkpoint import Checkpointer, CheckpointSchedule
from trainyard.context import Agreement, Context
from trainyard.preemption import (
    NOTHING_AGREED,
    Boundary,
    CheckpointRequest,
    agreed,
    boundary_flags,
)
from trainyard.runrecord import CheckpointPolicyRecord

__all__ = ["BoundaryAgreement", "checkpoint_policy"]

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


class BoundaryAgreement:
    """The step boundary's one agreement, pipelined (see :mod:`trainyard.preemption`): what every
    rank sends at one boundary is collected, the same on every rank, at the next.

    In a world of one the answer is there at once, but it is still used one boundary late, so that
    a run behaves the same at any world size."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._in_flight: Agreement | None = None

    def collect(self) -> Boundary:
        """The answer to what every rank sent at the previous boundary (nothing agreed before the first)."""
        in_flight, self._in_flight = self._in_flight, None
        return agreed(in_flight.result()) if in_flight is not None else NOTHING_AGREED

    def send(self, schedule: CheckpointSchedule, checkpointer: Checkpointer, request: CheckpointRequest) -> None:
        """This rank's flags, reduced while the next step runs."""
        flags = boundary_flags(due=schedule.due_by_clock(time.monotonic()), requested=request.requested(),
                               **checkpointer.local_status())
        self._in_flight = self.ctx.agree_max_later(flags)

    def drain(self) -> None:
        """Wait for the agreement in flight, if any, and forget it (the run ends with no next boundary)."""
        self.collect()

