"""Fault-tolerant attempts (``spec.faultTolerance``): a failed replica is replaced while the others train on. Pure.

A rank of such an attempt is one replica (one data-parallel group of one rank). When it fails, and enough other
replicas still step, the attempt does not end: :func:`replica_refusal` says whether it may go on (``None``), and
:func:`replace_replica` records the failure, gives the rank its next *generation* and publishes
:class:`~trainyard_contract.events.ReplicaReplaced`, which the node holding its devices answers by starting the
rank again (fenced by ``ty:replica:<allocation>:<rank>``, written in the same MULTI). The newcomer heals from a
healthy peer and joins the next quorum. Its node is blamed as for any failure: a node that keeps failing is
quarantined, and the attempt then ends the usual way.

What ends the attempt instead (the usual :func:`~trainyard_scheduler.transitions.retry.fail_attempt`, resumed
from the latest READY checkpoint): fewer than ``minReplicas`` replicas still running; a reason that would repeat
in any replica (``nan``, ``config``, ``data``, ``security``: the replicas compute the same thing) or that takes
the node (``lost``); a rank replaced :data:`MAX_REPLACEMENTS_PER_RANK` times already in this attempt; a failure
before the attempt ran.
"""

from __future__ import annotations

from datetime import datetime

from trainyard_contract.events import ReplicaReplaced, WorkerExited, WorkerStarted
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import AttemptRecord, JobRecord, ReplicaReplacement

from trainyard_scheduler.transitions.state import Outcome

#: Reasons a replica is replaced for: the process or its device failed, not what every replica computes alike.
REPLACEABLE = frozenset({ExitReason.ERROR, ExitReason.OOM, ExitReason.KILLED, ExitReason.SIGNAL, ExitReason.NCCL,
                         ExitReason.HANG, ExitReason.CHECKPOINT, ExitReason.UNKNOWN})
#: A rank that failed this often in one attempt is not replaced again: the attempt ends (its node blamed each time).
MAX_REPLACEMENTS_PER_RANK = 3


def generation_of(attempt: AttemptRecord, rank: int) -> int:
    """The rank's current generation in ``attempt`` (0: as launched with the gang)."""
    return attempt.generations.get(str(rank), 0)


def is_stale_generation(attempt: AttemptRecord, event: WorkerStarted | WorkerExited) -> bool:
    """An event of a rank's earlier generation (a replaced replica's late or redelivered news)."""
    return event.generation < generation_of(attempt, event.rank)


def down_ranks(attempt: AttemptRecord) -> set[int]:
    """Ranks not stepping now: exited (failed, or done: a replica that finished cannot be healed from), or
    replaced and their newcomer not started yet."""
    down = {int(r) for r in attempt.exited_ranks}
    down |= {r.rank for r in attempt.replacements if r.started_at is None}
    return down


def replicas_running(attempt: AttemptRecord) -> int:
    """How many replicas step now (started, not down)."""
    return len(set(attempt.started_ranks) - down_ranks(attempt))


def replica_refusal(job: JobRecord, attempt: AttemptRecord, event: WorkerExited, reason: str) -> str | None:
    """None when the failed rank's replica is replaced while the others go on; else why the attempt ends.
    ``attempt`` has the exit recorded already."""
    ft = job.spec.fault_tolerance
    if ft is None:
        return "the job is not fault-tolerant"
    if attempt.state != "running" or not attempt.started_ranks:
        return "the attempt had not started training"
    said = ExitReason.parse(reason)
    if said not in REPLACEABLE:
        return f"a {said} failure would repeat in any replica"
    replaced = sum(1 for r in attempt.replacements if r.rank == event.rank)
    if replaced >= MAX_REPLACEMENTS_PER_RANK:
        return f"rank {event.rank} failed {replaced + 1} times in this attempt"
    running = replicas_running(attempt)
    if running < ft.min_replicas:
        return f"{running} replica(s) still running, fewer than minReplicas {ft.min_replicas}"
    return None


def replace_replica(new: JobRecord, event: WorkerExited, reason: str, detail: str, now: datetime) -> Outcome:
    """The failed rank's next generation, started by its node (ReplicaReplaced); its exit is cleared from the
    attempt (the newcomer's counts), the failure recorded, its node blamed."""
    attempt = new.attempts[-1]
    generation = generation_of(attempt, event.rank) + 1
    attempt.generations = {**attempt.generations, str(event.rank): generation}
    attempt.exited_ranks = {r: c for r, c in attempt.exited_ranks.items() if r != str(event.rank)}
    attempt.replacements = [*attempt.replacements, ReplicaReplacement(
        rank=event.rank, node_id=event.node_id, generation=generation, reason=reason, detail=detail,
        global_step=event.global_step, at=now)]
    replaced = ReplicaReplaced(job_id=new.job_id, attempt=attempt.attempt, allocation_id=attempt.allocation_id,
                               epoch=attempt.epoch, node_id=event.node_id, rank=event.rank, generation=generation,
                               reason=reason)
    running = replicas_running(attempt)
    return Outcome(new, [replaced], blame=[(event.node_id, reason)],
                   note=f"replica {event.rank} failed ({detail}); {running} replica(s) train on, generation "
                        f"{generation} starts on {event.node_id}")


def newcomers_started(attempt: AttemptRecord, events: list[WorkerStarted], now: datetime) -> bool:
    """Mark the replacements whose newcomer started (in place); True when one was."""
    started = {(e.rank, e.generation) for e in events if e.generation > 0}
    marked = False
    for i, r in enumerate(attempt.replacements):
        if r.started_at is None and (r.rank, r.generation) in started:
            attempt.replacements[i] = r.model_copy(update={"started_at": now})
            marked = True
    return marked


def waiting_newcomers(attempt: AttemptRecord, events: list[WorkerStarted]) -> bool:
    """Whether any of ``events`` is a newcomer the attempt still waits for."""
    return any(r.started_at is None and any(e.rank == r.rank and e.generation == r.generation for e in events)
               for r in attempt.replacements)
