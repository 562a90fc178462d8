"""The job and attempt state machine, as pure functions.

Each function takes the current :class:`JobRecord` (never mutated) and what happened, and
returns an :class:`Outcome`: the new record, the events to publish with it (staged in the
same Redis MULTI through the outbox), the attempt whose device leases to release
afterwards, and the nodes to blame for a failure (node reputation). No Redis, Kafka or
clock inside: ``now`` is passed in.

Job states::

    queued ──(WorkerStarted)──> running ──(all ranks exit 0 + READY ckpt at maxSteps)──> succeeded
      ^  │                         │
      │  └──(pause)──> paused <────┘ pause: checkpoint first, then revoke (below); resume → queued
      └── attempt failed, retryable, budget left (back-off, resume from latest READY)
    any non-terminal ──(cancel)──> cancelled (revoked at once; READY checkpoints are kept);
    attempt failed, not retryable or budget spent ──> failed

Attempt states: starting → running → succeeded | failed | revoked. An attempt is *live*
(holds leases, has ranks) while starting or running. Attempts revoked by pause, cancel or
preemption never count as failures, nor do attempts *interrupted* (``AttemptRecord.interruption``):
by maintenance (a node drain, :func:`request_drain`: checkpoint, then stop, as for a pause) or by
the control plane (most of the cluster went silent together, :func:`check_attempt`), or by a squatter (rank 0's
node found the rendezvous port held, ``WorkerExited.reason`` ``port-in-use``: the next attempt draws another
port). Interrupted
jobs queue again and resume from their latest READY checkpoint by themselves; nobody is blamed.

Checkpoint, then stop (pause, drain and preemption: one rule). ``request_control(pause)`` on a job
whose ranks run sets ``job.control = "pause"``, records on the attempt when it asked and the latest
READY step then (``preempt_requested_at`` / ``preempt_after_step``) and stages CheckpointRequested;
``request_preemption`` does the same with ``preempted_by``, ``request_drain`` with ``interruption``.
The ranks agree on a step *after* they see the request, save it and exit 7 (reason ``preempted``)
with that step (``WorkerExited.global_step``). The stop checkpoint is that one (:func:`stop_checkpoint`):
never one that was READY, or being written and assembled, when the request came — the ranks have
trained past it — so no READY checkpoint ends a stop before a rank has reported its step. The
attempt is revoked (leases released) once that checkpoint is READY *and* every rank has exited, so
ranks end by their own exit 7 and are never SIGTERMed for it; only when the grace period is over
(``pause_grace_s``; a preemption's ``checkpointGraceSeconds``) is it revoked anyway (the agent stops
what still runs: SIGTERM, then SIGKILL) and the next attempt resumes from the last READY one. The job
then becomes ``paused`` (pause), ``queued`` (preemption, drain); pause wins when both are in
progress. A job with no running rank pauses at once. A stop that ends at the final step (the
checkpoint at ``maxSteps`` is READY) completes the job instead (``succeeded``): ranks that see a
request at the last step save it and exit 0, and a job paused there is completed by ``resume``,
never started again just to finish.

Retry policy (``_fail_attempt``):

* Retryable reasons (``ExitReason.retryable``): crashed, killed, lost or hung ranks, OOM, NCCL errors,
  start time-outs, a missing final checkpoint. Spec errors (``config``, ``data``) and failed
  checkpoint I/O of a rank (``checkpoint``) fail the job at once.
* ``nan`` retries from the latest READY checkpoint, unless an earlier attempt already hit NaN at
  the same global step (``WorkerExited.global_step``, kept as ``AttemptRecord.nan_step``): a
  deterministic NaN would only repeat. A NaN at an unknown step is retried once.
* Failures count *since progress*: an attempt made progress when a READY checkpoint newer than
  the one it started from existed when it ended. The streak of failed attempts since (and
  including) the last one that made progress drives both the back-off (``backoff_s`` doubling to
  ``max_backoff_s``) and the budget: the job fails once ``JobRecord.max_attempts`` failures in a
  row made no progress — a week-long job that fails every few hours but checkpoints in between
  never runs out. ``RetryPolicy.max_total_failures`` optionally caps all failures of a job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from trainyard_contract.events import (
    TERMINAL_STATES,
    AllocationRevoked,
    CheckpointRef,
    CheckpointRequested,
    Event,
    GangAllocated,
    JobState,
    JobStateChanged,
    SecurityViolation,
    WorkerExited,
    WorkerStarted,
)
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import (
    AttemptRecord,
    CheckpointRecord,
    DatasetRecord,
    JobRecord,
    dataset_visible,
    expects_final_checkpoint,
)

from trainyard_scheduler.blame import Silence
from trainyard_scheduler.placement import Placement

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


@dataclass(frozen=True)
class RetryPolicy:
    """Back-off and budget of retries (see the module docstring)."""

    backoff_s: float = 0.5
    max_backoff_s: float = 60.0
    max_total_failures: int | None = None


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
    delay = min(policy.max_backoff_s, policy.backoff_s * 2 ** max(failures_since_progress(job) - 1, 0))
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
    attempt.assignments = placement.assignments()
    attempt.checkpoint_every_steps = checkpoint_every_steps
    new = job.model_copy(deep=True)
    new.attempts.append(attempt)
    new.queued_reason = None
    new.queued_reason_kind = None
    new.updated_at = now
    return Outcome(new, [gang_allocated(new, attempt, now)],
                   note=f"attempt {number} placed on {', '.join(attempt.nodes)}")


def gang_allocated(job: JobRecord, attempt: AttemptRecord, now: datetime) -> GangAllocated:
    """The GangAllocated of ``attempt`` (again: same allocation id and epoch; agents dedupe by allocation)."""
    return GangAllocated(
        occurred_at=now,
        job_id=job.job_id,
        tenant=job.tenant,
        attempt=attempt.attempt,
        allocation_id=attempt.allocation_id,
        epoch=attempt.epoch,
        world_size=attempt.world_size,
        nodes=attempt.assignments,
        master_addr=attempt.master_addr or rank0_host(attempt),
        master_port=attempt.master_port or 29400,
        start_checkpoint=attempt.start_checkpoint,
        spec=job.spec,
        spec_hash=job.spec_hash,
        placement_score=attempt.placement_score,
        placement_detail=attempt.placement_detail,
        checkpoint_every_steps=attempt.checkpoint_every_steps,
    )


def rank0_host(attempt: AttemptRecord) -> str:
    """The advertised address of the node that runs rank 0: where the gang rendezvous (for attempts recorded
    before ``master_addr`` was kept; loopback only when the attempt names no such node, a single-host one)."""
    return next((n.host for n in attempt.assignments if any(r.rank == 0 for r in n.ranks)), "127.0.0.1")


def rank_nodes(attempt: AttemptRecord) -> dict[int, str]:
    """rank → node id of an attempt (empty for attempts recorded before assignments were kept)."""
    return {r.rank: n.node_id for n in attempt.assignments for r in n.ranks}


def _nodes_without_started_ranks(attempt: AttemptRecord) -> list[str]:
    started = set(attempt.started_ranks)
    return [n.node_id for n in attempt.assignments if n.ranks and not any(r.rank in started for r in n.ranks)]


def fail_unstartable(job: JobRecord, reason: str, now: datetime) -> Outcome:
    """A queued job that can never start as specified (e.g. ``initFrom`` names no READY checkpoint)."""
    if job.state in TERMINAL_STATES or is_live(job.current):
        return unchanged(job)
    new = job.model_copy(deep=True)
    new.updated_at = now
    new.queued_reason = new.queued_reason_kind = None
    events: list[Event] = []
    _set_state(new, "failed", events, now, reason=f"config: {reason} (not retryable)")
    return Outcome(new, events, note=f"job failed: {reason}")


def dataset_refusal(dataset: str, tenant: str, record: DatasetRecord | None) -> str | None:
    """Why a job of ``tenant`` may not read ``dataset`` (its spec's ref, as the readers take it: qualified,
    or the platform's); None when it may. ``record`` is the verified version under that ref, if any.

    The API accepts only visible versions and stores the ref qualified, so this refuses what reached the
    bus some other way (a forged JobSubmitted): a version that was never verified (the platform's too:
    files under ``datasets/`` that the registry refused, or never saw, are read by no job), or one that is
    not the job's tenant's to read.
    """
    if record is not None and dataset_visible(record, tenant):
        return None
    return (f"dataset {dataset!r} is not a verified version tenant {tenant!r} may use "
            "(not published, not verified, or not shared with it)")


def security_violation(job: JobRecord, event: SecurityViolation, now: datetime) -> Outcome:
    """A node agent caught a rank of ``job`` claiming what a rank may not (a forged event): the job
    fails at once, whichever attempt it was, with no retry (its code is at fault, not the nodes:
    nobody is blamed); the live attempt is revoked."""
    if job.state in TERMINAL_STATES:
        return unchanged(job, f"security violation reported for a {job.state} job")
    if event.tenant != job.tenant:
        return unchanged(job, f"security violation names tenant {event.tenant!r}, the job is {job.tenant!r}'s")
    new = job.model_copy(deep=True)
    new.updated_at = now
    reason = (f"security: rank {event.rank} of attempt {event.attempt} on {event.node_id}: {event.detail} "
              "(not retryable)")
    events: list[Event] = []
    released = _revoke_live(new, reason, events, now)
    new.control = None
    new.queued_reason = new.queued_reason_kind = None
    _set_state(new, "failed", events, now, reason=reason)
    return Outcome(new, events, release=released, note=f"job failed: {reason}")


def note_waiting(job: JobRecord, reason: str, kind: str | None = None) -> Outcome:
    """Record why a queued job waits (shown by GET while queued)."""
    if job.state != "queued" or (job.queued_reason == reason and job.queued_reason_kind == kind):
        return unchanged(job)
    new = job.model_copy(update={"queued_reason": reason, "queued_reason_kind": kind})
    return Outcome(new)


# ----------------------------------------------------------------------------- checkpoint, then stop


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
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    attempt.preempted_by = by
    new.updated_at = now
    event = _ask_for_checkpoint(new, reason=reason, by=by, latest_ready_step=latest_ready_step,
                                grace_s=grace_s, now=now)
    return Outcome(new, [event], note=f"attempt {attempt.attempt} asked to checkpoint: {reason}")


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
    (:func:`_ranks_stopping` raises ``preempt_after_step`` to that step − 1). Before a rank has reported,
    none counts: a checkpoint READY, or in flight, at the request is at a step the ranks have trained
    past. And it counts only once every rank has exited, so the revocation that follows stops nothing.
    (A rank that reports no step, an exit note it could not write, leaves the request-time step.)
    """
    if attempt.ranks_stopped_at is None or len(attempt.exited_ranks) < attempt.world_size:
        return None
    after = -1 if attempt.preempt_after_step is None else attempt.preempt_after_step
    return latest_ready_step if latest_ready_step is not None and latest_ready_step > after else None


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
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    new.updated_at = now
    draining = current.interruption is not None
    if current.preempted_by is not None and not pausing and not stopped and not draining and not preemptor_waiting:
        by = current.preempted_by
        attempt.preempted_by = attempt.preempt_requested_at = attempt.preempt_after_step = None
        return Outcome(new, note=f"preemption for {by} withdrawn: it no longer waits")
    ready = stop_checkpoint(current, latest_ready_step)
    since = current.preempt_requested_at or current.ranks_stopped_at or now
    grace = pause_grace_s if (pausing or draining) and pause_grace_s is not None else grace_s
    if ready is None and (now - since).total_seconds() < grace:
        return unchanged(job)
    how = (f"its ranks stopped and the checkpoint at step {ready} is READY" if ready is not None
           else f"no checkpoint of its ranks READY within {grace:.0f}s; it resumes from the last READY one")
    return _end_stop(new, how, latest_ready_step, now)


def _ask_for_checkpoint(new: JobRecord, *, reason: str, by: str | None, latest_ready_step: int | None,
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


def _end_stop(new: JobRecord, how: str, latest_ready_step: int | None, now: datetime) -> Outcome:
    """Revoke the stopping attempt of ``new`` (a private copy): paused for a pause, else queued — or
    succeeded, when the checkpoint it stops with is the final one (nothing is left to run)."""
    attempt = new.attempts[-1]
    attempt.ready_step_at_end = latest_ready_step
    if latest_ready_step is not None and is_final_step(new, latest_ready_step):
        return _complete(new, f"the checkpoint at step {latest_ready_step} (maxSteps) is READY", now)
    if new.control == "pause":
        return _finish_pause(new, how, now)
    if attempt.interruption is not None:
        return _interrupt(new, attempt.interruption, how, latest_ready_step, now)
    by = attempt.preempted_by
    return _revoke_preempted(new, by, how, now)


def _finish_pause(new: JobRecord, how: str, now: datetime) -> Outcome:
    events: list[Event] = []
    released = _revoke_live(new, "paused", events, now)
    new.control = None
    why = f"paused ({how})" if released is not None else "paused"
    if released is not None:
        released.failure_reason = why  # which checkpoint it paused with, as a preemption or drain says
    _set_state(new, "paused", events, now, reason=why)
    new.queued_reason = new.queued_reason_kind = None
    new.updated_at = now
    return Outcome(new, events, release=released, note=why)


def _complete(new: JobRecord, how: str, now: datetime) -> Outcome:
    """The job's final checkpoint is READY: succeeded (a live attempt is revoked, its leases released),
    whatever pause or stop was asked for."""
    events: list[Event] = []
    released = _revoke_live(new, f"completed: {how}", events, now)
    new.queued_reason = new.queued_reason_kind = None
    new.updated_at = now
    _set_state(new, "succeeded", events, now, reason=None)
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
    _set_state(new, "queued", events, now, reason=why)
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
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    attempt.interruption = f"maintenance: {reason}"
    new.updated_at = now
    if not current.started_ranks:
        return _interrupt(new, attempt.interruption, "its ranks had not started", latest_ready_step, now)
    if is_stopping(job):
        return Outcome(new, note=f"attempt {attempt.attempt} already stopping; marked {attempt.interruption}")
    event = _ask_for_checkpoint(new, reason=f"drain: {reason}", by=None, latest_ready_step=latest_ready_step,
                                grace_s=grace_s, now=now)
    return Outcome(new, [event], note=f"attempt {attempt.attempt} asked to checkpoint and stop: {reason}")


def _interrupt(new: JobRecord, why: str, how: str, latest_ready_step: int | None, now: datetime) -> Outcome:
    """End the live attempt of ``new`` (a private copy) without a failure: revoked (no budget spent,
    nobody blamed); the job queues again (or pauses, if a pause was asked) and resumes by itself."""
    attempt = new.attempts[-1]
    attempt.interruption = why
    attempt.ready_step_at_end = latest_ready_step
    if new.control == "pause":
        return _finish_pause(new, how, now)
    new.updated_at = now
    events: list[Event] = []
    released = _revoke_live(new, why, events, now)
    if released is not None:
        released.failure_reason = f"{why} ({how})"
    kind = why.split(":", 1)[0]
    _set_state(new, "queued", events, now, reason=f"interrupted by {kind}")
    start = "the latest READY checkpoint" if latest_ready_step is None else f"the checkpoint at step {latest_ready_step}"
    new.queued_reason = (f"attempt {attempt.attempt} interrupted by {why} ({how}); not a failure: attempt "
                         f"{attempt.attempt + 1} resumes from {start} by itself")
    new.queued_reason_kind = "maintenance" if kind == "maintenance" else "interrupted"
    return Outcome(new, events, release=released, note=f"attempt {attempt.attempt} interrupted: {why}")


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
        _set_state(new, "running", events, now, reason=None)
    return Outcome(new, events)


def worker_exited(
    job: JobRecord, event: WorkerExited, *, final_ready: bool, policy: RetryPolicy, now: datetime,
    latest_ready_step: int | None = None,
) -> Outcome:
    """Record a rank's exit; a non-zero exit fails the attempt; all zero completes it.

    ``final_ready``: a READY checkpoint at ``maxSteps`` exists (then completion = success).
    ``latest_ready_step``: the latest READY step of the job (progress, and the end of a stop).
    A rank that exits ``preempted`` checkpointed on request: the attempt ends once that
    checkpoint is READY (see the module docstring), never as a failure.
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
    if event.saved_step is not None and is_final_step(job, event.saved_step):
        attempt.final_saved = True
    new.updated_at = now
    if not is_live(current) or job.state in TERMINAL_STATES:
        return Outcome(new, note="exit recorded for an ended attempt")
    said = ExitReason.parse(event.reason)
    # how ranks end when their node stops them on purpose: during a drain, part of the stop, not failures
    stopping = attempt.ranks_stopped_at is not None or (attempt.interruption is not None and said.stops_on_purpose)
    if event.exit_code != 0 and (said is ExitReason.PREEMPTED or stopping):
        return _ranks_stopping(new, event, latest_ready_step, now)
    if said is ExitReason.PORT_IN_USE:  # someone holds the port on rank 0's node: another port, no budget, no blame
        return _interrupt(new, f"rendezvous port: {event.detail or f'port in use on {event.node_id}'}",
                          "its ranks had not started", latest_ready_step, now)
    if event.exit_code != 0:
        reason = _classify(event.reason, event.exit_code)
        detail = f"rank {event.rank} on {event.node_id} exited with code {event.exit_code}"
        if event.detail:
            detail += f": {event.detail}"
        retryable = ExitReason.parse(reason).retryable
        if reason == ExitReason.NAN:
            retryable = not _nan_repeats(new, event.global_step)
            attempt.nan_step = event.global_step
            at = "an unknown step" if event.global_step is None else f"step {event.global_step}"
            detail += (f" (NaN at {at}, " + ("first time: retried from the latest READY checkpoint)" if retryable
                                             else "as in an earlier attempt: it would only repeat)"))
        return _fail_attempt(new, reason, detail, policy, now, latest_ready_step=latest_ready_step,
                             retryable=retryable, blame=[(event.node_id, reason)])
    ranks_ok = len(attempt.exited_ranks) >= attempt.world_size and all(
        code == 0 for code in attempt.exited_ranks.values()
    )
    if not ranks_ok:
        return Outcome(new)
    attempt.state = "succeeded"
    attempt.ended_at = now
    attempt.ready_step_at_end = latest_ready_step
    events: list[Event] = []
    if final_ready or not expects_final_checkpoint(new):
        _set_state(new, "succeeded", events, now, reason=None)
    return Outcome(new, events, release=attempt, note=f"attempt {attempt.attempt} completed")


def _ranks_stopping(new: JobRecord, event: WorkerExited, latest_ready_step: int | None, now: datetime) -> Outcome:
    """A rank checkpointed and stopped (or exited while its gang stops): end the stop once READY."""
    attempt = new.attempts[-1]
    if attempt.ranks_stopped_at is None:
        attempt.ranks_stopped_at = now
    if event.reason == "preempted" and event.global_step is not None:
        # Its checkpoint is at (or after) the step it completed: wait for that one, not an older one.
        after = -1 if attempt.preempt_after_step is None else attempt.preempt_after_step
        attempt.preempt_after_step = max(after, event.global_step - 1)
    every = len(attempt.exited_ranks) >= attempt.world_size
    if attempt.preempt_after_step is None and every:  # stopped unasked, and no step to wait for
        return _end_stop(new, "its ranks checkpointed and stopped", latest_ready_step, now)
    ready = stop_checkpoint(attempt, latest_ready_step)
    if ready is not None:
        return _end_stop(new, f"its ranks stopped and the checkpoint at step {ready} is READY",
                         latest_ready_step, now)
    waiting = "its checkpoint to be READY" if every else "every rank to exit"
    return Outcome(new, note=f"rank {event.rank} stopped ({event.reason}); waiting for {waiting}")


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
    _set_state(new, "succeeded", events, now, reason=None)
    return Outcome(new, events)


def checkpoint_failed(job: JobRecord, *, global_step: int, reason: str, policy: RetryPolicy,
                      now: datetime, latest_ready_step: int | None = None, attempt: int | None = None) -> Outcome:
    """The final checkpoint of a completed attempt failed: retry from the latest READY one.

    A failed intermediate checkpoint changes nothing: the attempt trains on and writes the next.
    ``attempt``: the attempt that wrote it; a late failure of an earlier (fenced) attempt's checkpoint
    says nothing about the current one.
    """
    current = job.current
    if job.state in TERMINAL_STATES or not is_final_step(job, global_step):
        return unchanged(job)
    if current is None or current.state != "succeeded":
        return unchanged(job)
    if attempt is not None and attempt != current.attempt:
        return unchanged(job, f"checkpoint failure of attempt {attempt} ignored: attempt {current.attempt} is current")
    detail = f"the checkpoint at step {global_step} failed: {reason}"
    return _fail_attempt(job.model_copy(deep=True), "checkpoint-missing", detail, policy, now,
                         latest_ready_step=latest_ready_step)


# ----------------------------------------------------------------------------- control


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
        return _complete(job.model_copy(deep=True), f"{action}: the checkpoint at maxSteps is READY", now)
    if action == "resume":
        return _resume(job, reason, now)
    if action == "pause" and (job.state == "paused" or job.control == "pause"):
        return unchanged(job, "already paused" if job.state == "paused" else "already pausing")
    if action not in ("cancel", "pause"):
        return unchanged(job, f"unknown action {action!r}")
    new = job.model_copy(deep=True)
    new.updated_at = now
    current = new.current
    if action == "pause" and job.state == "running" and current is not None and current.state == "succeeded":
        new.control = "pause"  # honoured by _fail_attempt if the final checkpoint fails; success clears it
        return Outcome(new, note=f"pause: attempt {current.attempt} finished its last step; the job completes "
                                 "once its final checkpoint is READY")
    if action == "pause" and is_live(current) and current is not None and current.started_ranks:
        new.control = "pause"
        events: list[Event] = []
        asked = current.preempt_requested_at is not None or current.ranks_stopped_at is not None
        if not asked:  # a preemption in progress asked already
            events.append(_ask_for_checkpoint(new, reason="pause requested", by=None,
                                              latest_ready_step=latest_ready_step, grace_s=grace_s, now=now))
        return Outcome(new, events, note=f"pause requested: attempt {current.attempt} checkpoints first")
    events = []
    released = _revoke_live(new, "cancelled" if action == "cancel" else "paused", events, now)
    target: JobState = "cancelled" if action == "cancel" else "paused"
    new.control = None
    _set_state(new, target, events, now, reason=reason or f"{target} by request")
    new.queued_reason = None
    return Outcome(new, events, release=released)


def _resume(job: JobRecord, reason: str | None, now: datetime) -> Outcome:
    if job.control == "pause" and job.state != "paused":
        new = job.model_copy(deep=True)
        new.control = None
        new.updated_at = now
        return Outcome(new, note="pause withdrawn by resume")
    if job.state != "paused":
        return unchanged(job, f"resume ignored: job is {job.state}")
    new = job.model_copy(deep=True)
    new.updated_at = now
    events: list[Event] = []
    _set_state(new, "queued", events, now, reason=reason or "resumed")
    new.queued_reason = "resumed; waiting for placement (from the latest READY checkpoint)"
    return Outcome(new, events)


# ----------------------------------------------------------------------------- reconcile


def check_attempt(
    job: JobRecord,
    *,
    available_nodes: frozenset[str],
    final_ready: bool,
    deadlines: Deadlines,
    policy: RetryPolicy,
    now: datetime,
    latest_ready_step: int | None = None,
    judge: Callable[[list[str]], Silence] | None = None,
    watched_s: float | None = None,
) -> Outcome:
    """Periodic liveness check of the current attempt, from durable state only.

    ``judge``: who is to blame for the attempt's silent nodes (:func:`trainyard_scheduler.blame.judge_silence`
    bound to the cluster's heartbeats); without one, a silent node is always the node's fault. A silent
    node that is being drained is left to the drain, silence the scheduler could not have seen (it just
    started leading) is waited out, and a cluster gone silent together interrupts the attempt without
    blame or failure budget (``_interrupt``). ``watched_s``: how long this scheduler has led; a start
    time-out that began before it was watching (the platform was down, so the GangAllocated may have
    been lost with the broker) is an interruption too, not the nodes' fault.

    Ranks that never start, a node that stops heart-beating, and a completed attempt whose
    final checkpoint never turns READY all fail the attempt (and so retry it); a completed
    attempt whose final checkpoint is READY (its CheckpointReady was lost) succeeds the job.
    Before the start time-out, an attempt whose ranks have not all started gets its
    GangAllocated published again (``deadlines.republish_*``): the broker may have lost it.
    """
    current = job.current
    if current is None or job.state in TERMINAL_STATES or job.state == "paused":
        return unchanged(job)
    if is_live(current):
        # 1. a node went silent  2. the ranks did not all start in time  3. GangAllocated again, maybe
        silent = _on_silent_nodes(job, current, available_nodes, judge, policy, now, latest_ready_step)
        if silent is not None:
            return silent
        late = _on_start_timeout(job, current, deadlines, policy, now, latest_ready_step, watched_s)
        if late is not None:
            return late
        return _maybe_republish(job, deadlines, now)
    if current.state == "succeeded" and job.state == "running":
        return _on_completed(job, current, final_ready, deadlines, policy, now, latest_ready_step)
    return unchanged(job)


def _on_silent_nodes(job: JobRecord, current: AttemptRecord, available_nodes: frozenset[str],
                     judge: Callable[[list[str]], Silence] | None, policy: RetryPolicy, now: datetime,
                     latest_ready_step: int | None) -> Outcome | None:
    """A live attempt with a node gone from ``available_nodes``: interrupted, failed or left as the judge
    says; None when every node is there (or the verdict is none of these)."""
    lost = [n for n in current.nodes if n not in available_nodes]
    if not lost:
        return None
    silence = judge(current.nodes) if judge is not None else Silence(
        "node", tuple(lost), f"node {', '.join(lost)} stopped sending heartbeats")
    if silence.verdict == "control-plane":
        return _interrupt(job.model_copy(deep=True), f"control-plane: {silence.detail}", "its ranks were "
                          "revoked", latest_ready_step, now)
    if silence.verdict == "node":
        return _fail_attempt(job.model_copy(deep=True), "lost", silence.detail, policy, now,
                             latest_ready_step=latest_ready_step,
                             blame=[(n, "lost") for n in silence.nodes])
    if silence.verdict in ("drain", "wait"):
        return unchanged(job, silence.detail)
    return None


def _on_start_timeout(job: JobRecord, current: AttemptRecord, deadlines: Deadlines, policy: RetryPolicy,
                      now: datetime, latest_ready_step: int | None, watched_s: float | None) -> Outcome | None:
    """A live attempt whose ranks have not all started within the start time-out: failed, blaming the nodes
    without a started rank, or interrupted when the time-out began before this scheduler was watching;
    None before the time-out."""
    age = (now - current.started_at).total_seconds()
    if len(current.started_ranks) >= current.world_size or age <= deadlines.start_timeout_s:
        return None
    started = len(current.started_ranks)
    detail = f"{started} of {current.world_size} ranks started within {deadlines.start_timeout_s:.0f}s"
    if watched_s is not None and watched_s < deadlines.start_timeout_s:
        return _interrupt(job.model_copy(deep=True), f"control-plane: {detail}, while the control plane "
                          f"was away (this scheduler has led for {watched_s:.0f}s)", "revoked",
                          latest_ready_step, now)
    blame = [(n, "start-timeout") for n in _nodes_without_started_ranks(current)]
    return _fail_attempt(job.model_copy(deep=True), "start-timeout", detail, policy, now,
                         latest_ready_step=latest_ready_step, blame=blame)


def _on_completed(job: JobRecord, current: AttemptRecord, final_ready: bool, deadlines: Deadlines,
                  policy: RetryPolicy, now: datetime, latest_ready_step: int | None) -> Outcome:
    """A running job's attempt that completed: the job succeeds once its final checkpoint is READY (or none is
    expected), the attempt fails when that checkpoint is late past the time-out."""
    if final_ready or not expects_final_checkpoint(job):
        new = job.model_copy(deep=True)
        new.updated_at = now
        events: list[Event] = []
        _set_state(new, "succeeded", events, now, reason=None)
        return Outcome(new, events)
    waited = (now - (current.ended_at or now)).total_seconds()
    if waited > deadlines.final_checkpoint_timeout_s:
        detail = (f"every rank exited 0 but no READY checkpoint at step {job.spec.training.max_steps} "
                  f"appeared within {deadlines.final_checkpoint_timeout_s:.0f}s")
        return _fail_attempt(job.model_copy(deep=True), "checkpoint-missing", detail, policy, now,
                             latest_ready_step=latest_ready_step)
    return unchanged(job)


def _maybe_republish(job: JobRecord, deadlines: Deadlines, now: datetime) -> Outcome:
    """GangAllocated again (same allocation and epoch) for a live attempt whose ranks have not all started."""
    current = job.current
    assert current is not None
    if (deadlines.republish_after_s is None or current.republished >= deadlines.republish_max
            or len(current.started_ranks) >= current.world_size or not current.assignments):
        return unchanged(job)
    since = current.republished_at or current.started_at
    if (now - since).total_seconds() < deadlines.republish_after_s:
        return unchanged(job)
    new = job.model_copy(deep=True)
    attempt = new.attempts[-1]
    attempt.republished += 1
    attempt.republished_at = now
    new.updated_at = now
    started = len(current.started_ranks)
    return Outcome(new, [gang_allocated(new, attempt, now)],
                   note=f"{started} of {attempt.world_size} ranks started after {(now - since).total_seconds():.0f}s; "
                        f"GangAllocated {attempt.allocation_id} published again ({attempt.republished} of "
                        f"{deadlines.republish_max})")


# ----------------------------------------------------------------------------- helpers


def _is_current(attempt: AttemptRecord | None, allocation_id: str, epoch: int) -> bool:
    return attempt is not None and attempt.allocation_id == allocation_id and attempt.epoch == epoch


def _classify(reason: str, exit_code: int) -> str:
    """The reason a failed attempt is recorded with: the rank's, every ``signal-<n>`` as ``signal``; a non-zero
    exit that gave none is an ``error``. An unknown reason is kept as given (and is not retried)."""
    said = ExitReason.parse(reason)
    if said is not ExitReason.OK:
        return said.value if said is not ExitReason.UNKNOWN else reason
    return ExitReason.ERROR.value if exit_code else ExitReason.OK.value


def _nan_repeats(job: JobRecord, step: int | None) -> bool:
    """Whether an earlier attempt of ``job`` hit NaN at ``step`` (any NaN, when the step is unknown)."""
    earlier = [a for a in job.attempts[:-1] if a.state == "failed" and (a.failure_reason or "").startswith("nan:")]
    if step is None:
        return bool(earlier)
    return any(a.nan_step == step for a in earlier)


def _set_state(job: JobRecord, state: JobState, events: list[Event], now: datetime, *,
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
            occurred_at=now,
            job_id=job.job_id,
            attempt=current.attempt,
            allocation_id=current.allocation_id,
            epoch=current.epoch,
            reason=why,
        )
    )
    return current


def _fail_attempt(job: JobRecord, reason: str, detail: str, policy: RetryPolicy, now: datetime, *,
                  latest_ready_step: int | None = None, retryable: bool | None = None,
                  blame: list[tuple[str, str]] | None = None) -> Outcome:
    """Fail the current attempt of ``job`` (a private copy, changed in place); retry or fail the job.

    The retry policy is the module docstring's; a job being paused becomes ``paused`` instead of
    ``queued``.
    """
    attempt = job.attempts[-1]
    events: list[Event] = []
    released = None
    if is_live(attempt):
        events.append(
            AllocationRevoked(
                occurred_at=now,
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
    attempt.ready_step_at_end = latest_ready_step
    job.updated_at = now
    blamed = list(blame or [])
    retryable = ExitReason.parse(reason).retryable if retryable is None else retryable
    streak, total = failures_since_progress(job), failures(job)
    capped = policy.max_total_failures is not None and total >= policy.max_total_failures
    if retryable and streak < job.max_attempts and not capped:
        why = f"attempt {attempt.attempt} failed ({reason}: {detail})"
        if job.control == "pause":
            job.control = None
            job.queued_reason = job.queued_reason_kind = None
            _set_state(job, "paused", events, now, reason=f"{why}; paused as requested")
            return Outcome(job, events, release=released, note=f"{why}; paused", blame=blamed)
        not_before = retry_not_before(job, policy)
        job.queued_reason = (
            f"{why}; attempt {attempt.attempt + 1} resumes from the latest READY checkpoint"
            + (f" after {not_before.isoformat(timespec='seconds')}" if not_before else "")
        )
        job.queued_reason_kind = "backoff"
        _set_state(job, "queued", events, now, reason=why)
        return Outcome(job, events, release=released, note=why, blame=blamed)
    if not retryable:
        budget = f"{total} failed; not retryable"
    elif capped:
        budget = f"{total} failed in all, the cap is {policy.max_total_failures}"
    else:
        budget = f"{streak} of {job.max_attempts} failed in a row without a new READY checkpoint"
    why = f"{reason}: {detail} (attempt {attempt.attempt}, {budget})"
    job.queued_reason = None
    job.control = None
    _set_state(job, "failed", events, now, reason=why)
    return Outcome(job, events, release=released, note=f"job failed: {why}", blame=blamed)
