"""What every transition reads and writes: :class:`Outcome`, the retry policy and deadlines, the predicates
over a job record (live, pending, stopping, progress), and the two edits every transition makes in place on
its private copy (:func:`set_state`, :func:`revoke_live`). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from trainyard_contract.events import TERMINAL_STATES, AllocationRevoked, Event, JobState, JobStateChanged
from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord
from trainyard_runtime.retry import RetryPolicy

LIVE_ATTEMPT_STATES = frozenset({"starting", "running"})


@dataclass
class Outcome:
    """The result of one transition. ``changed`` False: nothing to write.

    ``blame``: (node id, reason) of the nodes a failed attempt is attributed to (node reputation).
    """

    job: JobRecord
    events: list[Event] = field(default_factory=list)
    release: AttemptRecord | None = None
    changed: bool = True
    note: str | None = None
    blame: list[tuple[str, str]] = field(default_factory=list)


#: A failed job's next attempt waits 0.5 s after the first failure since progress, doubling up to 60 s; the
#: policy's ``maximum_attempts`` (``TRAINYARD_MAX_TOTAL_FAILURES``, default none) caps all failed attempts of a job
#: (:mod:`~trainyard_scheduler.transitions.retry`).
JOB_RETRY = RetryPolicy(initial_interval_s=0.5, maximum_interval_s=60.0)


@dataclass(frozen=True)
class Deadlines:
    """Reconcile deadlines; ``republish_after_s`` None: a lost GangAllocated is not published again."""

    start_timeout_s: float = 120.0
    final_checkpoint_timeout_s: float = 300.0
    republish_after_s: float | None = None
    republish_max: int = 0


def unchanged(job: JobRecord, note: str | None = None) -> Outcome:
    return Outcome(job, changed=False, note=note)


def is_live(attempt: AttemptRecord | None) -> bool:
    return attempt is not None and attempt.state in LIVE_ATTEMPT_STATES


def is_pending(job: JobRecord) -> bool:
    """Queued and holding nothing: the planner should place a new attempt."""
    current = job.current
    return job.state == "queued" and (current is None or current.state in ("failed", "revoked"))


def failures(job: JobRecord) -> int:
    """Every failed attempt of the job."""
    return sum(1 for a in job.attempts if a.state == "failed")


def made_progress(attempt: AttemptRecord) -> bool:
    """Whether a READY checkpoint newer than the attempt's start existed when it ended."""
    start = attempt.start_checkpoint.global_step if attempt.start_checkpoint else -1
    return attempt.ready_step_at_end is not None and attempt.ready_step_at_end > start


def failures_since_progress(job: JobRecord) -> int:
    """Failed attempts since (and including) the last attempt that made progress."""
    streak = 0
    for attempt in reversed(job.attempts):
        if attempt.state == "failed":
            streak += 1
        if attempt.state in ("failed", "succeeded", "revoked") and made_progress(attempt):
            break
    return streak


def retry_not_before(job: JobRecord, policy: RetryPolicy) -> datetime | None:
    """When the next attempt may start: exponential back-off in the failures since progress."""
    current = job.current
    if current is None or current.state != "failed" or current.ended_at is None:
        return None
    delay = policy.delay(failures_since_progress(job))
    return current.ended_at + timedelta(seconds=delay)


def checkpoint_settling(
    job: JobRecord, checkpoints: list[CheckpointRecord], shards_recorded: dict[str, int], *,
    now: datetime, settle_s: float,
) -> CheckpointRecord | None:
    """The checkpoint the next attempt should wait for before it is placed, or None.

    Placing the next attempt grants a new fencing epoch, and the coordinator never makes a
    checkpoint of an older epoch READY. So a checkpoint of the attempt that just ended whose
    every shard is recorded (``shards_recorded``: checkpoint id → shards in Redis), but which
    the coordinator has not verified yet, would be fenced out by the very placement that needs
    it, and the new attempt would resume an interval (or more) earlier. The next attempt waits
    for such a checkpoint — newer than the latest READY one — for at most ``settle_s`` after
    the attempt ended; a set still missing shards is not waited for (its ranks are gone).
    """
    current = job.current
    if current is None or current.ended_at is None or settle_s <= 0:
        return None
    if now >= current.ended_at + timedelta(seconds=settle_s):
        return None
    ready = max((c.global_step for c in checkpoints if c.state == "READY"), default=-1)
    waiting = [c for c in checkpoints
               if c.state == "PENDING" and c.attempt == current.attempt and c.global_step > ready
               and shards_recorded.get(c.checkpoint_id, 0) >= c.world_size]
    return max(waiting, key=lambda c: c.global_step, default=None)


