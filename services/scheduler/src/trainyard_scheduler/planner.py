"""One scheduling pass: pure, ``plan(snapshot, pending, now, running=…, policy=…)``.

Phases (kueue's ``schedule()`` shape):

1. **usage** — what each tenant (and cohort) holds now, from the running jobs;
2. **order** — per tenant, by effective priority (base priority + aging boost), then
   submission time, then id; across tenants, the head with the highest effective priority goes
   first and, among equals, the tenant with the smallest weighted dominant share (DRF) — the
   share is updated as the pass admits, so tenants interleave fairly;
3. **decide**, job by job: back-off → never-fits check → quota (guaranteed + borrowable,
   cohort limit) → placement on what is free and not reserved → admit; otherwise
   * a job whose preemption is already in progress keeps its devices reserved and says so;
   * a job that may use devices reserved for an earlier job only if it ends before that job's
     reserved start (EASY backfill; needs expected durations, which only the simulator has);
   * a job with preemption rights over running work (lower priority in its own tenant;
     borrowed capacity of another tenant, reclaimed for a job within its guarantee or of higher
     priority) picks victims — topology-aware: inside the smallest unit where the gang fits,
     the cheapest set (lowest priority, then fewest, then most recently started) — and waits
     for them to checkpoint;
   * the first job of each device type blocked by capacity gets a reservation: the free
     devices of the unit it will start in are held back from the jobs behind it, so backfill
     never delays its start;
   * everything else waits, with its reason: ``quota``, ``capacity``, ``topology``,
     ``priority`` (held back for an earlier job) or ``preemption``;
4. **undo reservations** — after the pass the snapshot holds exactly the admitted placements.

Aging raises a waiting job's place in the order (so nothing starves: in time it becomes the
head and gets a reservation), never its preemption rights. No I/O, no clock (``now`` and an
optional ``timer`` for measurements are passed in).

The pass is :class:`_Pass` (the order and the decision per job); quotas and fair sharing are :mod:`quota`,
reservations and backfill :mod:`backfill`, victims :mod:`preemption`, the vocabulary :mod:`decisions`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from trainyard_scheduler.backfill import Reservations
from trainyard_scheduler.decisions import (
    WAIT_KINDS,
    Admit,
    Decision,
    PendingJob,
    Placer,
    PlanStats,
    Preempt,
    Reservation,
    RunningJob,
    Wait,
)
from trainyard_scheduler.gang import Placement, Unschedulable
from trainyard_scheduler.placement import impossible, place, place_possible
from trainyard_scheduler.policy import QueueConfig
from trainyard_scheduler.preemption import Preemption
from trainyard_scheduler.quota import Quota
from trainyard_scheduler.topology import ClusterSnapshot


def expected_duration_s(minutes: float | None) -> float | None:
    """``resources.expectedDurationMinutes`` in seconds (None: unknown, never backfilled past a reservation)."""
    return None if minutes is None else minutes * 60.0


def effective_priority(job: PendingJob, policy: QueueConfig, now: datetime) -> int:
    """Base priority plus the aging boost for the time it has waited."""
    return job.priority + policy.boost((now - job.submitted_at).total_seconds())


def order(pending: Iterable[PendingJob], policy: QueueConfig | None = None,
          now: datetime | None = None) -> list[PendingJob]:
    """Effective priority (high first), then submission time, then id (fair share aside)."""
    policy = policy or QueueConfig()
    jobs = list(pending)
    if now is None:
        return sorted(jobs, key=lambda p: (-p.priority, p.submitted_at, p.job_id))
    return sorted(jobs, key=lambda p: (-effective_priority(p, policy, now), p.submitted_at, p.job_id))


def plan(
    snapshot: ClusterSnapshot,
    pending: Iterable[PendingJob],
    now: datetime,
    *,
    running: Sequence[RunningJob] = (),
    policy: QueueConfig | None = None,
    stats: PlanStats | None = None,
    timer: Callable[[], float] | None = None,
    placer: Placer = place,
) -> list[Decision]:
    """Decide, for every pending job, whether it starts now, preempts, or why it waits.

    Admitted placements are taken out of ``snapshot`` (it then matches what the scheduler leases).
    ``placer`` swaps the placement function (the benchmark runs a naive first fit through the
    same queue); ``timer`` (e.g. ``time.perf_counter``) fills ``stats.latencies`` per decision.
    """
    return _Pass(snapshot, running, policy or QueueConfig(), now, stats, timer, placer).run(pending)


class _Pass:
    """One pass: the queues in order, a decision per job, the reservations undone at the end."""

    def __init__(self, snapshot: ClusterSnapshot, running: Sequence[RunningJob], policy: QueueConfig,
                 now: datetime, stats: PlanStats | None, timer: Callable[[], float] | None,
                 placer: Placer = place) -> None:
        self.snapshot, self.policy, self.now, self.stats, self.timer = snapshot, policy, now, stats, timer
        self.place = placer
        self._place_checked = place_possible if placer is place else placer
        live = {r.job_id: r for r in running}
        self.quota = Quota(snapshot, policy, running)
        self.reservations = Reservations(snapshot, policy, now, live, placer, stats)
        self.preemption = Preemption(snapshot, policy, now, live, self.quota, self.reservations, placer, stats)
        self.decisions: list[Decision] = []

    def run(self, pending: Iterable[PendingJob]) -> list[Decision]:
        """1. the tenants' queues by effective priority  2. heads served by priority, then fair share  3. undo."""
        queues = self._queues(pending)
        heap = [self._head(t, q) for t, q in queues.items() if q]
        heapq.heapify(heap)
        try:
            while heap:
                _, _, _, _, tenant = heapq.heappop(heap)
                _, job = queues[tenant].pop()
                self._timed(job)
                if queues[tenant]:
                    heapq.heappush(heap, self._head(tenant, queues[tenant]))
        finally:
            self.reservations.undo()
        return self.decisions

    def _queues(self, pending: Iterable[PendingJob]) -> dict[str, list[tuple[int, PendingJob]]]:
        """Per tenant, (effective priority, job), best last (the pass pops from the end)."""
        queues: dict[str, list[tuple[int, PendingJob]]] = {}
        aging = self.policy.aging
        every, step, top = aging.every_seconds, aging.step, aging.max_boost
        for job in pending:
            waited = (self.now - job.submitted_at).total_seconds()
            boost = int(waited // every) * step if waited > 0 and step else 0
            eff = job.priority + (boost if top is None else min(boost, top))  # effective_priority, inlined
            queues.setdefault(job.tenant, []).append((eff, job))
            self.snapshot.aggregates_for(job.request)  # built up front (pass overhead, not per decision)
        for q in queues.values():
            q.sort(key=lambda e: (-e[0], e[1].submitted_at, e[1].job_id), reverse=True)
        return queues

    def _head(self, tenant: str, queue: list[tuple[int, PendingJob]]) -> tuple[int, float, datetime, str, str]:
        eff, job = queue[-1]
        return (-eff, self.quota.share(tenant), job.submitted_at, job.job_id, tenant)

    def _timed(self, job: PendingJob) -> None:
        """:meth:`decide`, its time recorded when a ``timer`` was given."""
        timer, stats = self.timer, self.stats
        if timer is None or stats is None:
            self.decide(job)
            return
        t0 = timer()
        self.decide(job)
        elapsed = timer() - t0
        stats.latencies.append(elapsed)
        if isinstance(self.decisions[-1], Admit):
            stats.admit_latencies.append(elapsed)

    def decide(self, job: PendingJob) -> None:
        """back-off → never fits → quota → placement → admit; else a preemption under way, backfill, a new
        preemption, or a wait with its reason (a reservation for the first job capacity blocks)."""
        if job.not_before is not None and job.not_before > self.now:
            self.decisions.append(Wait(job.job_id, None, True, "backoff"))
            return
        if never := impossible(self.snapshot, job.request):
            self.decisions.append(Wait(job.job_id, never.message, False, never.kind))
            return
        over = self.quota.problem(job.tenant, job.request)
        result: Placement | Unschedulable | None = None
        if over is None:
            result = self._place_checked(self.snapshot, job.request)
            if isinstance(result, Placement):
                self._admit(job, result)
                return
        if job.preempting and (waiting := self.preemption.in_progress(job)) is not None:
            self.decisions.append(waiting)
            return
        if over is None and result is not None and (backfill := self.reservations.backfill(job)) is not None:
            if isinstance(backfill, Placement):
                self._admit(job, backfill, backfill=True)
            else:
                self.decisions.append(backfill)
            return
        if preempting := self.preemption.maybe_preempt(job, over):
            self.decisions.extend(preempting)
            return
        if over is not None:
            self.decisions.append(Wait(job.job_id, f"quota: {over}", True, "quota"))
            return
        assert isinstance(result, Unschedulable)
        self.decisions.append(self.reservations.wait_for_capacity(job, result))

    def _admit(self, job: PendingJob, placement: Placement, *, backfill: bool = False) -> None:
        self.preemption.capacity_changed()
        self.snapshot.take(placement)
        self.quota.use(job.tenant, job.request.gpu_type, placement.world_size)
        self.decisions.append(Admit(job.job_id, placement, backfill))


__all__ = [
    "WAIT_KINDS",
    "Admit",
    "Decision",
    "PendingJob",
    "Placer",
    "PlanStats",
    "Preempt",
    "Reservation",
    "RunningJob",
    "Wait",
    "effective_priority",
    "expected_duration_s",
    "order",
    "plan",
]
