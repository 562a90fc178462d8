"""Reconcile: the periodic check of a job's current attempt, from durable state only. Pure.

A node gone silent (the judge says whose fault: ``blame.judge_silence``), ranks that did not all start in
time, a GangAllocated the broker may have lost, and a completed attempt whose final checkpoint is READY (its
event lost) or never turned READY. docs/design.md §3.6.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from trainyard_contract.events import TERMINAL_STATES, Event
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import AttemptRecord, JobRecord, expects_final_checkpoint

from trainyard_scheduler.blame import Silence
from trainyard_scheduler.transitions.admission import gang_allocated
from trainyard_scheduler.transitions.retry import fail_attempt
from trainyard_scheduler.transitions.state import (
    Deadlines,
    Outcome,
    RetryPolicy,
    is_live,
    nodes_without_started_ranks,
    set_state,
    unchanged,
)
from trainyard_scheduler.transitions.stops import interrupt
from trainyard_scheduler.transitions.table import Happening, enter


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
    blame or failure budget (``interrupt``). ``watched_s``: how long this scheduler has led; a start
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
        return enter(job, Happening.CLUSTER_SILENT, lambda: interrupt(
            job.model_copy(deep=True), f"{ExitReason.CONTROL_PLANE}: {silence.detail}", "its ranks were revoked",
            latest_ready_step, now))
    if silence.verdict == "node":
        return enter(job, Happening.NODE_SILENT, lambda: fail_attempt(
            job.model_copy(deep=True), ExitReason.LOST, silence.detail, policy, now,
            latest_ready_step=latest_ready_step, blame=[(n, ExitReason.LOST) for n in silence.nodes]))
    if silence.verdict in ("drain", "wait"):
        return unchanged(job, silence.detail)
    return None


def start_clock(current: AttemptRecord) -> datetime:
    """When the attempt's start time-out starts counting: its placement, or a node's latest word on the job's
    environment (a build that keeps reporting progress is not a node that cannot start ranks)."""
    return max([current.started_at, *(e.at for e in current.environment.values())])


def _on_start_timeout(job: JobRecord, current: AttemptRecord, deadlines: Deadlines, policy: RetryPolicy,
                      now: datetime, latest_ready_step: int | None, watched_s: float | None) -> Outcome | None:
    """A live attempt whose ranks have not all started within the start time-out: failed, blaming the nodes
    without a started rank, or interrupted when the time-out began before this scheduler was watching;
    None before the time-out."""
    age = (now - start_clock(current)).total_seconds()
    if len(current.started_ranks) >= current.world_size or age <= deadlines.start_timeout_s:
        return None
    started = len(current.started_ranks)
    detail = f"{started} of {current.world_size} ranks started within {deadlines.start_timeout_s:.0f}s"
    if watched_s is not None and watched_s < deadlines.start_timeout_s:
        why = (f"{ExitReason.CONTROL_PLANE}: {detail}, while the control plane was away (this scheduler has led "
               f"for {watched_s:.0f}s)")
        return enter(job, Happening.START_TIMEOUT_UNWATCHED, lambda: interrupt(
            job.model_copy(deep=True), why, "revoked", latest_ready_step, now))
    blame = [(n, ExitReason.START_TIMEOUT) for n in nodes_without_started_ranks(current)]
    return enter(job, Happening.START_TIMEOUT, lambda: fail_attempt(
        job.model_copy(deep=True), ExitReason.START_TIMEOUT, detail, policy, now,
        latest_ready_step=latest_ready_step, blame=blame))


def _on_completed(job: JobRecord, current: AttemptRecord, final_ready: bool, deadlines: Deadlines,
                  policy: RetryPolicy, now: datetime, latest_ready_step: int | None) -> Outcome:
    """A running job's attempt that completed: the job succeeds once its final checkpoint is READY (or none is
    expected), the attempt fails when that checkpoint is late past the time-out."""
    if final_ready or not expects_final_checkpoint(job):
        def succeed() -> Outcome:
            new = job.model_copy(deep=True)
            new.updated_at = now
            events: list[Event] = []
            set_state(new, "succeeded", events, now, reason=None)
            return Outcome(new, events)
        return enter(job, Happening.FINAL_LATE, succeed)
    waited = (now - (current.ended_at or now)).total_seconds()
    if waited > deadlines.final_checkpoint_timeout_s:
        detail = (f"every rank exited 0 but no READY checkpoint at step {job.spec.training.max_steps} "
                  f"appeared within {deadlines.final_checkpoint_timeout_s:.0f}s")
        return enter(job, Happening.FINAL_MISSING, lambda: fail_attempt(
            job.model_copy(deep=True), ExitReason.CHECKPOINT_MISSING, detail, policy, now,
            latest_ready_step=latest_ready_step))
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

    def republish() -> Outcome:
        new = job.model_copy(deep=True)
        attempt = new.attempts[-1]
        attempt.republished += 1
        attempt.republished_at = now
        new.updated_at = now
        waited = (now - since).total_seconds()
        return Outcome(new, [gang_allocated(new, attempt, now)],
                       note=f"{len(attempt.started_ranks)} of {attempt.world_size} ranks started after {waited:.0f}s; "
                            f"GangAllocated {attempt.allocation_id} published again ({attempt.republished} of "
                            f"{deadlines.republish_max})")

    return enter(job, Happening.REPUBLISH, republish)
