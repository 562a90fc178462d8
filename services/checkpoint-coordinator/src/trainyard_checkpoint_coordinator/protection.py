"""Whether a running job's training is still protected by READY checkpoints. Pure.

Training goes on while checkpoints fail to become READY (a stalled pipeline, a control plane that
lost them); every step past the newest READY checkpoint is work that a failure would lose, and the
goodput ledger would count it as in flight. A job whose live attempt is ``threshold`` or more
checkpoint intervals past its newest READY checkpoint (or the checkpoint it started from) is
**unprotected**: the coordinator stores that condition beside the job
(``ty:job:<id>:ckpt-protection``), exports it as a metric and logs the transition.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from trainyard_runtime.store import Keys

CONDITION = "CheckpointsStalled"


class Protection(BaseModel):
    """The condition of one job's live attempt (camelCase JSON in Redis)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    job_id: str
    attempt: int
    step: int  # the furthest step rank 0 reported for the attempt
    protected_step: int  # the newest READY checkpoint's step (or the start checkpoint's; 0: none)
    every_steps: int
    unprotected_intervals: int  # whole intervals trained past protected_step
    stalled: bool  # the condition CheckpointsStalled holds
    reason: str
    since: datetime | None = None  # when it began to hold (None: it does not)
    updated_at: datetime

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True)

    @classmethod
    def loads(cls, raw: str) -> Protection:
        return cls.model_validate_json(raw)


def assess_protection(
    *, job_id: str, attempt: int, step: int, protected_step: int, every_steps: int, threshold: int,
    now: datetime, previous: Protection | None = None,
) -> Protection:
    """The condition for a live attempt at ``step`` whose newest READY checkpoint is ``protected_step``."""
    intervals = max(step - protected_step, 0) // every_steps if every_steps > 0 else 0
    stalled = every_steps > 0 and intervals >= threshold
    if stalled:
        reason = (f"no READY checkpoint for {intervals} intervals: attempt {attempt} is at step {step}, "
                  + (f"its newest READY checkpoint is step {protected_step}" if protected_step
                     else "and none of its checkpoints is READY")
                  + f" (every {every_steps} steps; a failure now loses {step - protected_step} steps)")
    else:
        reason = f"step {step}, newest READY checkpoint step {protected_step}"
    was = previous is not None and previous.stalled and previous.attempt == attempt
    since = (previous.since if was and previous is not None else now) if stalled else None
    return Protection(job_id=job_id, attempt=attempt, step=step, protected_step=protected_step,
                      every_steps=every_steps, unprotected_intervals=intervals, stalled=stalled, reason=reason,
                      since=since, updated_at=now)


def protection_key(job_id: str) -> str:
    """``ty:job:<id>:ckpt-protection``: the job's :class:`Protection` (JSON), written by the coordinator."""
    return Keys.checkpoint_protection(job_id)


#: Hash job id → ``"<attempt>:<step>"``: the furthest step rank 0 reported (the measurements record it).
LIVE_STEPS = Keys.checkpoint_live_steps
