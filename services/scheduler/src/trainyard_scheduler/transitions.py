"""The job and attempt state machine, as pure functions.

Each function takes the current :class:`JobRecord` (never mutated) and what happened, and
returns an :class:`Outcome`: the new record, the events to publish with it (staged in the
same Redis MULTI through the outbox) and the attempt whose device leases to release
afterwards. No Redis, Kafka or clock inside: ``now`` is passed in.

Job states::

    queued ──(WorkerStarted)──> running ──(all ranks exit 0 + READY ckpt at maxSteps)──> succeeded
      ^  │                         │
      │  └──────(pause)──> paused <┘ (pause revokes the attempt; resume → queued)
      └── attempt failed, retryable, attempts left (back-off, resume from latest READY)
    any non-terminal ──(cancel)──> cancelled;   attempt failed, no attempts left ──> failed

Attempt states: starting → running → succeeded | failed | revoked. An attempt is *live*
(holds leases, has ranks) while starting or running. Only failed attempts count against
``JobRecord.max_attempts``; attempts revoked by pause, cancel or preemption do not.

Preemption: ``request_preemption`` marks the victim's live attempt (``preempted_by``) and asks
it to checkpoint (CheckpointRequested); ``check_preemption`` revokes it once a checkpoint newer
than the one READY at the request is READY, or the grace period is over — or withdraws the
request when the preemptor no longer waits. The job goes back to queued and its next attempt
resumes from the latest READY checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from trainyard_common.events import (
    TERMINAL_STATES,
    AllocationRevoked,
    CheckpointRef,
    CheckpointRequested,
    Event,
    GangAllocated,
    JobState,
    JobStateChanged,
    WorkerExited,
    WorkerStarted,
)
from trainyard_common.exitcodes import RETRYABLE_REASONS
from trainyard_common.records import AttemptRecord, JobRecord

from trainyard_scheduler.placement import Placement

LIVE_ATTEMPT_STATES = frozenset({"starting", "running"})
# Failures the scheduler itself diagnoses are worth another attempt, like a crashed rank.
RETRYABLE = RETRYABLE_REASONS | {"revoked", "start-timeout", "checkpoint-missing", "signal", "preempted"}


@dataclass
class Outcome:
    """The result of one transition. ``changed`` False: nothing to write."""

    job: JobRecord
    events: list[Event] = field(default_factory=list)
    release: AttemptRecord | None = None
    changed: bool = True
    note: str | None = None


@dataclass(frozen=True)
class RetryPolicy:
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0


@dataclass(frozen=True)
class Deadlines:
    start_timeout_s: float = 120.0
    final_checkpoint_timeout_s: float = 300.0


def unchanged(job: JobRecord, note: str | None = None) -> Outcome:
    return Outcome(job, changed=False, note=note)


def is_live(attempt: AttemptRecord | None) -> bool:
    return attempt is not None and attempt.state in LIVE_ATTEMPT_STATES


def is_pending(job: JobRecord) -> bool:
    """Queued and holding nothing: the planner should place a new attempt."""
    current = job.current
    return job.state == "queued" and (current is None or current.state in ("failed", "revoked"))


def failures(job: JobRecord) -> int:
    return sum(1 for a in job.attempts if a.state == "failed")


def retry_not_before(job: JobRecord, policy: RetryPolicy) -> datetime | None:
    """When the next attempt may start: exponential back-off after a failed attempt."""
    current = job.current
    if current is None or current.state != "failed" or current.ended_at is None:
        return None
    delay = min(policy.max_backoff_s, policy.backoff_s * 2 ** max(failures(job) - 1, 0))
    return current.ended_at + timedelta(seconds=delay)


def is_final_step(job: JobRecord, global_step: int) -> bool:
    return global_step >= job.spec.training.max_steps


# ----------------------------------------------------------------------------- placement


def admit(
    job: JobRecord,
    *,
    placement: Placement,
    allocation_id: str,
    epoch: int,
    master_port: int,
    start_checkpoint: CheckpointRef | None,
    now: datetime,
    checkpoint_every_steps: int | None = None,
) -> Outcome:
    """A new attempt on ``placement``: the record gains an AttemptRecord; GangAllocated goes out.

    ``checkpoint_every_steps``: the coordinator's advised interval, for a spec with ``checkpointPolicy.auto``.
    """
    if not is_pending(job):
        return unchanged(job, "no longer pending")
    number = len(job.attempts) + 1
    attempt = AttemptRecord(
        attempt=number,
        allocation_id=allocation_id,
        epoch=epoch,
        nodes=[n.node_id for n in placement.nodes],
        devices=[str(d) for d in placement.devices()],
        world_size=placement.world_size,
        start_checkpoint=start_checkpoint,
        started_at=now,
        placement_score=placement.score,
        master_addr=placement.master_addr,
        master_port=master_port,
    )
    attempt.placement_detail = placement.detail
    new = job.model_copy(deep=True)
    new.attempts.append(attempt)
    new.queued_reason = None
    new.queued_reason_kind = None
    new.updated_at = now
    event = GangAllocated(
        job_id=job.job_id,
        tenant=job.tenant,
        attempt=number,
        allocation_id=allocation_id,
        epoch=epoch,
        world_size=placement.world_size,
        nodes=placement.assignments(),
        master_addr=placement.master_addr,
        master_port=master_port,
        start_checkpoint=start_checkpoint,
        spec=job.spec,
        spec_hash=job.spec_hash,
        placement_score=placement.score,
        placement_detail=placement.detail,
        checkpoint_every_steps=checkpoint_every_steps,
    )
    return Outcome(new, [event], note=f"attempt {number} placed on {', '.join(attempt.nodes)}")


def note_waiting(job: JobRecord, reason: str, kind: str | None = None) -> Outcome:
    """Record why a queued job waits (shown by GET while queued)."""
    if job.state != "queued" or (job.queued_reason == reason and job.queued_reason_kind == kind):
        return unchanged(job)
    new = job.model_copy(update={"queued_reason": reason, "queued_reason_kind": kind})
    return Outcome(new)


# ----------------------------------------------------------------------------- preemption


def request_preemption(job: JobRecord, *, by: str, reason: str, latest_ready_step: int | None,
                       grace_s: float, now: datetime) -> Outcome:
    """Mark the live attempt as preempted for ``by`` and ask its ranks for a checkpoint."""
    current = job.current
    if job.state in TERMINAL_STATES or not is_live(current):
        return unchanged(job, "nothing live to preempt")
    assert current is not None
    if current.preempted_by is not None:
        return unchanged(job, f"already being preempted for {current.preempted_by}")
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    attempt.preempted_by = by
    attempt.preempt_requested_at = now
    attempt.preempt_after_step = -1 if latest_ready_step is None else latest_ready_step
    new.updated_at = now
    event = CheckpointRequested(
        job_id=job.job_id, attempt=attempt.attempt, allocation_id=attempt.allocation_id, epoch=attempt.epoch,
        reason=reason, requested_by=by, deadline=now + timedelta(seconds=grace_s),
    )
    return Outcome(new, [event], note=f"attempt {attempt.attempt} asked to checkpoint: {reason}")


def check_preemption(job: JobRecord, *, latest_ready_step: int | None, preemptor_waiting: bool,
                     grace_s: float, now: datetime) -> Outcome:
    """Finish (revoke), or withdraw, a preemption in progress; unchanged while it may still checkpoint."""
    current = job.current
    if job.state in TERMINAL_STATES or not is_live(current) or current is None or current.preempted_by is None:
        return unchanged(job)
    by = current.preempted_by
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    new.updated_at = now
    if not preemptor_waiting:
        attempt.preempted_by = attempt.preempt_requested_at = attempt.preempt_after_step = None
        return Outcome(new, note=f"preemption for {by} withdrawn: it no longer waits")
    newer = latest_ready_step is not None and latest_ready_step > (current.preempt_after_step or -1)
    asked = current.preempt_requested_at or now
    if not newer and (now - asked).total_seconds() < grace_s:
        return unchanged(job)
    how = (f"the checkpoint at step {latest_ready_step} is READY" if newer
           else f"no new checkpoint within {grace_s:.0f}s; it resumes from the last READY one")
    return _revoke_preempted(new, by, how, now)


def _revoke_preempted(new: JobRecord, by: str, how: str, now: datetime) -> Outcome:
    """End the live attempt of ``new`` (a private copy) for preemptor ``by``; the job queues again."""
    attempt = new.attempts[-1]
    new.updated_at = now
    events: list[Event] = []
    attempt.state = "revoked"
    attempt.ended_at = now
    attempt.failure_reason = f"preempted by {by}: {how}"
    events.append(AllocationRevoked(job_id=new.job_id, attempt=attempt.attempt, allocation_id=attempt.allocation_id,
                                    epoch=attempt.epoch, reason=f"preempted by {by}"))
    why = f"preempted by {by} ({how})"
    _set_state(new, "queued", events, reason=why)
    new.queued_reason = f"{why}; the next attempt resumes from the latest READY checkpoint"
    new.queued_reason_kind = "priority"
    return Outcome(new, events, release=attempt, note=why)


# ----------------------------------------------------------------------------- workers


def worker_started(job: JobRecord, event: WorkerStarted, now: datetime) -> Outcome:
    """A rank of the current attempt started: the attempt runs; the job goes queued → running."""
    current = job.current
    if not _is_current(current, event.allocation_id, event.epoch) or not is_live(current):
        return unchanged(job, "worker of a stale or ended attempt")
    assert current is not None
    if event.rank in current.started_ranks and current.state == "running":
        return unchanged(job, "duplicate WorkerStarted")
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    if event.rank not in attempt.started_ranks:
        attempt.started_ranks = sorted([*attempt.started_ranks, event.rank])
    attempt.state = "running"
    new.updated_at = now
    events: list[Event] = []
    if new.state == "queued":
        _set_state(new, "running", events, reason=None)
    return Outcome(new, events)


def worker_exited(
    job: JobRecord, event: WorkerExited, *, final_ready: bool, policy: RetryPolicy, now: datetime
) -> Outcome:
    """Record a rank's exit; a non-zero exit fails the attempt; all zero completes it.

    ``final_ready``: a READY checkpoint at ``maxSteps`` exists (then completion = success).
    """
    current = job.current
    if not _is_current(current, event.allocation_id, event.epoch):
        return unchanged(job, "exit of a stale attempt")
    assert current is not None
    key = str(event.rank)
    if current.exited_ranks.get(key) == event.exit_code:
        return unchanged(job, "duplicate WorkerExited")
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    attempt.exited_ranks = {**attempt.exited_ranks, key: event.exit_code}
    new.updated_at = now
    if not is_live(current) or job.state in TERMINAL_STATES:
        return Outcome(new, note="exit recorded for an ended attempt")
    if event.exit_code != 0 and event.reason == "preempted" and current.preempted_by is not None:
        # The ranks answered CheckpointRequested: they checkpointed and stopped. Not a failure.
        return _revoke_preempted(new, current.preempted_by, "its ranks checkpointed and stopped", now)
    if event.exit_code != 0:
        detail = f"rank {event.rank} on {event.node_id} exited with code {event.exit_code}"
        if event.detail:
            detail += f": {event.detail}"
        return _fail_attempt(new, _classify(event.reason, event.exit_code), detail, policy, now)
    ranks_ok = len(attempt.exited_ranks) >= attempt.world_size and all(
        code == 0 for code in attempt.exited_ranks.values()
    )
    if not ranks_ok:
        return Outcome(new)
    attempt.state = "succeeded"
    attempt.ended_at = now
    events: list[Event] = []
    if final_ready:
        _set_state(new, "succeeded", events, reason=None)
    return Outcome(new, events, release=attempt, note=f"attempt {attempt.attempt} completed")


def checkpoint_ready(job: JobRecord, *, global_step: int, now: datetime) -> Outcome:
    """A READY checkpoint: at ``maxSteps`` after a completed attempt, the job has succeeded."""
    current = job.current
    if job.state in TERMINAL_STATES or not is_final_step(job, global_step):
        return unchanged(job)
    if current is None or current.state != "succeeded":
        return unchanged(job, "final checkpoint ready; waiting for every rank to exit 0")
    new = job.model_copy(deep=True)
    new.updated_at = now
    events: list[Event] = []
    _set_state(new, "succeeded", events, reason=None)
    return Outcome(new, events)


def checkpoint_failed(job: JobRecord, *, global_step: int, reason: str, policy: RetryPolicy,
                      now: datetime) -> Outcome:
    """The final checkpoint of a completed attempt failed: retry from the latest READY one.

    A failed intermediate checkpoint changes nothing: the attempt trains on and writes the next.
    """
    current = job.current
    if job.state in TERMINAL_STATES or not is_final_step(job, global_step):
        return unchanged(job)
    if current is None or current.state != "succeeded":
        return unchanged(job)
    detail = f"the checkpoint at step {global_step} failed: {reason}"
    return _fail_attempt(job.model_copy(deep=True), "checkpoint-missing", detail, policy, now)


# ----------------------------------------------------------------------------- control


def request_control(job: JobRecord, action: str, reason: str | None, now: datetime) -> Outcome:
    """cancel: from any non-terminal state; pause: queued/running; resume: paused → queued."""
    if job.state in TERMINAL_STATES:
        return unchanged(job, f"{action} ignored: job is {job.state}")
    if action == "resume":
        if job.state != "paused":
            return unchanged(job, f"resume ignored: job is {job.state}")
        new = job.model_copy(deep=True)
        new.updated_at = now
        events: list[Event] = []
        _set_state(new, "queued", events, reason=reason or "resumed")
        new.queued_reason = "resumed; waiting for placement"
        return Outcome(new, events)
    if action == "pause" and job.state == "paused":
        return unchanged(job, "already paused")
    if action not in ("cancel", "pause"):
        return unchanged(job, f"unknown action {action!r}")
    new = job.model_copy(deep=True)
    new.updated_at = now
    events = []
    released = _revoke_live(new, "cancelled" if action == "cancel" else "paused", events, now)
    target: JobState = "cancelled" if action == "cancel" else "paused"
    _set_state(new, target, events, reason=reason or f"{target} by request")
    new.queued_reason = None
    return Outcome(new, events, release=released)


# ----------------------------------------------------------------------------- reconcile


def check_attempt(
    job: JobRecord,
    *,
    available_nodes: frozenset[str],
    final_ready: bool,
    deadlines: Deadlines,
    policy: RetryPolicy,
    now: datetime,
) -> Outcome:
    """Periodic liveness check of the current attempt, from durable state only.

    Ranks that never start, a node that stops heart-beating, and a completed attempt whose
    final checkpoint never turns READY all fail the attempt (and so retry it); a completed
    attempt whose final checkpoint is READY (its CheckpointReady was lost) succeeds the job.
    """
    current = job.current
    if current is None or job.state in TERMINAL_STATES or job.state == "paused":
        return unchanged(job)
    if is_live(current):
        lost = [n for n in current.nodes if n not in available_nodes]
        if lost:
            detail = f"node {', '.join(lost)} stopped sending heartbeats"
            return _fail_attempt(job.model_copy(deep=True), "lost", detail, policy, now)
        age = (now - current.started_at).total_seconds()
        if len(current.started_ranks) < current.world_size and age > deadlines.start_timeout_s:
            started = len(current.started_ranks)
            detail = f"{started} of {current.world_size} ranks started within {deadlines.start_timeout_s:.0f}s"
            return _fail_attempt(job.model_copy(deep=True), "start-timeout", detail, policy, now)
        return unchanged(job)
    if current.state == "succeeded" and job.state == "running":
        if final_ready:
            new = job.model_copy(deep=True)
            new.updated_at = now
            events: list[Event] = []
            _set_state(new, "succeeded", events, reason=None)
            return Outcome(new, events)
        waited = (now - (current.ended_at or now)).total_seconds()
        if waited > deadlines.final_checkpoint_timeout_s:
            detail = (f"every rank exited 0 but no READY checkpoint at step {job.spec.training.max_steps} "
                      f"appeared within {deadlines.final_checkpoint_timeout_s:.0f}s")
            return _fail_attempt(job.model_copy(deep=True), "checkpoint-missing", detail, policy, now)
    return unchanged(job)


# ----------------------------------------------------------------------------- helpers


def _is_current(attempt: AttemptRecord | None, allocation_id: str, epoch: int) -> bool:
    return attempt is not None and attempt.allocation_id == allocation_id and attempt.epoch == epoch


def _classify(reason: str, exit_code: int) -> str:
    if reason and reason != "ok":
        return "signal" if reason.startswith("signal-") else reason
    return "error" if exit_code else "ok"


def _set_state(job: JobRecord, state: JobState, events: list[Event], *, reason: str | None) -> None:
    """Move ``job`` to ``state`` (in place) and queue the JobStateChanged, if it changes."""
    if job.state == state:
        return
    previous = job.state
    job.state = state
    if state in ("failed", "cancelled"):
        job.reason = reason
    current = job.current
    events.append(
        JobStateChanged(
            job_id=job.job_id,
            tenant=job.tenant,
            state=state,
            previous_state=previous,
            attempt=current.attempt if current else None,
            reason=reason,
        )
    )


def _revoke_live(job: JobRecord, why: str, events: list[Event], now: datetime) -> AttemptRecord | None:
    """Revoke the current attempt if it is live (in place); returns it for lease release."""
    current = job.current
    if not is_live(current):
        return None
    assert current is not None
    current.state = "revoked"
    current.ended_at = now
    current.failure_reason = why
    events.append(
        AllocationRevoked(
            job_id=job.job_id,
            attempt=current.attempt,
            allocation_id=current.allocation_id,
            epoch=current.epoch,
            reason=why,
        )
    )
    return current


def _fail_attempt(job: JobRecord, reason: str, detail: str, policy: RetryPolicy, now: datetime) -> Outcome:
    """Fail the current attempt of ``job`` (a private copy, changed in place); retry or fail the job."""
    attempt = job.attempts[-1]
    events: list[Event] = []
    released = None
    if is_live(attempt):
        events.append(
            AllocationRevoked(
                job_id=job.job_id,
                attempt=attempt.attempt,
                allocation_id=attempt.allocation_id,
                epoch=attempt.epoch,
                reason=f"attempt failed: {reason}",
            )
        )
        released = attempt
    attempt.state = "failed"
    attempt.ended_at = now
    attempt.failure_reason = f"{reason}: {detail}"
    job.updated_at = now
    used = failures(job)
    if reason in RETRYABLE and used < job.max_attempts:
        not_before = retry_not_before(job, policy)
        why = f"attempt {attempt.attempt} failed ({reason}: {detail})"
        job.queued_reason = (
            f"{why}; attempt {attempt.attempt + 1} resumes from the latest READY checkpoint"
            + (f" after {not_before.isoformat(timespec='seconds')}" if not_before else "")
        )
        job.queued_reason_kind = "backoff"
        _set_state(job, "queued", events, reason=why)
        return Outcome(job, events, release=released, note=why)
    budget = "" if reason in RETRYABLE else "; not retryable"
    why = f"{reason}: {detail} (attempt {attempt.attempt}, {used} of {job.max_attempts} failed{budget})"
    job.queued_reason = None
    _set_state(job, "failed", events, reason=why)
    return Outcome(job, events, release=released, note=f"job failed: {why}")
