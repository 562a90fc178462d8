"""What ranks and checkpoints report: a rank started or exited, the final checkpoint READY or failed. Pure.

A rank's exit is read against the attempt (:func:`exit_happening`) into one row of the table: recorded only
(its attempt or job already ended), part of a stop (``preempted``, or any reason a node stops ranks with
while the attempt stops: ``ExitReason.stops_on_purpose``), an interruption (``port-in-use``), a failure
(any other non-zero exit: :func:`~trainyard_scheduler.transitions.retry.fail_attempt`), or one more rank
done (every rank exited 0: the attempt completed; the job succeeds once its final checkpoint is READY).
"""

from __future__ import annotations

from datetime import datetime

from trainyard_contract.events import TERMINAL_STATES, EnvironmentPreparing, Event, WorkerExited, WorkerStarted
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import JobRecord, NodeEnvironment, expects_final_checkpoint

from trainyard_scheduler.transitions.replicas import (
    is_stale_generation,
    newcomers_started,
    replace_replica,
    replica_refusal,
    waiting_newcomers,
)
from trainyard_scheduler.transitions.retry import classify_failure, fail_attempt, nan_repeats
from trainyard_scheduler.transitions.state import (
    Outcome,
    RetryPolicy,
    is_current,
    is_final_step,
    is_live,
    set_state,
    stop_checkpoint,
    unchanged,
)
from trainyard_scheduler.transitions.stops import end_stop, interrupt, private_copy
from trainyard_scheduler.transitions.table import Happening, enter


def worker_started(job: JobRecord, event: WorkerStarted, now: datetime) -> Outcome:
    """A rank of the current attempt started: the attempt runs; the job goes queued → running."""
    return workers_started(job, [event], now)


def workers_started(job: JobRecord, events: list[WorkerStarted], now: datetime) -> Outcome:
    """Ranks of the current attempt started (one, or a gang's of one batch): one copy of the record, one write —
    a 512-rank gang rewrote (and deep-copied) a growing record 512 times. A rank of a stale or ended attempt is
    ignored, a rank already started counts once."""
    current = job.current
    fresh = [e for e in events if is_current(current, e.allocation_id, e.epoch)] if is_live(current) else []
    if current is not None:
        fresh = [e for e in fresh if not is_stale_generation(current, e)]
    if not fresh:
        return unchanged(job, "worker of a stale or ended attempt (or generation)")
    assert current is not None
    if current.state == "running" and all(e.rank in current.started_ranks for e in fresh) \
            and not waiting_newcomers(current, fresh):
        return unchanged(job, "duplicate WorkerStarted")

    def start() -> Outcome:
        new = private_copy(job, now)
        attempt = new.attempts[-1]
        started, starts = set(attempt.started_ranks), dict(attempt.starts)
        for event in fresh:
            if event.rank in started:
                continue
            started.add(event.rank)
            if event.start is not None:
                starts[event.start] = starts.get(event.start, 0) + 1
                if event.start == "cold" and event.start_detail:
                    attempt.start_detail = event.start_detail
        attempt.started_ranks, attempt.starts = sorted(started), starts
        newcomers_started(attempt, fresh, now)  # a replaced replica's newcomer: stepping again
        attempt.state = "running"
        events_out: list[Event] = []
        if new.state == "queued":
            set_state(new, "running", events_out, now, reason=None)
        return Outcome(new, events_out)

    return enter(job, Happening.RANK_STARTED, start)


def worker_runs(events: list[Event]) -> list[list[Event]]:
    """A batch of WORKERS events as the writes to make, in order per job: each job's events in the order
    they came (a partition's order is a job's order: the key is the job), with a run of consecutive
    WorkerStarted of one job as one write; every other event is a write of its own."""
    by_job: dict[str, list[list[Event]]] = {}
    for event in events:
        runs = by_job.setdefault(str(getattr(event, "job_id", "")), [])
        if isinstance(event, WorkerStarted) and runs and isinstance(runs[-1][-1], WorkerStarted):
            runs[-1].append(event)
        else:
            runs.append([event])
    return [run for runs in by_job.values() for run in runs]


