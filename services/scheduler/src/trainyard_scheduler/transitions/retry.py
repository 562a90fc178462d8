"""A failed attempt, and whether the job tries again. Pure.

Retry policy (:func:`fail_attempt`):

* Retryable reasons (``ExitReason.retryable``): crashed, killed, lost or hung ranks, OOM, NCCL errors,
  start time-outs, a missing final checkpoint. Spec errors (``config``, ``data``) and failed
  checkpoint I/O of a rank (``checkpoint``) fail the job at once, as does a reason this version does
  not know.
* ``nan`` retries from the latest READY checkpoint, unless an earlier attempt already hit NaN at
  the same global step (``WorkerExited.global_step``, kept as ``AttemptRecord.nan_step``): a
  deterministic NaN would only repeat. A NaN at an unknown step is retried once.
* Failures count *since progress*: an attempt made progress when a READY checkpoint newer than
  the one it started from existed when it ended. The streak of failed attempts since (and
  including) the last one that made progress drives both the back-off (the policy's
  ``initial_interval_s`` doubling to ``maximum_interval_s``) and the budget: the job fails once
  ``JobRecord.max_attempts`` failures in a row made no progress — a week-long job that fails every few
  hours but checkpoints in between never runs out. The policy's ``maximum_attempts`` optionally caps all
  failures of a job.

Interruptions (``ExitReason.interruption``) never come here: they end the attempt as revoked
(``stops.interrupt``), spending no budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from trainyard_contract.events import AllocationRevoked, Event
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import AttemptRecord, JobRecord

from trainyard_scheduler.transitions.state import (
    Outcome,
    RetryPolicy,
    failures,
    failures_since_progress,
    is_live,
    retry_not_before,
    set_state,
)


def fail_attempt(job: JobRecord, reason: str, detail: str, policy: RetryPolicy, now: datetime, *,
                 latest_ready_step: int | None = None, retryable: bool | None = None,
                 blame: Sequence[tuple[str, str]] = ()) -> Outcome:
    """Fail the current attempt of ``job`` (a private copy, changed in place); retry or fail the job.

    ``retryable``: None reads it from the reason. A job being paused becomes ``paused`` instead of ``queued``.
    """
    attempt = job.attempts[-1]
    events: list[Event] = []
    released = _end_failed(job, attempt, reason, detail, latest_ready_step, events, now)
    blamed = list(blame)
    retryable = ExitReason.parse(reason).retryable if retryable is None else retryable
    streak, total = failures_since_progress(job), failures(job)
    capped = policy.exhausted(total)
    if retryable and streak < job.max_attempts and not capped:
        why = f"attempt {attempt.attempt} failed ({reason}: {detail})"
        if job.control == "pause":
            job.control = None
            job.queued_reason = job.queued_reason_kind = None
            set_state(job, "paused", events, now, reason=f"{why}; paused as requested")
            return Outcome(job, events, release=released, note=f"{why}; paused", blame=blamed)
        _queue_again(job, attempt, why, policy, events, now)
        return Outcome(job, events, release=released, note=why, blame=blamed)
    if not retryable:
        budget = f"{total} failed; not retryable"
    elif capped:
        budget = f"{total} failed in all, the cap is {policy.maximum_attempts}"
    else:
        budget = f"{streak} of {job.max_attempts} failed in a row without a new READY checkpoint"
    why = f"{reason}: {detail} (attempt {attempt.attempt}, {budget})"
    job.queued_reason = None
    job.control = None
    set_state(job, "failed", events, now, reason=why)
    return Outcome(job, events, release=released, note=f"job failed: {why}", blame=blamed)


def _end_failed(job: JobRecord, attempt: AttemptRecord, reason: str, detail: str, latest_ready_step: int | None,
                events: list[Event], now: datetime) -> AttemptRecord | None:
    """Mark ``attempt`` failed (in place); revoke it if it was live, and return it then for lease release."""
    released = None
    if is_live(attempt):
        events.append(AllocationRevoked(occurred_at=now, job_id=job.job_id, attempt=attempt.attempt,
                                        allocation_id=attempt.allocation_id, epoch=attempt.epoch,
                                        reason=f"attempt failed: {reason}"))
        released = attempt
    attempt.state = "failed"
    attempt.ended_at = now
    attempt.failure_reason = f"{reason}: {detail}"
    attempt.ready_step_at_end = latest_ready_step
    job.updated_at = now
    return released


def _queue_again(job: JobRecord, attempt: AttemptRecord, why: str, policy: RetryPolicy, events: list[Event],
                 now: datetime) -> None:
    not_before = retry_not_before(job, policy)
    job.queued_reason = (
        f"{why}; attempt {attempt.attempt + 1} resumes from the latest READY checkpoint"
        + (f" after {not_before.isoformat(timespec='seconds')}" if not_before else "")
    )
    job.queued_reason_kind = "backoff"
    set_state(job, "queued", events, now, reason=why)


def classify_failure(reason: str, exit_code: int) -> str:
    """The reason a failed attempt is recorded with: the rank's, every ``signal-<n>`` as ``signal``; a non-zero
    exit that gave none is an ``error``. An unknown reason is kept as given (and is not retried)."""
    said = ExitReason.parse(reason)
    if said is ExitReason.OK or not reason:
        return ExitReason.ERROR.value if exit_code else ExitReason.OK.value
    return said.value if said is not ExitReason.UNKNOWN else reason


def nan_repeats(job: JobRecord, step: int | None) -> bool:
    """Whether an earlier attempt of ``job`` hit NaN at ``step`` (any NaN, when the step is unknown)."""
    nan = f"{ExitReason.NAN}:"
    earlier = [a for a in job.attempts[:-1] if a.state == "failed" and (a.failure_reason or "").startswith(nan)]
    if step is None:
        return bool(earlier)
    return any(a.nan_step == step for a in earlier)
