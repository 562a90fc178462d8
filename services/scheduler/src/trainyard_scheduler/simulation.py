"""A discrete-event simulator that drives the real queue and placement code.

The cluster, the job trace and node failures are synthetic (seeded, deterministic); the
decisions are the scheduler's own :func:`~trainyard_scheduler.planner.plan` over a
:class:`~trainyard_scheduler.placement.ClusterSnapshot` that the simulator keeps up to date
incrementally (admissions are taken by ``plan``; ends and failures are given back here), exactly
as the scheduler's shell would, minus Redis and the broker.

Model:

* a pass runs every ``tick_s`` of simulated time when something changed (arrivals, ends,
  failures, repairs, preemptions);
* a job needs ``work_s`` seconds at full speed; its placement slows it down: every TP group
  split over the network adds ``tp_split_slowdown`` (TP traffic is the heaviest), cross-rack
  and cross-tier links add in proportion to their share of the gang's links;
* it checkpoints every ``checkpoint_every_s`` of work; a node failure ends the attempts on it
  (the work since their last checkpoint is lost) and the jobs are requeued; the node comes
  back after ``repair_s``;
* a preempted job is asked to checkpoint, writes one in ``checkpoint_write_s``, is revoked and
  requeued (it loses nothing), unless its preemptor started meanwhile (then it runs on).

Invariants checked on every admission (``check=True``): no device in two live allocations;
no tenant above guaranteed + borrowable; no job lost (every job is pending, running or done).
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from trainyard_contract.events import DeviceInfo

from trainyard_scheduler.decisions import Admit, PendingJob, Placer, PlanStats, Preempt, RunningJob
from trainyard_scheduler.gang import GangRequest, Placement, Unschedulable
from trainyard_scheduler.placement import build_placement, impossible, place
from trainyard_scheduler.planner import plan
from trainyard_scheduler.topology import ClusterSnapshot, NodeView
from trainyard_scheduler.policy import QueueConfig

EPOCH = datetime(2025, 1, 1, tzinfo=UTC)
SIZES = ((1, 4), (2, 4), (4, 8), (8, 18), (16, 14), (32, 12), (64, 10), (128, 9), (256, 8), (512, 6),
         (1024, 4), (2048, 3))
PRIORITIES = ((-100, 20), (0, 60), (100, 15), (1000, 5))


@dataclass(frozen=True)
class ClusterShape:
    nodes: int = 4096
    devices_per_node: int = 8
    nodes_per_domain: int = 1  # 8 devices per NVLink domain
    nodes_per_rack: int = 32
    racks_per_tier: int = 8
    device_type: str = "h100-80gb"
    memory_bytes: int = 80 * 2**30

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def views(self) -> list[NodeView]:
        out = []
        for n in range(self.nodes):
            rack = n // self.nodes_per_rack
            devices = tuple(DeviceInfo(index=i, type=self.device_type, memory_bytes=self.memory_bytes)
                            for i in range(self.devices_per_node))
            out.append(NodeView(node_id=f"n{n:05d}", host=f"10.{rack // 256}.{rack % 256}.{n % 256}",
                                devices=devices, rack=f"r{rack:04d}",
                                nvlink_domain=f"d{n // self.nodes_per_domain:05d}",
                                network_tier=f"t{rack // self.racks_per_tier:03d}"))
        return out


@dataclass(frozen=True)
class TraceShape:
    backlog: int = 10_000  # jobs queued at t=0
    arrivals_per_hour: float = 120.0
    horizon_s: float = 86_400.0
    tenants: int = 4
    median_work_s: float = 3 * 3600.0
    max_work_s: float = 24 * 3600.0
    checkpoint_every_s: float = 1800.0
    node_mtbf_s: float = 60 * 86_400.0  # per node
    repair_s: float = 4 * 3600.0
    seed: int = 7


@dataclass
class SimJob:
    job_id: str
    tenant: str
    priority: int
    size: int
    tensor: int
    pipeline: int
    mode: str
    arrival: float
    work_s: float
    done_s: float = 0.0  # work checkpointed so far
    started: float | None = None  # current attempt's start (sim seconds)
    slowdown: float = 1.0
    first_start: float | None = None
    finished: float | None = None
    attempts: int = 0
    lost_s: float = 0.0
    preemptions: int = 0

    def request(self, kind: str) -> GangRequest:
        return GangRequest(kind, self.size, self.tensor, self.pipeline, self.mode)


def make_trace(trace: TraceShape, cluster: ClusterShape) -> list[SimJob]:
    """Backlog plus Poisson arrivals; sizes 1..2048 (mostly 8+), TP up to 8, PP for big gangs."""
    rng = random.Random(trace.seed)
    sizes, size_w = zip(*[(s, w) for s, w in SIZES if s <= cluster.devices // 2], strict=True)
    prios, prio_w = zip(*PRIORITIES, strict=True)
    jobs: list[SimJob] = []
    t, n = 0.0, 0
    total = trace.backlog + int(trace.arrivals_per_hour * trace.horizon_s / 3600 * 1.5) + 1
    for n in range(total):
        if n >= trace.backlog:
            t += rng.expovariate(trace.arrivals_per_hour / 3600.0)
            if t > trace.horizon_s:
                break
        size = rng.choices(sizes, size_w)[0]
        tp = min(size, cluster.devices_per_node * cluster.nodes_per_domain, rng.choice((1, 2, 4, 8, 8)))
        pp = rng.choice((1, 2, 4)) if size >= 64 else 1
        while size % (tp * pp):
            pp //= 2
        mode = "pack" if rng.random() < 0.95 else "spread"
        work = min(trace.max_work_s, rng.lognormvariate(math.log(trace.median_work_s), 0.9))
        tenant = f"tenant-{rng.randrange(trace.tenants)}"
        jobs.append(SimJob(f"j{n:06d}", tenant, rng.choices(prios, prio_w)[0], size, tp, pp, mode, t, work))
    return jobs


def default_policy(cluster: ClusterShape, tenants: int) -> QueueConfig:
    """Guaranteed shares 40/30/20/10 % (then equal), borrowing up to half the cluster on top."""
    shares = [0.4, 0.3, 0.2, 0.1] if tenants == 4 else [1 / tenants] * tenants
    total = cluster.devices
    return QueueConfig.model_validate({
        "tenants": {
            f"tenant-{i}": {"weight": 1.0, "quotas": {cluster.device_type: {
                "guaranteed": int(total * shares[i]), "borrowLimit": total // 2}}}
            for i in range(tenants)
        },
        "aging": {"everySeconds": 3600, "step": 10},
        "preemption": {"enabled": True, "checkpointGraceSeconds": 300, "maxPerPass": 2},
    })


def first_fit(snapshot: ClusterSnapshot, request: GangRequest) -> Placement | Unschedulable:
    """The naive baseline: nodes in id order, free devices taken as found, topology ignored."""
    return _first_fit(snapshot, request, group=1)


def first_fit_whole_groups(snapshot: ClusterSnapshot, request: GangRequest) -> Placement | Unschedulable:
    """First fit that still keeps every TP group on one node (what the trainer needs), nothing more."""
    return _first_fit(snapshot, request, group=request.tensor)


def _first_fit(snapshot: ClusterSnapshot, request: GangRequest, *, group: int) -> Placement | Unschedulable:
    """Nodes in id order, taking their free devices in whole groups of ``group``."""
    if never := impossible(snapshot, request):
        return never
    kind, need = request.gpu_type, request.gpu_count
    free = snapshot.free_count(kind, group)
    if free < need:
        groups = f" in groups of {group}" if group > 1 else ""
        return Unschedulable(f"waiting for {need} free {kind} devices{groups} ({free} usable)")
    pieces: list[tuple[int, int]] = []
    remaining = need
    for n in range(snapshot.node_count()):
        if not snapshot.available[n]:
            continue
        have = len(snapshot.free[n].get(kind, ())) // group * group
        if have:
            take = min(have, remaining)
            pieces.append((n, take))
            remaining -= take
            if not remaining:
                break
    return build_placement(snapshot, request, pieces)


@dataclass
class SimReport:
    name: str
    decisions: int = 0
    plan_seconds: float = 0.0
    passes: int = 0
    latencies: list[float] = field(default_factory=list)
    admit_latencies: list[float] = field(default_factory=list)
    pass_seconds: list[float] = field(default_factory=list)
    max_pending: int = 0
    mean_pending: float = 0.0
    utilisation: float = 0.0
    goodput: float = 0.0
    fragmentation: float = 0.0
    tp_groups: int = 0
    tp_in_domain: int = 0
    cross_rack_share: float = 0.0
    mean_racks_multi_rack: float = 0.0
    waits: dict[str, list[float]] = field(default_factory=dict)
    still_waiting: dict[str, int] = field(default_factory=dict)
    censored_waits: dict[str, list[float]] = field(default_factory=dict)
    """Per class: the wait of every arrived job — until its first start, or until the horizon for
    one still waiting. Unlike ``waits`` it does not reward leaving hard jobs queued."""
    started: int = 0
    finished: int = 0
    preemptions: int = 0
    backfills: int = 0
    failures: int = 0
    lost_work_h: float = 0.0
    wall_s: float = 0.0

    @property
    def decisions_per_s(self) -> float:
        return self.decisions / self.plan_seconds if self.plan_seconds else 0.0

    def pct(self, values: Sequence[float], q: float) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Simulator:
    """One run of a trace on a cluster with one placer (see the module docstring)."""

    def __init__(self, cluster: ClusterShape, trace: TraceShape, *, placer: Placer = place,
                 policy: QueueConfig | None = None, name: str = "topology-aware", tick_s: float = 300.0,
                 tp_split_slowdown: float = 1.0, cross_rack_slowdown: float = 0.25,
                 cross_tier_slowdown: float = 0.5, checkpoint_write_s: float = 60.0, revoke_pass_s: float = 5.0,
                 react: bool = True, check: bool = False,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.cluster, self.trace, self.placer = cluster, trace, placer
        self.policy = policy or default_policy(cluster, trace.tenants)
        self.tick_s = tick_s
        self.slow = (tp_split_slowdown, cross_rack_slowdown, cross_tier_slowdown)
        self.checkpoint_write_s = checkpoint_write_s
        self.revoke_pass_s = revoke_pass_s
        self.react = react
        self.check = check
        self.timer = timer
        self.report = SimReport(name)
        self.snapshot = ClusterSnapshot(cluster.views())
        self.kind = cluster.device_type
        self.jobs = {j.job_id: j for j in make_trace(trace, cluster)}
        self.pending: dict[str, PendingJob] = {}
        self.running: dict[str, RunningJob] = {}
        self.placements: dict[str, Placement] = {}
        self.owner: dict[tuple[str, int], str] = {}
        self.preempting: dict[str, set[str]] = {}
        self.down: set[str] = set()
        self.events: list[tuple[float, int, str, str, int]] = []
        self._seq = 0
        self._token: dict[str, int] = {}
        self.now = 0.0
        self._last = 0.0
        self._dirty = False
        self._soon = -1.0
        self._allocated = 0
        self._effective = 0.0
        self._area = self._good = self._frag = self._pending_area = 0.0
        self._links = self._cross_rack = 0
        self._multi_rack: list[int] = []
        self.rng = random.Random(trace.seed + 1)

    # ------------------------------------------------------------------ events
    def _push(self, at: float, kind: str, subject: str, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, self._seq, kind, subject, token))

    def run(self) -> SimReport:
        wall = time.perf_counter()
        gc.collect()
        gc.freeze()  # the static cluster and trace, as a long-running service after start-up
        for job in self.jobs.values():
            self._push(job.arrival, "arrive", job.job_id)
        if self.trace.node_mtbf_s:
            rate = self.cluster.nodes / self.trace.node_mtbf_s
            t = self.rng.expovariate(rate)
            while t < self.trace.horizon_s:
                self._push(t, "fail", f"n{self.rng.randrange(self.cluster.nodes):05d}")
                t += self.rng.expovariate(rate)
        t = 0.0
        while t <= self.trace.horizon_s:
            self._push(t, "tick", "")
            t += self.tick_s
        while self.events:
            at, _, kind, subject, token = heapq.heappop(self.events)
            if at > self.trace.horizon_s:
                break
            self._advance(at)
            getattr(self, f"_on_{kind}")(subject, token)
        self._advance(self.trace.horizon_s)
        self._finish_report(time.perf_counter() - wall)
        return self.report

    def _advance(self, at: float) -> None:
        dt = at - self._last
        if dt > 0:
            self._area += self._allocated * dt
            self._good += self._effective * dt
            self._pending_area += len(self.pending) * dt
        self._last = self.now = at

    def _on_arrive(self, job_id: str, _: int) -> None:
        job = self.jobs[job_id]
        self.pending[job_id] = PendingJob(job_id, job.request(self.kind), self._at(job.arrival),
                                          self.policy.priority(job.tenant, job.priority), tenant=job.tenant,
                                          expected_duration_s=job.work_s - job.done_s)
        self._dirty = True

    def _on_finish(self, job_id: str, token: int) -> None:
        if self._token.get(job_id) != token or job_id not in self.running:
            return
        job = self.jobs[job_id]
        job.done_s = job.work_s
        job.finished = self.now
        self._end_attempt(job_id)
        self.report.finished += 1
        self._dirty = True
        self._pass_soon()

    def _on_fail(self, node_id: str, _: int) -> None:
        if node_id in self.down:
            return
        self.down.add(node_id)
        self.report.failures += 1
        for job_id in [j for j, p in self.placements.items() if any(s.node_id == node_id for s in p.nodes)]:
            job = self.jobs[job_id]
            progress = self._progress(job)
            saved = math.floor(progress / self.trace.checkpoint_every_s) * self.trace.checkpoint_every_s
            job.lost_s += progress - saved
            job.done_s = min(job.work_s, job.done_s + saved)
            self._end_attempt(job_id)
            self._requeue(job)
        self.snapshot.set_available(node_id, False)
        self._push(self.now + self.trace.repair_s, "repair", node_id)
        self._dirty = True

    def _on_repair(self, node_id: str, _: int) -> None:
        self.down.discard(node_id)
        self.snapshot.set_available(node_id, True)
        self._dirty = True
        self._pass_soon()

    def _on_preempted(self, job_id: str, _: int) -> None:
        r = self.running.get(job_id)
        if r is None or r.preempted_by is None:
            return
        preemptor = r.preempted_by
        if preemptor not in self.pending:  # it started elsewhere or went away: withdraw
            r.preempted_by = None
            self.preempting.get(preemptor, set()).discard(job_id)
            return
        job = self.jobs[job_id]
        job.done_s = min(job.work_s, job.done_s + self._progress(job))  # the requested checkpoint
        job.preemptions += 1
        self.report.preemptions += 1
        self._end_attempt(job_id)
        self._requeue(job)
        self.preempting.get(preemptor, set()).discard(job_id)
        self._dirty = True
        if not self.preempting.get(preemptor):  # free now: a pass soon, not next tick
            self._pass_soon()

    def _pass_soon(self) -> None:
        """The shell passes every second: devices freed now are offered within ``revoke_pass_s``, not at
        the next (coarse) simulated tick."""
        if self.react and self._soon < self.now:
            self._soon = self.now + self.revoke_pass_s
            self._push(self._soon, "tick", "")

    def _on_tick(self, _: str, __: int) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self._pass()

    # ------------------------------------------------------------------ the scheduling pass
    def _pass(self) -> None:
        now = self._at(self.now)
        for p, victims in self.preempting.items():
            if p in self.pending:
                self.pending[p] = replace(self.pending[p], preempting=tuple(sorted(victims)))
        stats = PlanStats()
        t0 = self.timer()
        decisions = plan(self.snapshot, list(self.pending.values()), now, running=list(self.running.values()),
                         policy=self.policy, stats=stats, timer=self.timer, placer=self.placer)
        elapsed = self.timer() - t0
        rep = self.report
        rep.passes += 1
        rep.plan_seconds += elapsed
        rep.pass_seconds.append(elapsed)
        rep.decisions += len(stats.latencies)
        rep.latencies.extend(stats.latencies)
        rep.admit_latencies.extend(stats.admit_latencies)
        rep.max_pending = max(rep.max_pending, len(self.pending))
        for d in decisions:
            if isinstance(d, Admit):
                self._start(d)
            elif isinstance(d, Preempt):
                for v in d.victims:
                    self.running[v].preempted_by = d.job_id
                    self.preempting.setdefault(d.job_id, set()).add(v)
                    self._push(self.now + self.checkpoint_write_s, "preempted", v)
        self._frag_sample()

    def _start(self, decision: Admit) -> None:
        job = self.jobs[decision.job_id]
        p = decision.placement
        if self.check:
            self._check_admission(job, p)
        del self.pending[job.job_id]
        self.preempting.pop(job.job_id, None)
        job.attempts += 1
        job.started = self.now
        if job.first_start is None:
            job.first_start = self.now
            self.report.started += 1
        if decision.backfill:
            self.report.backfills += 1
        job.slowdown = self._slowdown(job, p)
        self.placements[job.job_id] = p
        base = self.policy.priority(job.tenant, job.priority)
        self.running[job.job_id] = RunningJob(
            job.job_id, job.tenant, base, self.kind, tuple(p.devices()), self._at(self.now),
            self._at(self.now + (job.work_s - job.done_s) * job.slowdown),
            admitted_priority=base + self.policy.boost(self.now - job.arrival))
        for d in p.devices():
            self.owner[(d.node_id, d.index)] = job.job_id
        self._allocated += job.size
        self._effective += job.size / job.slowdown
        token = self._token.get(job.job_id, 0) + 1
        self._token[job.job_id] = token
        self._push(self.now + (job.work_s - job.done_s) * job.slowdown, "finish", job.job_id, token)
        detail = p.detail
        if detail is not None and job.mode == "pack":  # spread gangs cross racks on purpose
            self.report.tp_groups += job.size // job.tensor if job.tensor > 1 else 0
            self.report.tp_in_domain += (job.size // job.tensor - detail.tp_groups_split) if job.tensor > 1 else 0
            self._links += detail.links
            self._cross_rack += detail.cross_rack_links
            if detail.racks > 1:
                self._multi_rack.append(detail.racks)

    def _slowdown(self, job: SimJob, p: Placement) -> float:
        d = p.detail
        if d is None or not d.links:
            return 1.0
        tp_split, rack, tier = self.slow
        groups = max(1, job.size // job.tensor)
        return (1.0 + tp_split * d.tp_groups_split / groups + rack * (d.cross_rack_links - d.cross_tier_links) / d.links
                + tier * d.cross_tier_links / d.links)

    def _progress(self, job: SimJob) -> float:
        return max(0.0, (self.now - (job.started or self.now)) / job.slowdown)

    def _end_attempt(self, job_id: str) -> None:
        job = self.jobs[job_id]
        p = self.placements.pop(job_id)
        self.running.pop(job_id)
        self._token[job_id] = self._token.get(job_id, 0) + 1
        self.snapshot.give(p)
        for d in p.devices():
            self.owner.pop((d.node_id, d.index), None)
        self._allocated -= job.size
        self._effective -= job.size / job.slowdown
        job.started = None
        for victims in self.preempting.values():
            victims.discard(job_id)

    def _requeue(self, job: SimJob) -> None:
        self._on_arrive(job.job_id, 0)

    def _check_admission(self, job: SimJob, p: Placement) -> None:
        devices = p.devices()
        assert len(devices) == job.size == len({(d.node_id, d.index) for d in devices}), job.job_id
        for d in devices:
            assert (d.node_id, d.index) not in self.owner, f"{d} double-booked ({self.owner.get((d.node_id, d.index))})"
            assert d.node_id not in self.down, f"{d} is on a failed node"
        used = sum(self.jobs[r].size for r in self.running if self.jobs[r].tenant == job.tenant) + job.size
        assert used <= self.policy.cap(job.tenant, self.kind), f"{job.tenant} over quota: {used}"

    def _frag_sample(self) -> None:
        self._frag += self.snapshot.fragmentation(self.kind)

    def _at(self, seconds: float) -> datetime:
        return EPOCH + timedelta(seconds=seconds)

    # ------------------------------------------------------------------ report
    def _finish_report(self, wall_s: float) -> None:
        rep = self.report
        span = self.trace.horizon_s
        capacity = self.cluster.devices
        rep.utilisation = self._area / (capacity * span)
        rep.goodput = self._good / (capacity * span)
        rep.mean_pending = self._pending_area / span
        rep.fragmentation = self._frag / rep.passes if rep.passes else 0.0
        rep.cross_rack_share = self._cross_rack / self._links if self._links else 0.0
        rep.mean_racks_multi_rack = statistics.fmean(self._multi_rack) if self._multi_rack else 0.0
        rep.lost_work_h = sum(j.lost_s for j in self.jobs.values()) / 3600
        for job in self.jobs.values():
            if job.arrival > span:
                continue
            cls = self.policy.class_of(job.priority)
            if job.first_start is not None:
                rep.waits.setdefault(cls, []).append(job.first_start - job.arrival)
                rep.censored_waits.setdefault(cls, []).append(job.first_start - job.arrival)
            else:
                rep.still_waiting[cls] = rep.still_waiting.get(cls, 0) + 1
                rep.censored_waits.setdefault(cls, []).append(span - job.arrival)
        rep.wall_s = wall_s

    def check_no_job_lost(self) -> None:
        """Every arrived job is pending, running or finished."""
        for job in self.jobs.values():
            if job.arrival > self.now:
                continue
            states = (job.job_id in self.pending) + (job.job_id in self.running) + (job.finished is not None)
            assert states == 1, f"{job.job_id}: pending/running/finished = {states}"