def environment_noted(job: JobRecord, event: EnvironmentPreparing, now: datetime) -> Outcome:
    """A node's progress with the job's environment: recorded on the attempt (``jobs get`` shows it); the
    attempt's start time-out counts from the latest one (:func:`~trainyard_scheduler.transitions.reconcile`),
    so a long build that keeps reporting is not taken for a node that cannot start its ranks."""
    current = job.current
    if not is_current(current, event.allocation_id, event.epoch) or not is_live(current):
        return unchanged(job, "environment of a stale or ended attempt")
    assert current is not None
    noted = NodeEnvironment(environment=event.environment, state=event.state, cached=event.cached,
                            packages=event.packages, elapsed_seconds=event.elapsed_seconds, detail=event.detail,
                            at=now)
    earlier = current.environment.get(event.node_id)
    if earlier is not None and earlier.state in ("ready", "failed") and event.state == "building":
        return unchanged(job, "environment progress after its end (redelivered)")

    def note() -> Outcome:
        new = private_copy(job, now)
        new.attempts[-1].environment = {**new.attempts[-1].environment, event.node_id: noted}
        return Outcome(new, [])

    return enter(job, Happening.ENVIRONMENT_NOTED, note)


def worker_exited(
    job: JobRecord, event: WorkerExited, *, final_ready: bool, policy: RetryPolicy, now: datetime,
    latest_ready_step: int | None = None,
) -> Outcome:
    """Record a rank's exit; a non-zero exit fails the attempt; all zero completes it.

    ``final_ready``: a READY checkpoint at ``maxSteps`` exists (then completion = success).
    ``latest_ready_step``: the latest READY step of the job (progress, and the end of a stop).
    A rank that exits ``preempted`` checkpointed on request: the attempt ends once that
    checkpoint is READY (see ``stops``), never as a failure.
    """
    current = job.current
    if not is_current(current, event.allocation_id, event.epoch):
        return unchanged(job, "exit of a stale attempt")
    assert current is not None
    if is_stale_generation(current, event):
        return unchanged(job, f"exit of rank {event.rank}'s generation {event.generation}, replaced already")
    if current.exited_ranks.get(str(event.rank)) == event.exit_code:
        return unchanged(job, "duplicate WorkerExited")
    new = private_copy(job, now)
    attempt = new.attempts[-1]
    attempt.exited_ranks = {**attempt.exited_ranks, str(event.rank): event.exit_code}
    if event.saved_step is not None and is_final_step(job, event.saved_step):
        attempt.final_saved = True
    happening = exit_happening(job, new, event)
    effects = {
        Happening.EXIT_RECORDED: lambda: Outcome(new, note="exit recorded for an ended attempt"),
        Happening.RANK_STOPPED: lambda: _ranks_stopping(new, event, latest_ready_step, now),
        # someone holds the port on rank 0's node: another port, no budget, no blame
        Happening.PORT_SQUATTED: lambda: interrupt(
            new, f"rendezvous port: {event.detail or f'port in use on {event.node_id}'}",
            "its ranks had not started", latest_ready_step, now),
        Happening.RANK_FAILED: lambda: _rank_failed(new, event, policy, now, latest_ready_step),
        Happening.REPLICA_FAILED: lambda: replace_replica(new, event, classify_failure(event.reason, event.exit_code),
                                                          _failure_detail(event), now),
        Happening.RANK_DONE: lambda: Outcome(new),
        Happening.ATTEMPT_COMPLETED: lambda: _attempt_completed(new, final_ready, latest_ready_step, now),
    }
    return enter(job, happening, effects[happening])


def exit_happening(job: JobRecord, new: JobRecord, event: WorkerExited) -> Happening:
    """Which row a rank's exit is: ``job`` before it, ``new`` with the exit recorded."""
    if not is_live(job.current) or job.state in TERMINAL_STATES:
        return Happening.EXIT_RECORDED
    attempt = new.attempts[-1]
    said = ExitReason.parse(event.reason)
    # how ranks end when their node stops them on purpose: during a drain, part of the stop, not failures
    stopping = attempt.ranks_stopped_at is not None or (attempt.interruption is not None and said.stops_on_purpose)
    if event.exit_code != 0 and (said is ExitReason.PREEMPTED or stopping):
        return Happening.RANK_STOPPED
    if said is ExitReason.PORT_IN_USE:
        return Happening.PORT_SQUATTED
    if event.exit_code != 0:
        reason = classify_failure(event.reason, event.exit_code)
        if new.spec.fault_tolerance is not None and replica_refusal(new, attempt, event, reason) is None:
            return Happening.REPLICA_FAILED
        return Happening.RANK_FAILED
    # a replaced replica whose newcomer never started (it would have nothing to heal from) does not hold it up
    waiting = {r.rank for r in attempt.replacements if r.started_at is None} - {int(r) for r in attempt.exited_ranks}
    every = len(attempt.exited_ranks) + len(waiting) >= attempt.world_size
    if every and all(code == 0 for code in attempt.exited_ranks.values()):
        return Happening.ATTEMPT_COMPLETED
    return Happening.RANK_DONE


