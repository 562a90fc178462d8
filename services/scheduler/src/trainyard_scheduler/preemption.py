"""Checkpoint-first preemption within one planning pass: pure, over the pass's snapshot.

A queued job may preempt running work it has rights over: lower-priority jobs of its own tenant, and borrowed
capacity of another tenant — reclaimed for a job within its guarantee, or of higher priority (:mod:`quota`). A job
that waited its way up by aging is shielded by the priority it was admitted with (``RunningJob.shield``); aging
never grants preemption rights. Victims are chosen topology-aware: inside the smallest unit where the gang fits
when idle, the cheapest set (lowest priority, then fewest devices, then most recently started); else anywhere,
dropping victims the others make unnecessary. The preemptor then waits for them to checkpoint and stop, the
devices it will use held for it (:mod:`backfill`), and a search that found nothing is not repeated for an
equivalent job in the same pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from trainyard_contract.devices import Device

from trainyard_scheduler.backfill import Reservations
from trainyard_scheduler.decisions import (
    Decision,
    PendingJob,
    Placer,
    PlanStats,
    Preempt,
    Reservation,
    RunningJob,
    Wait,
)
from trainyard_scheduler.gang import GangRequest, Placement
from trainyard_scheduler.placement import idle_level, place
from trainyard_scheduler.policy import UNLIMITED, QueueConfig
from trainyard_scheduler.quota import Quota
from trainyard_scheduler.topology import CLUSTER, DOMAIN, RACK, TIER, Aggregates, ClusterSnapshot

MAX_CANDIDATES = 128  # the cheapest victims a preemption search considers (bounds its cost)
UNIT_CANDIDATES = 48  # of which, for a gang that fits one unit
_MAX_TRIES = 8  # placements tried while adding victims anywhere


class Preemption:
    """The victims of this pass and the searches for more (see the module docstring)."""

    def __init__(self, snapshot: ClusterSnapshot, policy: QueueConfig, now: datetime, running: dict[str, RunningJob],
                 quota: Quota, reservations: Reservations, place: Placer, stats: PlanStats | None) -> None:
        self.snapshot, self.policy, self.now, self.running = snapshot, policy, now, running
        self.quota, self.reservations, self.place, self.stats = quota, reservations, place, stats
        self.busy: set[str] = {r.job_id for r in running.values() if r.preempted_by}  # victims already
        self.lowest: dict[str, int] = {}  # per device type: lowest shield of a running job not yet a victim
        for r in running.values():
            if r.job_id not in self.busy:
                self.lowest[r.gpu_type] = min(self.lowest.get(r.gpu_type, r.shield), r.shield)
        self._no_victims: set[tuple[object, ...]] = set()
        self.searches = 0

    def capacity_changed(self) -> None:
        """A job was admitted: searches that found no victims may find some now."""
        self._no_victims.clear()

    def in_progress(self, job: PendingJob) -> Wait | None:
        """A preemption for ``job`` is under way: keep its devices held and say what it waits for."""
        victims = [self.running[v] for v in job.preempting if v in self.running]
        if not victims:
            return None
        self.busy.update(v.job_id for v in victims)
        self._hold_for_preemptor(job, victims)
        names = ", ".join(v.job_id for v in victims)
        return Wait(job.job_id, f"preemption: waiting for {names} to checkpoint and stop (preempted for this job)",
                    True, "preemption")

    def maybe_preempt(self, job: PendingJob, over: str | None) -> list[Decision]:
        """Victims for ``job`` (``over``: the quota problem that blocks it, if any): the Preempt and the preemptor's
        Wait, or nothing when it has no rights, no victims would do, or the pass's searches are spent."""
        cfg = self.policy.preemption
        if not cfg.enabled or self.searches >= cfg.max_per_pass or not self._may_preempt(job):
            return []
        within = self.quota.within_guarantee(job.tenant, job.request)
        memo = (job.tenant, job.request.gpu_type, job.priority, over is not None, within)
        if memo in self._no_victims:
            return []
        candidates = self._candidates(job, quota_blocked=over is not None)
        if not candidates:
            self._no_victims.add(memo)
            return []
        self.searches += 1
        if self.stats is not None:
            self.stats.preemption_searches += 1
        victims = self._choose_victims(job, candidates, over is not None)
        if not victims:
            return []
        self._no_victims.clear()
        self.busy.update(v.job_id for v in victims)
        names = tuple(v.job_id for v in victims)
        why = "lower priority" if all(v.shield < job.priority for v in victims) else "borrowed capacity reclaimed"
        grace = int(cfg.checkpoint_grace_seconds)
        self._hold_for_preemptor(job, victims)
        return [Preempt(job.job_id, names, f"preempted for {job.job_id} ({why}); checkpoint within {grace}s"),
                Wait(job.job_id, f"preemption: waiting for {', '.join(names)} to checkpoint and stop ({why})",
                     True, "preemption")]

    def _may_preempt(self, job: PendingJob) -> bool:
        """A quick test: could any running job be a victim of ``job`` at all?"""
        kind = job.request.gpu_type
        return self.lowest.get(kind, UNLIMITED) < job.priority or self.quota.borrowers(kind, besides=job.tenant)

    def _hold_for_preemptor(self, job: PendingJob, victims: Sequence[RunningJob]) -> None:
        """Hold, for ``job``, the free devices it will use beside its victims' once they stop."""
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
            self.reservations.hold(kind, held, Reservation(job.job_id, kind, tuple(held), None,
                                                           "the devices of the jobs it preempts"))

    def _candidates(self, job: PendingJob, *, quota_blocked: bool) -> list[RunningJob]:
        """Running jobs ``job`` may preempt, cheapest first (lowest priority, newest, smallest)."""
        kind, tenant = job.request.gpu_type, job.tenant
        within = self.quota.within_guarantee(tenant, job.request)
        settled = self.now - timedelta(seconds=self.policy.preemption.min_runtime_seconds)
        out = []
        for r in self.running.values():
            if r.gpu_type != kind or r.job_id in self.busy or r.started_at > settled:
                continue
            if r.tenant == tenant:
                if r.shield < job.priority:
                    out.append(r)
            elif not quota_blocked and self.quota.borrowing(r.tenant, kind) and (within or r.shield < job.priority):
                out.append(r)
        out.sort(key=lambda r: (r.shield, -r.started_at.timestamp(), r.size, r.job_id))
        return out[:MAX_CANDIDATES]

    def _choose_victims(self, job: PendingJob, candidates: list[RunningJob], quota_blocked: bool) -> list[RunningJob]:
        chosen: list[RunningJob] = []
        if quota_blocked:  # first get under the tenant's own cap with its own lower-priority jobs
            excess = self.quota.over_cap_by(job.tenant, job.request)
            for r in [c for c in candidates if c.tenant == job.tenant]:
                if excess <= 0:
                    break
                chosen.append(r)
                excess -= r.size
            if excess > 0:
                return []
            candidates = [c for c in candidates if c not in chosen]
        if self._fits_without(job, chosen):
            return chosen
        agg = self.snapshot.aggregates_for(job.request)
        level = idle_level(agg, job.request.gpu_count, job.request.mode)
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
            fits = fits_after_freeing(snap, snap.aggregates_for(request), request, freed)
            if fits is not None:
                return fits
        snap.give_devices(kind, freed)
        try:
            return isinstance(self.place(snap, request), Placement)
        finally:
            snap.take_devices(kind, freed)

    def _victims_in_unit(self, job: PendingJob, agg: Aggregates, level: int, candidates: list[RunningJob],
                         chosen: list[RunningJob]) -> list[RunningJob] | None:
        """The cheapest victim set inside one unit of ``level`` that holds the gang when idle."""
        need, snap = job.request.gpu_count, self.snapshot
        idle, cap = agg.idle[level], agg.cap[level]
        buckets: dict[int, list[RunningJob]] = {}
        for r in candidates:
            for u in r.units(snap, level):
                if idle[u] >= need:
                    buckets.setdefault(u, []).append(r)
        options = []
        for u, rs in buckets.items():
            have = cap[u] + sum(v.units(snap, level).get(u, 0) for v in chosen)
            picked = []
            for r in rs:
                if have >= need:
                    break
                picked.append(r)
                have += r.units(snap, level)[u]
            if have < need:
                continue
            for r in sorted(picked, key=lambda v: -v.size):  # drop victims the others make unnecessary
                if have - r.units(snap, level)[u] >= need:
                    picked.remove(r)
                    have -= r.units(snap, level)[u]
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
            if tries >= _MAX_TRIES:
                return []
        else:
            return []
        for r in reversed(picked[len(chosen):]):  # drop victims that turned out unnecessary
            rest = [v for v in picked if v is not r]
            if self._fits_without(job, rest):
                picked = rest
        return picked


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
