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
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from trainyard_contract.devices import Device

from trainyard_scheduler.placement import (
    CLUSTER,
    DOMAIN,
    LEVEL_NAMES,
    RACK,
    TIER,
    Aggregates,
    ClusterSnapshot,
    GangRequest,
    Placement,
    Unschedulable,
    fill,
    impossible,
    place,
    place_possible,
)
from trainyard_scheduler.policy import UNLIMITED, QueueConfig

WAIT_KINDS = ("quota", "capacity", "topology", "priority", "preemption", "backoff")
MAX_CANDIDATES = 128  # the cheapest victims a preemption search considers (bounds its cost)
UNIT_CANDIDATES = 48  # of which, for a gang that fits one unit


@dataclass(frozen=True)
class PendingJob:
    """A queued job holding nothing. ``preempting``: victims already asked to stop for it."""

    job_id: str
    request: GangRequest
    submitted_at: datetime
    priority: int = 0
    not_before: datetime | None = None
    tenant: str = "default"
    expected_duration_s: float | None = None
    preempting: tuple[str, ...] = ()


@dataclass
class RunningJob:
    """A live allocation: what quotas count, what preemption may take, what reservations wait for.

    ``admitted_priority``: its effective priority (aging included) when it started; a job that
    waited its way up is not preempted by a fresher job it outranked then.
    """

    job_id: str
    tenant: str
    priority: int
    gpu_type: str
    devices: tuple[Device, ...]
    started_at: datetime
    expected_end: datetime | None = None
    preempted_by: str | None = None
    admitted_priority: int | None = None
    _units: dict[int, dict[int, int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def shield(self) -> int:
        """The priority a preemptor must exceed: its own, or the aged one it was admitted with."""
        return self.priority if self.admitted_priority is None else max(self.priority, self.admitted_priority)

    def units(self, snapshot: ClusterSnapshot, level: int) -> dict[int, int]:
        """Devices held per unit of ``level`` (cached: the topology of a snapshot does not change)."""
        cached = self._units.get(level)
        if cached is None:
            cached = {}
            for d in self.devices:
                n = snapshot.pos.get(d.node_id)
                if n is not None:
                    u = snapshot.unit_of(n, level)
                    cached[u] = cached.get(u, 0) + 1
            self._units[level] = cached
        return cached


@dataclass(frozen=True)
class Admit:
    job_id: str
    placement: Placement
    backfill: bool = False


@dataclass(frozen=True)
class Wait:
    """``reason`` None: keep the reason already recorded (e.g. the retry back-off note)."""

    job_id: str
    reason: str | None
    fits_when_idle: bool = True
    kind: str | None = None


@dataclass(frozen=True)
class Preempt:
    """Ask ``victims`` to checkpoint and stop so that ``job_id`` can start."""

    job_id: str
    victims: tuple[str, ...]
    reason: str


Decision = Admit | Wait | Preempt
Placer = Callable[[ClusterSnapshot, GangRequest], "Placement | Unschedulable"]


@dataclass
class Reservation:
    job_id: str
    gpu_type: str
    devices: tuple[Device, ...]
    start: datetime | None
    where: str


@dataclass
class PlanStats:
    """Filled by :func:`plan` when given: per-decision seconds (with ``timer``) and what was reserved."""

    latencies: list[float] = field(default_factory=list)
    admit_latencies: list[float] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    preemption_searches: int = 0


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
    def __init__(self, snapshot: ClusterSnapshot, running: Sequence[RunningJob], policy: QueueConfig,
                 now: datetime, stats: PlanStats | None, timer: Callable[[], float] | None,
                 placer: Placer = place) -> None:
        self.snapshot, self.policy, self.now = snapshot, policy, now
        self.place = placer
        self._place_checked = place_possible if placer is place else placer
        self._no_victims: set[tuple[object, ...]] = set()
        self.stats, self.timer = stats, timer
        self.running = {r.job_id: r for r in running}
        self.usage: dict[tuple[str, str], int] = {}
        self.cohort_usage: dict[tuple[str, str], int] = {}
        self.shares: dict[str, float] = {}
        for r in running:
            self._use(r.tenant, r.gpu_type, r.size)
        self.busy: set[str] = {r.job_id for r in running if r.preempted_by}
        self.capacities: dict[str, int] = {}
        self.caps: dict[tuple[str, str], tuple[int, int]] = {}
        self.lowest: dict[str, int] = {}  # per device type: lowest priority of a running job not yet a victim
        for r in running:
            if r.job_id not in self.busy:
                self.lowest[r.gpu_type] = min(self.lowest.get(r.gpu_type, r.shield), r.shield)
        self.reserved: dict[str, Reservation] = {}  # the first reservation per device type (named in reasons)
        self.reservations: dict[str, int] = {}
        self.backfill_until: dict[str, datetime | None] = {}  # earliest reserved start; None = no backfill past
        self.phantoms: list[tuple[str, list[Device]]] = []
        self.phantom_count: dict[str, int] = {}
        self.searches = 0
        self.decisions: list[Decision] = []

    # ---------------------------------------------------------------- phases
    def run(self, pending: Iterable[PendingJob]) -> list[Decision]:
        queues: dict[str, list[tuple[int, PendingJob]]] = {}
        aging = self.policy.aging
        every, step, top = aging.every_seconds, aging.step, aging.max_boost
        now = self.now
        for job in pending:
            waited = (now - job.submitted_at).total_seconds()
            boost = int(waited // every) * step if waited > 0 and step else 0
            eff = job.priority + (boost if top is None else min(boost, top))  # effective_priority, inlined
            queues.setdefault(job.tenant, []).append((eff, job))
            self.snapshot.aggregates_for(job.request)  # built up front (pass overhead, not per decision)
        for q in queues.values():
            q.sort(key=lambda e: (-e[0], e[1].submitted_at, e[1].job_id), reverse=True)  # pop() from the end
        heap = [self._head(t, q) for t, q in queues.items() if q]
        heapq.heapify(heap)
        timer = self.timer
        try:
            while heap:
                _, _, _, _, tenant = heapq.heappop(heap)
                _, job = queues[tenant].pop()
                if timer is not None and self.stats is not None:
                    t0 = timer()
                    self.decide(job)
                    elapsed = timer() - t0
                    self.stats.latencies.append(elapsed)
                    if isinstance(self.decisions[-1], Admit):
                        self.stats.admit_latencies.append(elapsed)
                else:
                    self.decide(job)
                if queues[tenant]:
                    heapq.heappush(heap, self._head(tenant, queues[tenant]))
        finally:
            self._undo_reservations()
        return self.decisions

    def _head(self, tenant: str, queue: list[tuple[int, PendingJob]]) -> tuple[int, float, datetime, str, str]:
        eff, job = queue[-1]
        return (-eff, self._share(tenant), job.submitted_at, job.job_id, tenant)

    def decide(self, job: PendingJob) -> None:
        if job.not_before is not None and job.not_before > self.now:
            self.decisions.append(Wait(job.job_id, None, True, "backoff"))
            return
        request = job.request
        if never := impossible(self.snapshot, request):
            self.decisions.append(Wait(job.job_id, never.message, False, never.kind))
            return
        over = self._quota_problem(job)
        result: Placement | Unschedulable | None = None
        if over is None:
            result = self._place_checked(self.snapshot, request)
            if isinstance(result, Placement):
                self._admit(job, result)
                return
        if job.preempting and self._in_progress(job):
            return
        if over is None and result is not None and self._maybe_backfill(job, result):
            return
        if self._maybe_preempt(job, over):
            return
        if over is not None:
            self.decisions.append(Wait(job.job_id, f"quota: {over}", True, "quota"))
            return
        assert isinstance(result, Unschedulable)
        self._wait_for_capacity(job, result)

    # ---------------------------------------------------------------- usage and quota
    def _use(self, tenant: str, kind: str, n: int) -> None:
        self.usage[(tenant, kind)] = self.usage.get((tenant, kind), 0) + n
        self.shares.pop(tenant, None)
        cohort = self.policy.tenant(tenant).cohort
        self.cohort_usage[(cohort, kind)] = self.cohort_usage.get((cohort, kind), 0) + n

    def _capacity(self, kind: str) -> int:
        if kind not in self.capacities:
            self.capacities[kind] = max(1, self.snapshot.capacity(kind))
        return self.capacities[kind]

    def _share(self, tenant: str) -> float:
        """Weighted dominant share: the largest fraction of any device type the tenant holds."""
        share = self.shares.get(tenant)
        if share is None:
            used = [n / self._capacity(k) for (t, k), n in self.usage.items() if t == tenant and n]
            share = self.shares[tenant] = max(used, default=0.0) / self.policy.tenant(tenant).weight
        return share

    def _limits(self, tenant: str, kind: str) -> tuple[int, int]:
        """(guaranteed, cap) of the tenant for the device type."""
        limits = self.caps.get((tenant, kind))
        if limits is None:
            limits = self.caps[(tenant, kind)] = (self.policy.guaranteed(tenant, kind), self.policy.cap(tenant, kind))
        return limits

    def _quota_problem(self, job: PendingJob) -> str | None:
        kind, need, tenant = job.request.gpu_type, job.request.gpu_count, job.tenant
        used = self.usage.get((tenant, kind), 0)
        g, cap = self._limits(tenant, kind)
        if used + need > cap:
            return (f"tenant {tenant} holds {used} {kind} devices and may hold {cap} "
                    f"({g} guaranteed + {cap - g} borrowable); this job needs {need} more")
        if not self.policy.cohorts:
            return None
        cohort = self.policy.tenant(tenant).cohort
        limit = self.policy.cohort_limit(cohort, kind)
        cohort_used = self.cohort_usage.get((cohort, kind), 0)
        if cohort_used + need > limit:
            return (f"cohort {cohort} holds {cohort_used} {kind} devices of its limit {limit}; "
                    f"this job needs {need} more")
        return None

    def _borrowing(self, tenant: str, kind: str, released: int = 0) -> bool:
        return self.usage.get((tenant, kind), 0) - released > self._limits(tenant, kind)[0]

    def _may_preempt(self, job: PendingJob) -> bool:
        """A quick test: could any running job be a victim of ``job`` at all?"""
        kind = job.request.gpu_type
        if self.lowest.get(kind, UNLIMITED) < job.priority:
            return True
        return any(t != job.tenant and n and self._borrowing(t, k) for (t, k), n in self.usage.items() if k == kind)

    # ---------------------------------------------------------------- admitting
    def _admit(self, job: PendingJob, placement: Placement, *, backfill: bool = False) -> None:
        self._no_victims.clear()
        self.snapshot.take(placement)
        self._use(job.tenant, job.request.gpu_type, placement.world_size)
        self.decisions.append(Admit(job.job_id, placement, backfill))

    # ---------------------------------------------------------------- reservations and backfill
    def _hold(self, kind: str, devices: list[Device]) -> None:
        if devices:
            self.snapshot.take_devices(kind, devices)
            self.phantoms.append((kind, devices))
            self.phantom_count[kind] = self.phantom_count.get(kind, 0) + len(devices)

    def _undo_reservations(self) -> None:
        for kind, devices in reversed(self.phantoms):
            self.snapshot.give_devices(kind, devices)
        self.phantoms.clear()

    def _maybe_backfill(self, job: PendingJob, result: Unschedulable) -> bool:
        """Blocked only by another job's reservation: backfill if it ends before that job starts."""
        kind = job.request.gpu_type
        held = self.phantom_count.get(kind, 0)
        if not held or self.snapshot.free_count(kind) + held < job.request.gpu_count:
            return False
        holder = self.reserved.get(kind)
        until = self.backfill_until.get(kind)
        ends = (self.now + timedelta(seconds=job.expected_duration_s)) if job.expected_duration_s else None
        if until is not None and ends is not None and ends <= until:
            placed = self._place_ignoring_reservations(job)
            if placed is not None:
                self._admit(job, placed, backfill=True)
                return True
        who = holder.job_id if holder else "jobs ahead in the queue"
        when = f"; it should start by {holder.start.isoformat(timespec='seconds')}" if holder and holder.start else ""
        self.decisions.append(Wait(job.job_id, f"priority: the free {kind} devices are held for {who}, "
                                               f"which is ahead in the queue{when}", True, "priority"))
        return True

    def _place_ignoring_reservations(self, job: PendingJob) -> Placement | None:
        for kind, devices in self.phantoms:
            self.snapshot.give_devices(kind, devices)
        try:
            result = self.place(self.snapshot, job.request)
        finally:
            for kind, devices in self.phantoms:
                self.snapshot.take_devices(kind, devices)
        if not isinstance(result, Placement):
            return None
        # The backfilled job takes some reserved devices; they come back before the reserved start.
        taken = {(d.node_id, d.index) for d in result.devices()}
        for i, (kind, devices) in enumerate(self.phantoms):
            keep = [d for d in devices if (d.node_id, d.index) not in taken]
            if len(keep) != len(devices):
                self.snapshot.give_devices(kind, [d for d in devices if (d.node_id, d.index) in taken])
                self.phantoms[i] = (kind, keep)
                self.phantom_count[kind] -= len(devices) - len(keep)
        return result

    def _wait_for_capacity(self, job: PendingJob, result: Unschedulable) -> None:
        kind = job.request.gpu_type
        reason = result.message
        if self.policy.backfill and self.reservations.get(kind, 0) < self.policy.reservations:
            reservation = self._reserve(job)
            if reservation is not None:
                reason += f"; next in line for {kind}: free devices in {reservation.where} are held for it"
                if reservation.start:
                    reason += f", expected start {reservation.start.isoformat(timespec='seconds')}"
        self.decisions.append(Wait(job.job_id, reason, result.fits_when_idle, result.kind))

    def _reserve(self, job: PendingJob) -> Reservation | None:
        """Hold the free devices of the unit the head job will start in (one per device type)."""
        snap, request = self.snapshot, job.request
        agg = snap.aggregates_for(request)
        need = request.gpu_count
        level = self._idle_level(agg, need, request.mode)
        unit = 0 if level == CLUSTER else self._soonest_unit(request.gpu_type, agg, level, need)
        if unit is None:
            return None
        take = min(agg.cap[level][unit], need)
        start, freed = self._expected_start(request.gpu_type, level, unit, need - take, request.tensor)
        if start is not None:  # EASY's "extra" devices: what the head will not need at its start stays free
            tp = max(1, request.tensor)
            take = min(take, -(-max(0, need - freed) // tp) * tp)
        pieces: list[tuple[int, int]] = []
        if take > 0:
            fill(snap, agg, level, unit, take, pieces)
        held = [Device(snap.node_id(n), i) for n, c in pieces for i in snap.free[n][request.gpu_type][:c]]
        where = self._unit_name(level, unit)
        reservation = Reservation(job.job_id, request.gpu_type, tuple(held), start, where)
        self._hold(request.gpu_type, held)
        self._note_reservation(reservation)
        if self.stats is not None:
            self.stats.reservations.append(reservation)
        return reservation

    def _note_reservation(self, reservation: Reservation) -> None:
        kind = reservation.gpu_type
        self.reserved.setdefault(kind, reservation)
        self.reservations[kind] = self.reservations.get(kind, 0) + 1
        if self.reservations[kind] == 1:
            self.backfill_until[kind] = reservation.start
        else:
            until = self.backfill_until.get(kind)
            self.backfill_until[kind] = None if until is None or reservation.start is None else min(
                until, reservation.start)

    def _soonest_unit(self, kind: str, agg: Aggregates, level: int, need: int) -> int | None:
        """The unit of ``level`` where the head can start soonest: by the running jobs' expected ends
        when every one of them says (the simulator), else the unit with the most free capacity now."""
        idle, cap = agg.idle[level], agg.cap[level]
        ends: dict[int, list[tuple[datetime, int]]] = {}
        for r in self.running.values():
            if r.gpu_type != kind:
                continue
            if r.expected_end is None:
                ends = {}
                break
            for u, held in r.units(self.snapshot, level).items():
                if idle[u] >= need:
                    ends.setdefault(u, []).append((r.expected_end, held))
        best: tuple[datetime, int, int] | None = None
        for u, items in ends.items():
            have = cap[u]
            for end, held in sorted(items):
                have += held
                if have >= need:
                    key = (end, -cap[u], u)
                    best = key if best is None or key < best else best
                    break
        if best is not None:
            return best[2]
        unit = most_free(self.snapshot, agg, level)
        if idle[unit] >= need:
            return unit
        units = [u for u, c in enumerate(idle) if c >= need]
        return max(units, key=lambda u: (cap[u], -u)) if units else None

    def _idle_level(self, agg: Aggregates, need: int, mode: str) -> int:
        if mode == "spread":
            return CLUSTER
        limit = {"tier": TIER, "rack": RACK, "domain": DOMAIN}.get(mode, CLUSTER)
        for level, best in ((DOMAIN, agg.idle_best_dom), (RACK, agg.idle_best_rack),
                            (TIER, agg.idle_best_tier)):
            if best >= need:
                return max(level, limit) if limit != CLUSTER else level
        return CLUSTER

    def _unit_name(self, level: int, unit: int) -> str:
        snap = self.snapshot
        if level == CLUSTER:
            return "the cluster"
        name = {TIER: snap.tier_names, RACK: snap.rack_names, DOMAIN: snap.dom_names}[level][unit]
        return f"{LEVEL_NAMES[level]} {name or '(default)'}"

    def _expected_start(self, kind: str, level: int, unit: int, missing: int,
                        tp: int = 1) -> tuple[datetime | None, int]:
        """When enough running jobs in the unit end to free ``missing`` more devices (if all say when),
        and how many devices (in whole groups of ``tp``) all the jobs ending by then free."""
        if missing <= 0:
            return self.now, 0
        ends: list[tuple[datetime, int]] = []
        for r in self.running.values():
            if r.gpu_type != kind:
                continue
            held = r.units(self.snapshot, level).get(unit, 0) if level != CLUSTER else r.size
            if held:
                if r.expected_end is None:
                    return None, 0
                ends.append((r.expected_end, held // tp * tp if tp > 1 else held))
        ends.sort()
        freed = 0
        for i, (end, held) in enumerate(ends):
            freed += held
            if freed >= missing:
                for later, more in ends[i + 1:]:  # jobs ending at the same moment free theirs too
                    if later > end:
                        break
                    freed += more
                return max(end, self.now), freed
        return None, 0

    # ---------------------------------------------------------------- preemption
    def _in_progress(self, job: PendingJob) -> bool:
        """A preemption for ``job`` is under way: keep its devices held and say what it waits for."""
        victims = [self.running[v] for v in job.preempting if v in self.running]
        if not victims:
            return False
        self.busy.update(v.job_id for v in victims)
        self._hold_for_preemptor(job, victims)
        names = ", ".join(v.job_id for v in victims)
        self.decisions.append(Wait(job.job_id, f"preemption: waiting for {names} to checkpoint and stop "
                                               "(preempted for this job)", True, "preemption"))
        return True

    def _hold_for_preemptor(self, job: PendingJob, victims: Sequence[RunningJob]) -> None:
        kind = job.request.gpu_type
        freed = [d for v in victims for d in v.devices]
        self.snapshot.give_devices(kind, freed)
        try:
            target = self.place(self.snapshot, job.request)
        finally:
            self.snapshot.take_devices(kind, freed)
        if isinstance(target, Placement):
            theirs = {(d.node_id, d.index) for d in freed}
            held = [d for d in target.devices() if (d.node_id, d.index) not in theirs]
            self._hold(kind, held)
            self._note_reservation(Reservation(job.job_id, kind, tuple(held), None,
                                               "the devices of the jobs it preempts"))

    def _maybe_preempt(self, job: PendingJob, over: str | None) -> bool:
        cfg = self.policy.preemption
        if not cfg.enabled or self.searches >= cfg.max_per_pass or not self._may_preempt(job):
            return False
        kind = job.request.gpu_type
        within = self.usage.get((job.tenant, kind), 0) + job.request.gpu_count <= self._limits(job.tenant, kind)[0]
        memo = (job.tenant, kind, job.priority, over is not None, within)
        if memo in self._no_victims:
            return False
        candidates = self._candidates(job, quota_blocked=over is not None)
        if not candidates:
            self._no_victims.add(memo)
            return False
        self.searches += 1
        if self.stats is not None:
            self.stats.preemption_searches += 1
        victims = self._choose_victims(job, candidates, over is not None)
        if not victims:
            return False
        self._no_victims.clear()
        self.busy.update(v.job_id for v in victims)
        names = tuple(v.job_id for v in victims)
        why = "lower priority" if all(v.shield < job.priority for v in victims) else "borrowed capacity reclaimed"
        grace = int(cfg.checkpoint_grace_seconds)
        self.decisions.append(Preempt(job.job_id, names,
                                      f"preempted for {job.job_id} ({why}); checkpoint within {grace}s"))
        self._hold_for_preemptor(job, victims)
        self.decisions.append(Wait(job.job_id, f"preemption: waiting for {', '.join(names)} to checkpoint and "
                                               f"stop ({why})", True, "preemption"))
        return True

    def _candidates(self, job: PendingJob, *, quota_blocked: bool) -> list[RunningJob]:
        """Running jobs ``job`` may preempt, cheapest first (lowest priority, newest, smallest)."""
        kind, tenant = job.request.gpu_type, job.tenant
        within = self.usage.get((tenant, kind), 0) + job.request.gpu_count <= self._limits(tenant, kind)[0]
        settled = self.now - timedelta(seconds=self.policy.preemption.min_runtime_seconds)
        out = []
        for r in self.running.values():
            if r.gpu_type != kind or r.job_id in self.busy or r.started_at > settled:
                continue
            if r.tenant == tenant:
                if r.shield < job.priority:
                    out.append(r)
            elif not quota_blocked and self._borrowing(r.tenant, kind) and (within or r.shield < job.priority):
                out.append(r)
        out.sort(key=lambda r: (r.shield, -r.started_at.timestamp(), r.size, r.job_id))
        return out[:MAX_CANDIDATES]

    def _choose_victims(self, job: PendingJob, candidates: list[RunningJob], quota_blocked: bool) -> list[RunningJob]:
        kind, need, tenant = job.request.gpu_type, job.request.gpu_count, job.tenant
        chosen: list[RunningJob] = []
        if quota_blocked:  # first get under the tenant's own cap with its own lower-priority jobs
            excess = self.usage.get((tenant, kind), 0) + need - self._limits(tenant, kind)[1]
            for r in [c for c in candidates if c.tenant == tenant]:
                if excess <= 0:
                    break
                chosen.append(r)
                excess -= r.size
            if excess > 0:
                return []
            candidates = [c for c in candidates if c not in chosen]
        if self._fits_without(job, chosen):
            return chosen
        snap = self.snapshot
        agg = snap.aggregates_for(job.request)
        level = self._idle_level(agg, need, job.request.mode)
        if level != CLUSTER:  # one unit: the cheapest victims there, smallest first
            small = sorted(candidates, key=lambda r: (r.shield, r.size, -r.started_at.timestamp(), r.job_id))
            picked = self._victims_in_unit(job, agg, level, small[:UNIT_CANDIDATES], chosen)
            if picked is not None:
                return picked
        return self._victims_anywhere(job, candidates, chosen)

    def _fits_without(self, job: PendingJob, victims: Sequence[RunningJob]) -> bool:
        """Would ``job`` fit once ``victims`` are gone? Counted on the index when it can be, else placed."""
        kind, request, snap = job.request.gpu_type, job.request, self.snapshot
        freed = [d for v in victims for d in v.devices]
        if snap.free_count(kind) + len(freed) < request.gpu_count:
            return False
        if self.place is place:
            agg = snap.aggregates_for(request)
            fits = fits_after_freeing(snap, agg, request, freed)
            if fits is not None:
                return fits
        snap.give_devices(kind, freed)
        try:
            return isinstance(self.place(self.snapshot, job.request), Placement)
        finally:
            self.snapshot.take_devices(kind, freed)

    def _victims_in_unit(self, job: PendingJob, agg: Aggregates, level: int, candidates: list[RunningJob],
                         chosen: list[RunningJob]) -> list[RunningJob] | None:
        """The cheapest victim set inside one unit of ``level`` that holds the gang when idle."""
        need = job.request.gpu_count
        idle, cap = agg.idle[level], agg.cap[level]
        buckets: dict[int, list[RunningJob]] = {}
        for r in candidates:
            for u in r.units(self.snapshot, level):
                if idle[u] >= need:
                    buckets.setdefault(u, []).append(r)
        options = []
        for u, rs in buckets.items():
            have = cap[u] + sum(v.units(self.snapshot, level).get(u, 0) for v in chosen)
            picked = []
            for r in rs:
                if have >= need:
                    break
                picked.append(r)
                have += r.units(self.snapshot, level)[u]
            if have < need:
                continue
            for r in sorted(picked, key=lambda v: -v.size):  # drop victims the others make unnecessary
                if have - r.units(self.snapshot, level)[u] >= need:
                    picked.remove(r)
                    have -= r.units(self.snapshot, level)[u]
            cost = (max(v.shield for v in picked), sum(v.size for v in picked), len(picked),
                    -max(v.started_at.timestamp() for v in picked), u)  # least work lost: newest victims
            options.append((cost, picked))
        for _, picked in sorted(options, key=lambda o: o[0])[:3]:
            if self._fits_without(job, chosen + picked):
                return chosen + picked
        return None

    def _victims_anywhere(self, job: PendingJob, candidates: list[RunningJob],
                          chosen: list[RunningJob]) -> list[RunningJob]:
        need, kind = job.request.gpu_count, job.request.gpu_type
        free = self.snapshot.free_count(kind) + sum(v.size for v in chosen)
        picked = list(chosen)
        tries = 0
        for r in candidates:
            picked.append(r)
            free += r.size
            if free < need:
                continue
            tries += 1
            if self._fits_without(job, picked):
                break
            if tries >= 8:
                return []
        else:
            return []
        for r in reversed(picked[len(chosen):]):  # drop victims that turned out unnecessary
            rest = [v for v in picked if v is not r]
            if self._fits_without(job, rest):
                picked = rest
        return picked


def most_free(snapshot: ClusterSnapshot, agg: Aggregates, level: int) -> int:
    """The unit of ``level`` with the most usable free capacity (lowest index among equals)."""
    at, i = CLUSTER, 0
    while at < level:
        child = at + 1
        i = max(snapshot.children(at, i), key=lambda c: (snapshot.best_under(agg, child, c, level), -c))
        at = child
    return i


def usable_gain(snapshot: ClusterSnapshot, agg: Aggregates, freed: Iterable[Device], level: int = CLUSTER
                ) -> dict[int, int] | None:
    """Usable capacity (whole TP groups) freeing ``freed`` adds, per unit of ``level``; None for pooled domains."""
    per_node: dict[int, int] = {}
    for d in freed:
        n = snapshot.pos.get(d.node_id)
        if n is not None:
            per_node[n] = per_node.get(n, 0) + 1
    tp, kind = agg.tp, agg.kind
    gains: dict[int, int] = {}
    for n, count in per_node.items():
        if agg.pooled[snapshot.node_dom[n]]:
            return None
        if agg.eligible[n]:
            u = snapshot.unit_of(n, level)
            gain = (len(snapshot.free[n].get(kind, ())) + count) // tp * tp - agg.node_u[n]
            gains[u] = gains.get(u, 0) + gain
    return gains


def fits_after_freeing(snapshot: ClusterSnapshot, agg: Aggregates, request: GangRequest,
                       freed: Sequence[Device]) -> bool | None:
    """Whether :func:`place` would place ``request`` once ``freed`` are free, by counting on the index
    (None when only placing can tell: pooled domains)."""
    need = request.gpu_count
    if request.mode == "pack" or (request.mode == "spread" and not request.spread):
        gains = usable_gain(snapshot, agg, freed)
        return None if gains is None else agg.cap[CLUSTER][0] + sum(gains.values()) >= need
    if request.mode == "spread":  # the N roomiest racks must hold it
        gains = usable_gain(snapshot, agg, freed, RACK)
        if gains is None:
            return None
        caps = sorted((c + gains.get(r, 0) for r, c in enumerate(agg.cap[RACK])), reverse=True)
        return sum(caps[:request.spread]) >= need
    level = {"tier": TIER, "rack": RACK, "domain": DOMAIN}.get(request.mode)
    if level is None:
        return None
    gains = usable_gain(snapshot, agg, freed, level)
    if gains is None:
        return None
    caps = agg.cap[level]
    return max(caps, default=0) >= need or any(caps[u] + g >= need for u, g in gains.items())


__all__ = [
    "WAIT_KINDS",
    "Admit",
    "Decision",
    "PendingJob",
    "PlanStats",
    "Preempt",
    "Reservation",
    "RunningJob",
    "Wait",
    "effective_priority",
    "expected_duration_s",
    "fits_after_freeing",
    "order",
    "plan",
]