def _rank_failed(new: JobRecord, event: WorkerExited, policy: RetryPolicy, now: datetime,
                 latest_ready_step: int | None) -> Outcome:
    """A rank failed: the attempt fails (a NaN is retried only the first time at its step); its node is blamed
    as much as the reason says. (A fault-tolerant attempt's replica that may be replaced is ``REPLICA_FAILED``
    instead: :mod:`~trainyard_scheduler.transitions.replicas`; here the detail says why it was not.)"""
    attempt = new.attempts[-1]
    reason = classify_failure(event.reason, event.exit_code)
    detail = _failure_detail(event)
    if new.spec.fault_tolerance is not None:
        detail += f" (not replaced while training on: {replica_refusal(new, attempt, event, reason)})"
    retryable = ExitReason.parse(reason).retryable
    if reason == ExitReason.NAN:
        retryable = not nan_repeats(new, event.global_step)
        attempt.nan_step = event.global_step
        at = "an unknown step" if event.global_step is None else f"step {event.global_step}"
        detail += (f" (NaN at {at}, " + ("first time: retried from the latest READY checkpoint)" if retryable
                                         else "as in an earlier attempt: it would only repeat)"))
    return fail_attempt(new, reason, detail, policy, now, latest_ready_step=latest_ready_step,
                        retryable=retryable, blame=[(event.node_id, reason)])


def _failure_detail(event: WorkerExited) -> str:
    detail = f"rank {event.rank} on {event.node_id} exited with code {event.exit_code}"
    return f"{detail}: {event.detail}" if event.detail else detail


def _attempt_completed(new: JobRecord, final_ready: bool, latest_ready_step: int | None, now: datetime) -> Outcome:
    attempt = new.attempts[-1]
    attempt.state = "succeeded"
    attempt.ended_at = now
    attempt.ready_step_at_end = latest_ready_step
    events: list[Event] = []
    if final_ready or not expects_final_checkpoint(new):
        set_state(new, "succeeded", events, now, reason=None)
    return Outcome(new, events, release=attempt, note=f"attempt {attempt.attempt} completed")


def _ranks_stopping(new: JobRecord, event: WorkerExited, latest_ready_step: int | None, now: datetime) -> Outcome:
    """A rank checkpointed and stopped (or exited while its gang stops): end the stop once READY."""
    attempt = new.attempts[-1]
    if attempt.ranks_stopped_at is None:
        attempt.ranks_stopped_at = now
    if event.reason == ExitReason.PREEMPTED and event.global_step is not None:
        # Its checkpoint is at (or after) the step it completed: wait for that one, not an older one.
        after = -1 if attempt.preempt_after_step is None else attempt.preempt_after_step
        attempt.preempt_after_step = max(after, event.global_step - 1)
    every = len(attempt.exited_ranks) >= attempt.world_size
    if attempt.preempt_after_step is None and every:  # stopped unasked, and no step to wait for
        return end_stop(new, "its ranks checkpointed and stopped", latest_ready_step, now)
    ready = stop_checkpoint(attempt, latest_ready_step)
    if ready is not None:
        return end_stop(new, f"its ranks stopped and the checkpoint at step {ready} is READY",
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

    def succeed() -> Outcome:
        new = private_copy(job, now)
        events: list[Event] = []
        set_state(new, "succeeded", events, now, reason=None)
        return Outcome(new, events)

    return enter(job, Happening.FINAL_READY, succeed)


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
    return enter(job, Happening.FINAL_FAILED, lambda: fail_attempt(
        job.model_copy(deep=True), ExitReason.CHECKPOINT_MISSING, detail, policy, now,
        latest_ready_step=latest_ready_step))
