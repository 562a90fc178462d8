"""What a user asks of a job: cancel, pause, resume. Pure.

cancel: from any non-terminal state, at once (revoked; READY checkpoints are kept). pause: a job whose ranks
run checkpoints first (``stops``); one with no running rank pauses at once. resume: paused → queued, or
withdraws a pause still in progress. A pause or resume of a job whose final checkpoint is READY completes it.
"""

from __future__ import annotations

from datetime import datetime

from trainyard_contract.events import TERMINAL_STATES, Event, JobState
from trainyard_contract.records import JobRecord

from trainyard_scheduler.transitions.state import Outcome, is_live, revoke_live, set_state, unchanged
from trainyard_scheduler.transitions.stops import ask_for_checkpoint, complete, private_copy
from trainyard_scheduler.transitions.table import Happening, enter


def request_control(job: JobRecord, action: str, reason: str | None, now: datetime, *,
                    latest_ready_step: int | None = None, grace_s: float = 300.0,
                    final_ready: bool = False) -> Outcome:
    """cancel: from any non-terminal state, at once; pause: queued/running; resume: paused → queued.

    A pause of a job whose ranks run asks them for a checkpoint first (``grace_s`` to write it;
    ``latest_ready_step``: the latest READY step now) and ends in :func:`check_preemption`.
    Resume while that pause is still in progress withdraws it. ``final_ready``: the checkpoint at
    ``maxSteps`` is READY — then a pause or resume of a job with no live attempt completes it
    (``succeeded``) instead of pausing it or starting an attempt only to finish. A pause of an attempt
    whose ranks all exited 0 (waiting for its final checkpoint) asks nothing: the job completes, or
    pauses only if that attempt fails after all.
    """
    if job.state in TERMINAL_STATES:
        return unchanged(job, f"{action} ignored: job is {job.state}")
    if action in ("pause", "resume") and final_ready and not is_live(job.current):
        return enter(job, Happening.COMPLETED_BY_CONTROL, lambda: complete(
            job.model_copy(deep=True), f"{action}: the checkpoint at maxSteps is READY", now))
    if action == "resume":
        return _resume(job, reason, now)
    if action == "pause" and (job.state == "paused" or job.control == "pause"):
        return unchanged(job, "already paused" if job.state == "paused" else "already pausing")
    if action == "cancel":
        return enter(job, Happening.CANCEL, lambda: _end_at_once(job, "cancelled", reason, now))
    if action != "pause":
        return unchanged(job, f"unknown action {action!r}")
    current = job.current
    if job.state == "running" and current is not None and current.state == "succeeded":
        return enter(job, Happening.PAUSE_AFTER_COMPLETION, lambda: _mark_pause_after_completion(job, now))
    if is_live(current) and current is not None and current.started_ranks:
        return enter(job, Happening.PAUSE_ASKED, lambda: _ask_to_pause(job, latest_ready_step, grace_s, now))
    return enter(job, Happening.PAUSE, lambda: _end_at_once(job, "paused", reason, now))


def _mark_pause_after_completion(job: JobRecord, now: datetime) -> Outcome:
    new = private_copy(job, now)
    new.control = "pause"  # honoured by fail_attempt if the final checkpoint fails; success clears it
    return Outcome(new, note=f"pause: attempt {new.attempts[-1].attempt} finished its last step; the job "
                             "completes once its final checkpoint is READY")


def _ask_to_pause(job: JobRecord, latest_ready_step: int | None, grace_s: float, now: datetime) -> Outcome:
    """The ranks run: they checkpoint first (unless a preemption in progress asked already)."""
    new = private_copy(job, now)
    new.control = "pause"
    current = new.attempts[-1]
    events: list[Event] = []
    if current.preempt_requested_at is None and current.ranks_stopped_at is None:
        events.append(ask_for_checkpoint(new, reason="pause requested", by=None,
                                         latest_ready_step=latest_ready_step, grace_s=grace_s, now=now))
    return Outcome(new, events, note=f"pause requested: attempt {current.attempt} checkpoints first")


def _end_at_once(job: JobRecord, target: JobState, reason: str | None, now: datetime) -> Outcome:
    """Cancel, or pause a job with no running rank: the live attempt (if any) is revoked at once."""
    new = private_copy(job, now)
    events: list[Event] = []
    released = revoke_live(new, target, events, now)
    new.control = None
    set_state(new, target, events, now, reason=reason or f"{target} by request")
    new.queued_reason = None
    return Outcome(new, events, release=released)


def _resume(job: JobRecord, reason: str | None, now: datetime) -> Outcome:
    if job.control == "pause" and job.state != "paused":
        def withdraw() -> Outcome:
            new = private_copy(job, now)
            new.control = None
            return Outcome(new, note="pause withdrawn by resume")
        return enter(job, Happening.PAUSE_WITHDRAWN, withdraw)
    if job.state != "paused":
        return unchanged(job, f"resume ignored: job is {job.state}")

    def resume() -> Outcome:
        new = private_copy(job, now)
        events: list[Event] = []
        set_state(new, "queued", events, now, reason=reason or "resumed")
        new.queued_reason = "resumed; waiting for placement (from the latest READY checkpoint)"
        return Outcome(new, events)

    return enter(job, Happening.RESUME, resume)