def is_final_step(job: JobRecord, global_step: int) -> bool:
    return global_step >= job.spec.training.max_steps


def is_stopping(job: JobRecord) -> bool:
    """A live attempt asked to checkpoint and stop (pause or preemption), or whose ranks stopped so."""
    current = job.current
    return is_live(current) and current is not None and (
        job.control == "pause" or current.preempted_by is not None or current.ranks_stopped_at is not None
        or current.interruption is not None)


def stop_checkpoint(attempt: AttemptRecord, latest_ready_step: int | None) -> int | None:
    """The step of the READY checkpoint a checkpoint-then-stop (pause, drain, preemption) ends with; None
    while there is none yet. The one rule of the module docstring, for all three.

    It is the checkpoint the ranks agreed on after the request: they report its step as they exit 7
    (``workers._ranks_stopping`` raises ``preempt_after_step`` to that step − 1). Before a rank has reported,
    none counts: a checkpoint READY, or in flight, at the request is at a step the ranks have trained
    past. And it counts only once every rank has exited, so the revocation that follows stops nothing.
    (A rank that reports no step, an exit note it could not write, leaves the request-time step.)
    """
    if attempt.ranks_stopped_at is None or len(attempt.exited_ranks) < attempt.world_size:
        return None
    after = -1 if attempt.preempt_after_step is None else attempt.preempt_after_step
    return latest_ready_step if latest_ready_step is not None and latest_ready_step > after else None


def rank0_host(attempt: AttemptRecord) -> str:
    """The advertised address of the node that runs rank 0: where the gang rendezvous (for attempts recorded
    before ``master_addr`` was kept; loopback only when the attempt names no such node, a single-host one)."""
    return next((n.host for n in attempt.assignments if any(r.rank == 0 for r in n.ranks)), "127.0.0.1")


def rank_nodes(attempt: AttemptRecord) -> dict[int, str]:
    """rank → node id of an attempt (empty for attempts recorded before assignments were kept)."""
    return {r.rank: n.node_id for n in attempt.assignments for r in n.ranks}


def nodes_without_started_ranks(attempt: AttemptRecord) -> list[str]:
    started = set(attempt.started_ranks)
    return [n.node_id for n in attempt.assignments if n.ranks and not any(r.rank in started for r in n.ranks)]


def is_current(attempt: AttemptRecord | None, allocation_id: str, epoch: int) -> bool:
    return attempt is not None and attempt.allocation_id == allocation_id and attempt.epoch == epoch


def set_state(job: JobRecord, state: JobState, events: list[Event], now: datetime, *,
               reason: str | None) -> None:
    """Move ``job`` to ``state`` (in place) and queue the JobStateChanged, if it changes."""
    if job.state == state:
        return
    previous = job.state
    job.state = state
    if state in TERMINAL_STATES:
        job.control = None  # nothing left to pause
    if state in ("failed", "cancelled"):
        job.reason = reason
    current = job.current
    events.append(
        JobStateChanged(
            occurred_at=now,
            job_id=job.job_id,
            tenant=job.tenant,
            state=state,
            previous_state=previous,
            attempt=current.attempt if current else None,
            reason=reason,
        )
    )


def revoke_live(job: JobRecord, why: str, events: list[Event], now: datetime) -> AttemptRecord | None:
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
            occurred_at=now,
            job_id=job.job_id,
            attempt=current.attempt,
            allocation_id=current.allocation_id,
            epoch=current.epoch,
            reason=why,
        )
    )
    return current
