"""Checkpoint, then stop: pause, drain and preemption, one rule; and the interruptions. Pure.

``request_control(pause)`` on a job whose ranks run sets ``job.control = "pause"``, records on the attempt
when it asked and the latest READY step then (``preempt_requested_at`` / ``preempt_after_step``) and stages
CheckpointRequested; :func:`request_preemption` does the same with ``preempted_by``, :func:`request_drain`
with ``interruption``. The ranks agree on a step *after* they see the request, save it and exit 7 (reason
``preempted``) with that step (``WorkerExited.global_step``). The stop checkpoint is that one
(:func:`~trainyard_scheduler.transitions.state.stop_checkpoint`): never one that was READY, or being written
and assembled, when the request came — the ranks have trained past it. The attempt is revoked (leases
released) once that checkpoint is READY *and* every rank has exited, so ranks end by their own exit 7 and are
never SIGTERMed for it; only when the grace period is over (``pause_grace_s``; a preemption's
``checkpointGraceSeconds``) is it revoked anyway and the next attempt resumes from the last READY one. The job
then becomes ``paused`` (pause), ``queued`` (preemption, drain); pause wins when both are in progress. A stop
that ends at the final step completes the job instead (``succeeded``).

An *interruption* (:func:`interrupt`: a drain, the control plane gone silent, a squatted rendezvous port —
``ExitReason.interruption``) ends the attempt as revoked: no budget spent, nobody blamed; the job queues again
and resumes from its latest READY checkpoint by itself.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from trainyard_contract.events import TERMINAL_STATES, AllocationRevoked, CheckpointRequested, Event
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import JobRecord

from trainyard_scheduler.transitions.state import (
    Outcome,
    is_final_step,
    is_live,
    is_stopping,
    revoke_live,
    set_state,
    stop_checkpoint,
    unchanged,
)
from trainyard_scheduler.transitions.table import Happening, enter


def request_preemption(job: JobRecord, *, by: str, reason: str, latest_ready_step: int | None,
                       grace_s: float, now: datetime) -> Outcome:
    """Mark the live attempt as preempted for ``by`` and ask its ranks for a checkpoint."""
    current = job.current
    if job.state in TERMINAL_STATES or not is_live(current):
        return unchanged(job, "nothing live to preempt")
    assert current is not None
    if current.preempted_by is not None:
        return unchanged(job, f"already being preempted for {current.preempted_by}")
    if job.control == "pause" or current.ranks_stopped_at is not None:
        return unchanged(job, "already stopping")

    def ask() -> Outcome:
        new = private_copy(job, now)
        attempt = new.attempts[-1]
        attempt.preempted_by = by
        event = ask_for_checkpoint(new, reason=reason, by=by, latest_ready_step=latest_ready_step,
                                   grace_s=grace_s, now=now)
        return Outcome(new, [event], note=f"attempt {attempt.attempt} asked to checkpoint: {reason}")

    return enter(job, Happening.PREEMPT_ASKED, ask)


def check_preemption(job: JobRecord, *, latest_ready_step: int | None, preemptor_waiting: bool,
                     grace_s: float, now: datetime, pause_grace_s: float | None = None) -> Outcome:
    """Finish (revoke) a pause, drain or preemption in progress, or withdraw a needless preemption.

    Unchanged while the ranks may still write their checkpoint: the stop ends once the ranks' own
    checkpoint is READY and every rank has exited (:func:`stop_checkpoint`), or ``grace_s``
    (``pause_grace_s`` for a pause or drain) after the request — or after the ranks stopped, for
    ranks that stopped unasked.
    """
    current = job.current
    if job.state in TERMINAL_STATES or current is None or not is_stopping(job):
        return unchanged(job)
    pausing = job.control == "pause"
    stopped = current.ranks_stopped_at is not None
    draining = current.interruption is not None
    if current.preempted_by is not None and not pausing and not stopped and not draining and not preemptor_waiting:
        return enter(job, Happening.PREEMPTION_WITHDRAWN, lambda: _withdraw_preemption(job, now))
    ready = stop_checkpoint(current, latest_ready_step)
    since = current.preempt_requested_at or current.ranks_stopped_at or now
    grace = pause_grace_s if (pausing or draining) and pause_grace_s is not None else grace_s
    if ready is None and (now - since).total_seconds() < grace:
        return unchanged(job)
    how = (f"its ranks stopped and the checkpoint at step {ready} is READY" if ready is not None
           else f"no checkpoint of its ranks READY within {grace:.0f}s; it resumes from the last READY one")
    return enter(job, Happening.STOP_ENDED, lambda: end_stop(private_copy(job, now), how, latest_ready_step, now))


def private_copy(job: JobRecord, now: datetime) -> JobRecord:
    """The copy of ``job`` a transition changes in place, updated ``now``."""
    new = job.model_copy(deep=True)
    new.updated_at = now
    return new


def _withdraw_preemption(job: JobRecord, now: datetime) -> Outcome:
    """The preemptor no longer waits: the attempt trains on, unasked."""
    new = private_copy(job, now)
    attempt = new.attempts[-1]
    by = attempt.preempted_by
    attempt.preempted_by = attempt.preempt_requested_at = attempt.preempt_after_step = None
    return Outcome(new, note=f"preemption for {by} withdrawn: it no longer waits")


def ask_for_checkpoint(new: JobRecord, *, reason: str, by: str | None, latest_ready_step: int | None,
                       grace_s: float, now: datetime) -> CheckpointRequested:
    """Record the request on the live attempt of ``new`` (a private copy); the event to stage."""
    attempt = new.attempts[-1]
    attempt.preempt_requested_at = now
    attempt.preempt_after_step = -1 if latest_ready_step is None else latest_ready_step
    return CheckpointRequested(
        occurred_at=now, job_id=new.job_id, attempt=attempt.attempt, allocation_id=attempt.allocation_id,
        epoch=attempt.epoch,
        reason=reason, requested_by=by, deadline=now + timedelta(seconds=grace_s),
    )


def end_stop(new: JobRecord, how: str, latest_ready_step: int | None, now: datetime) -> Outcome:
    """Revoke the stopping attempt of ``new`` (a private copy): paused for a pause, else queued — or
    succeeded, when the checkpoint it stops with is the final one (nothing is left to run)."""
    attempt = new.attempts[-1]
    attempt.ready_step_at_end = latest_ready_step
    if latest_ready_step is not None and is_final_step(new, latest_ready_step):
        return complete(new, f"the checkpoint at step {latest_ready_step} (maxSteps) is READY", now)
    if new.control == "pause":
        return finish_pause(new, how, now)
    if attempt.interruption is not None:
        return interrupt(new, attempt.interruption, how, latest_ready_step, now)
    by = attempt.preempted_by
    return _revoke_preempted(new, by, how, now)


def finish_pause(new: JobRecord, how: str, now: datetime) -> Outcome:
    """Revoke the live attempt of ``new`` (a private copy), if any: the job is paused."""
    events: list[Event] = []
    released = revoke_live(new, "paused", events, now)
    new.control = None
    why = f"paused ({how})" if released is not None else "paused"
    if released is not None:
        released.failure_reason = why  # which checkpoint it paused with, as a preemption or drain says
    set_state(new, "paused", events, now, reason=why)
    new.queued_reason = new.queued_reason_kind = None
    new.updated_at = now
    return Outcome(new, events, release=released, note=why)


def complete(new: JobRecord, how: str, now: datetime) -> Outcome:
    """The job's final checkpoint is READY: succeeded (a live attempt is revoked, its leases released),
    whatever pause or stop was asked for."""
    events: list[Event] = []
    released = revoke_live(new, f"completed: {how}", events, now)
    new.queued_reason = new.queued_reason_kind = None
    new.updated_at = now
    set_state(new, "succeeded", events, now, reason=None)
    return Outcome(new, events, release=released, note=f"succeeded: {how}")


def _revoke_preempted(new: JobRecord, by: str | None, how: str, now: datetime) -> Outcome:
    """End the live attempt of ``new`` (a private copy) for preemptor ``by``; the job queues again."""
    attempt = new.attempts[-1]
    new.updated_at = now
    events: list[Event] = []
    who = f"preempted by {by}" if by else "stopped by its ranks"
    attempt.state = "revoked"
    attempt.ended_at = now
    attempt.failure_reason = f"{who}: {how}"
    events.append(AllocationRevoked(occurred_at=now, job_id=new.job_id, attempt=attempt.attempt,
                                    allocation_id=attempt.allocation_id,
                                    epoch=attempt.epoch, reason=who))
    why = f"{who} ({how})"
    set_state(new, "queued", events, now, reason=why)
    new.queued_reason = f"{why}; the next attempt resumes from the latest READY checkpoint"
    new.queued_reason_kind = "priority" if by else "preemption"
    return Outcome(new, events, release=attempt, note=why)


def request_drain(job: JobRecord, *, reason: str, latest_ready_step: int | None, grace_s: float,
                  now: datetime) -> Outcome:
    """A node of the live attempt is drained: ask its ranks to checkpoint and stop (the pause protocol);
    the attempt then ends as interrupted by maintenance (:func:`check_preemption`), never as a failure.

    Ranks that have not started are revoked at once; an attempt already stopping (pause, preemption,
    ranks that checkpointed on their own) only gets the mark, and ends the way it was going to.
    """
    current = job.current
    if job.state in TERMINAL_STATES or not is_live(current):
        return unchanged(job, "nothing live to drain")
    assert current is not None
    if current.interruption is not None:
        return unchanged(job, "already stopping for maintenance")
    new = private_copy(job, now)
    attempt = new.attempts[-1]
    why = attempt.interruption = f"{ExitReason.MAINTENANCE}: {reason}"
    if not current.started_ranks:
        return enter(job, Happening.DRAIN_BEFORE_START,
                     lambda: interrupt(new, why, "its ranks had not started", latest_ready_step, now))
    if is_stopping(job):  # only the mark: it ends the way it was going to, as an interruption
        return enter(job, Happening.DRAIN_ASKED,
                     lambda: Outcome(new, note=f"attempt {attempt.attempt} already stopping; marked {why}"))

    def ask() -> Outcome:
        event = ask_for_checkpoint(new, reason=f"drain: {reason}", by=None, latest_ready_step=latest_ready_step,
                                   grace_s=grace_s, now=now)
        return Outcome(new, [event], note=f"attempt {attempt.attempt} asked to checkpoint and stop: {reason}")

    return enter(job, Happening.DRAIN_ASKED, ask)


def interrupt(new: JobRecord, why: str, how: str, latest_ready_step: int | None, now: datetime) -> Outcome:
    """End the live attempt of ``new`` (a private copy) without a failure: revoked (no budget spent,
    nobody blamed); the job queues again (or pauses, if a pause was asked) and resumes by itself.

    ``why``: ``<kind>: <detail>``, the kind an interruption reason (``maintenance``, ``control-plane``) or
    ``rendezvous port``; the queued reason names it."""
    attempt = new.attempts[-1]
    attempt.interruption = why
    attempt.ready_step_at_end = latest_ready_step
    if new.control == "pause":
        return finish_pause(new, how, now)
    new.updated_at = now
    events: list[Event] = []
    released = revoke_live(new, why, events, now)
    if released is not None:
        released.failure_reason = f"{why} ({how})"
    kind = why.split(":", 1)[0]
    set_state(new, "queued", events, now, reason=f"interrupted by {kind}")
    start = ("the latest READY checkpoint" if latest_ready_step is None
             else f"the checkpoint at step {latest_ready_step}")
    new.queued_reason = (f"attempt {attempt.attempt} interrupted by {why} ({how}); not a failure: attempt "
                         f"{attempt.attempt + 1} resumes from {start} by itself")
    new.queued_reason_kind = "maintenance" if kind == ExitReason.MAINTENANCE else "interrupted"
    return Outcome(new, events, release=released, note=f"attempt {attempt.attempt} interrupted: {why}")
