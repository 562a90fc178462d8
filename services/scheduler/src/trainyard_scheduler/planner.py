"""One scheduling pass over the pending jobs: pure, ``plan(snapshot, pending, now)``.

Order: higher priority first, then earlier submission, then job id (a total order, so a
pass is deterministic). Each job either gets a :class:`Admit` (its placement is taken
out of the snapshot before the next job is considered) or a :class:`Wait` with the reason
the API shows while it is queued. A job that cannot run now does not block the jobs
behind it (best-effort FIFO, like kueue's BestEffortFIFO): without preemption, strict FIFO
would let one oversized job stall the whole queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from trainyard_scheduler.placement import ClusterSnapshot, GangRequest, Placement, Unschedulable, place


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    request: GangRequest
    submitted_at: datetime
    priority: int = 0
    not_before: datetime | None = None


@dataclass(frozen=True)
class Admit:
    job_id: str
    placement: Placement


@dataclass(frozen=True)
class Wait:
    """``reason`` None: keep the reason already recorded (e.g. the retry back-off note)."""

    job_id: str
    reason: str | None
    fits_when_idle: bool = True


Decision = Admit | Wait


def order(pending: Iterable[PendingJob]) -> list[PendingJob]:
    """Priority (high first), then submission time, then id."""
    return sorted(pending, key=lambda p: (-p.priority, p.submitted_at, p.job_id))


def plan(snapshot: ClusterSnapshot, pending: Iterable[PendingJob], now: datetime) -> list[Decision]:
    """Decide, for every pending job in order, whether it starts now or why it waits."""
    decisions: list[Decision] = []
    for job in order(pending):
        if job.not_before is not None and job.not_before > now:
            decisions.append(Wait(job.job_id, None))
            continue
        result = place(snapshot, job.request)
        if isinstance(result, Unschedulable):
            decisions.append(Wait(job.job_id, result.reason, result.fits_when_idle))
            continue
        decisions.append(Admit(job.job_id, result))
        snapshot = snapshot.with_leased(result)
    return decisions
