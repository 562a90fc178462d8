"""The job state machine as a table: (job state, what happened) → (the states it may end in, what it publishes).

Each public transition first says what happened (:class:`Happening`: the event read against the record —
a rank's exit is ``RANK_FAILED``, ``RANK_STOPPED``, ``PORT_SQUATTED``… by its reason and the attempt's state),
then :func:`enter` looks the pair up. A pair that is not in :data:`TABLE` is refused: the record is left
unchanged, with a note saying so (an event for a state it cannot apply to, e.g. a resume of a running job,
or a rank starting for a job that already failed). A pair in it runs its effect, and the outcome is checked
against the row: it ends in one of the row's states and publishes only the row's events (besides the
``JobStateChanged`` of a state change). Where a row lists several next states, the record decides among
them: the retry policy (``queued``, ``paused`` for a job being paused, or ``failed``), a stop that ends with
the final checkpoint (``succeeded``). The node agent's ``supervision.py`` is the model; docs/design.md §3.7.

Conditions that make an event *nothing* for the job — a stale allocation or epoch, a duplicate, a
checkpoint that is not the final one, a preemption already asked — are answered before the table, with a
note: they are not transitions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from trainyard_contract.errors import TrainyardError
from trainyard_contract.events import (
    AllocationRevoked,
    CheckpointRequested,
    Event,
    GangAllocated,
    JobState,
    JobStateChanged,
    ReplicaReplaced,
)
from trainyard_contract.records import JobRecord

from trainyard_scheduler.transitions.state import Outcome, unchanged

Same = Literal["same"]
SAME: Same = "same"  # the job stays in the state it was in

JOB_STATES: tuple[JobState, ...] = ("queued", "running", "paused", "succeeded", "failed", "cancelled")


class Happening(StrEnum):
    """What happened to a job, as the table knows it."""

    PLACED = "placed"  # a new attempt on a placement (GangAllocated)
    UNSTARTABLE = "unstartable"  # it can never start as specified (initFrom, a dataset it may not read)
    SECURITY_VIOLATION = "security-violation"  # a rank claimed what a rank may not
    WAIT_NOTED = "wait-noted"  # why a queued job waits
    RANK_STARTED = "rank-started"
    ENVIRONMENT_NOTED = "environment-noted"  # a node's progress with the job's environment, before its ranks start
    EXIT_RECORDED = "exit-recorded"  # a rank of an attempt that already ended, or of a job that did
    RANK_STOPPED = "rank-stopped"  # exit 7 (checkpointed on request), or any exit while its gang stops
    PORT_SQUATTED = "port-squatted"  # port-in-use: an interruption
    RANK_FAILED = "rank-failed"  # any other non-zero exit
    REPLICA_FAILED = "replica-failed"  # … of a fault-tolerant attempt's replica, replaced while the others go on
    RANK_DONE = "rank-done"  # exit 0, some ranks still run
    ATTEMPT_COMPLETED = "attempt-completed"  # every rank exited 0
    FINAL_READY = "final-ready"  # the checkpoint at maxSteps is READY after a completed attempt
    FINAL_FAILED = "final-failed"  # … or failed
    CANCEL = "cancel"
    PAUSE = "pause"  # at once: no rank of the attempt started
    PAUSE_ASKED = "pause-asked"  # its ranks checkpoint first
    PAUSE_AFTER_COMPLETION = "pause-after-completion"  # the ranks all exited 0: only the mark
    PAUSE_WITHDRAWN = "pause-withdrawn"  # a resume while the pause is still in progress
    RESUME = "resume"
    COMPLETED_BY_CONTROL = "completed-by-control"  # pause or resume of a job whose final checkpoint is READY
    PREEMPT_ASKED = "preempt-asked"
    PREEMPTION_WITHDRAWN = "preemption-withdrawn"  # its preemptor no longer waits
    DRAIN_ASKED = "drain-asked"
    DRAIN_BEFORE_START = "drain-before-start"  # no rank started: interrupted at once
    STOP_ENDED = "stop-ended"  # the stop checkpoint is READY and every rank exited, or the grace is over
    CLUSTER_SILENT = "cluster-silent"  # control-plane interruption
    NODE_SILENT = "node-silent"  # lost
    START_TIMEOUT = "start-timeout"
    START_TIMEOUT_UNWATCHED = "start-timeout-unwatched"  # the time-out began before this scheduler watched
    REPUBLISH = "republish"  # GangAllocated again
    FINAL_LATE = "final-late"  # a completed attempt's final checkpoint turned out READY (its event was lost)
    FINAL_MISSING = "final-missing"  # … or never turned READY in time


@dataclass(frozen=True)
class Row:
    """Where a job may go on a happening, and what it may publish (besides JobStateChanged)."""

    to: frozenset[JobState | Same]
    publishes: frozenset[type[Event]] = frozenset()

    def allows(self, before: JobState, after: JobState) -> bool:
        return after in self.to or (after == before and SAME in self.to)


H = Happening
LIVE: tuple[JobState, ...] = ("queued", "running")  # the states in which an attempt may be live
ACTIVE: tuple[JobState, ...] = ("queued", "running", "paused")  # not terminal
REVOKES = frozenset({AllocationRevoked})
ASKS = frozenset({CheckpointRequested})
GANG = frozenset({GangAllocated})
REPLACES = frozenset({ReplicaReplaced})  # a fault-tolerant attempt's failed replica, started again
RETRY: frozenset[JobState | Same] = frozenset({"queued", "paused", "failed"})  # the retry policy's choice
REQUEUE: frozenset[JobState | Same] = frozenset({"queued", "paused"})  # an interruption (paused: a pause asked)


def _rows(states: Iterable[JobState], happening: Happening, to: Iterable[JobState | Same],
          publishes: frozenset[type[Event]] = frozenset()) -> dict[tuple[JobState, Happening], Row]:
    return {(state, happening): Row(frozenset(to), publishes) for state in states}


TABLE: dict[tuple[JobState, Happening], Row] = {
    # placement, and what ends a job before it runs
    **_rows(["queued"], H.PLACED, ["queued"], GANG),
    **_rows(ACTIVE, H.UNSTARTABLE, ["failed"]),
    **_rows(ACTIVE, H.SECURITY_VIOLATION, ["failed"], REVOKES),
    **_rows(["queued"], H.WAIT_NOTED, [SAME]),
    # ranks
    **_rows(LIVE, H.RANK_STARTED, ["running"]),
    **_rows(LIVE, H.ENVIRONMENT_NOTED, [SAME]),
    **_rows(JOB_STATES, H.EXIT_RECORDED, [SAME]),
    **_rows(LIVE, H.RANK_STOPPED, [SAME, "queued", "paused", "succeeded"], REVOKES),
    **_rows(LIVE, H.PORT_SQUATTED, REQUEUE, REVOKES),
    **_rows(LIVE, H.RANK_FAILED, RETRY, REVOKES),
    **_rows(LIVE, H.REPLICA_FAILED, [SAME], REPLACES),
    **_rows(LIVE, H.RANK_DONE, [SAME]),
    **_rows(LIVE, H.ATTEMPT_COMPLETED, [SAME, "succeeded"]),
    # the final checkpoint of a completed attempt
    **_rows(ACTIVE, H.FINAL_READY, ["succeeded"]),
    **_rows(ACTIVE, H.FINAL_FAILED, RETRY, REVOKES),
    **_rows(["running"], H.FINAL_LATE, ["succeeded"]),
    **_rows(["running"], H.FINAL_MISSING, RETRY, REVOKES),
    # control requests
    **_rows(ACTIVE, H.CANCEL, ["cancelled"], REVOKES),
    **_rows(LIVE, H.PAUSE, ["paused"], REVOKES),
    **_rows(LIVE, H.PAUSE_ASKED, [SAME], ASKS),
    **_rows(["running"], H.PAUSE_AFTER_COMPLETION, [SAME]),
    **_rows(LIVE, H.PAUSE_WITHDRAWN, [SAME]),
    **_rows(["paused"], H.RESUME, ["queued"]),
    **_rows(ACTIVE, H.COMPLETED_BY_CONTROL, ["succeeded"], REVOKES),
    # checkpoint, then stop: preemption, drain (and the pause above)
    **_rows(LIVE, H.PREEMPT_ASKED, [SAME], ASKS),
    **_rows(LIVE, H.PREEMPTION_WITHDRAWN, [SAME]),
    **_rows(LIVE, H.DRAIN_ASKED, [SAME], ASKS),
    **_rows(LIVE, H.DRAIN_BEFORE_START, REQUEUE, REVOKES),
    **_rows(LIVE, H.STOP_ENDED, ["queued", "paused", "succeeded"], REVOKES),
    # reconcile: silence, start time-outs, lost GangAllocated
    **_rows(LIVE, H.CLUSTER_SILENT, REQUEUE, REVOKES),
    **_rows(LIVE, H.NODE_SILENT, RETRY, REVOKES),
    **_rows(LIVE, H.START_TIMEOUT_UNWATCHED, REQUEUE, REVOKES),
    **_rows(LIVE, H.START_TIMEOUT, RETRY, REVOKES),
    **_rows(LIVE, H.REPUBLISH, [SAME], GANG),
}
del H


class TransitionTableError(TrainyardError):
    """A transition did what its row does not allow: a bug in the state machine, never retried."""


def row(state: JobState, happening: Happening) -> Row | None:
    """The row of ``happening`` in ``state``; None: refused."""
    return TABLE.get((state, happening))


def enter(job: JobRecord, happening: Happening, effect: Callable[[], Outcome]) -> Outcome:
    """Apply ``effect`` if the table has a row for ``happening`` in the job's state, and check the outcome
    against that row; refused (unchanged, with a note) otherwise."""
    found = row(job.state, happening)
    if found is None:
        return unchanged(job, f"{happening.value} refused: the job is {job.state}")
    outcome = effect()
    if not outcome.changed:
        return outcome
    published = {type(e) for e in outcome.events} - {JobStateChanged}
    if not found.allows(job.state, outcome.job.state) or not published <= found.publishes:
        raise TransitionTableError(
            f"{happening.value} took job {job.job_id} from {job.state} to {outcome.job.state} publishing "
            f"{sorted(t.__name__ for t in published)}; its row allows {sorted(found.to)} and "
            f"{sorted(t.__name__ for t in found.publishes)}")
    return outcome
