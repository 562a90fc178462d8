"""Reservations and EASY backfill within one planning pass: pure, over the pass's snapshot.

The first job of each device type that capacity blocks gets a *reservation*: the free devices of the unit it
will start in (the one where running jobs end soonest, when all of them say when; else the roomiest) are held
back — taken out of the snapshot as "phantom" allocations — from the jobs behind it. A job behind it may still
use held devices if it is expected to end before the reserved start (EASY backfill; it needs expected
durations, which only the simulator and specs with ``expectedDurationMinutes`` give). Devices the head will not
need at its start stay free (EASY's "extra" devices). After the pass every phantom is given back, so the
snapshot again holds exactly the admitted placements.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from trainyard_contract.devices import Device

from trainyard_scheduler.decisions import PendingJob, Placer, PlanStats, Reservation, RunningJob, Wait
from trainyard_scheduler.gang import Placement, Unschedulable
from trainyard_scheduler.placement import fill, idle_level
from trainyard_scheduler.policy import QueueConfig
from trainyard_scheduler.topology import CLUSTER, DOMAIN, LEVEL_NAMES, RACK, TIER, Aggregates, ClusterSnapshot

def most_free(snapshot: ClusterSnapshot, agg: Aggregates, level: int) -> int:
    """The unit of ``level`` with the most usable free capacity (lowest index among equals)."""
    at, i = CLUSTER, 0
    while at < level:
        child = at + 1
        i = max(snapshot.children(at, i), key=lambda c: (snapshot.best_under(agg, child, c, level), -c))
        at = child
    return i


def unit_name(snapshot: ClusterSnapshot, level: int, unit: int) -> str:
    """``rack r1``, ``the cluster``, …: how a reason names a unit."""
    if level == CLUSTER:
        return "the cluster"
    name = {TIER: snapshot.tier_names, RACK: snapshot.rack_names, DOMAIN: snapshot.dom_names}[level][unit]
    return f"{LEVEL_NAMES[level]} {name or '(default)'}"


class Reservations:
    """The devices held back in this pass, per device type, and the backfill they allow."""

    def __init__(self, snapshot: ClusterSnapshot, policy: QueueConfig, now: datetime,
                 running: dict[str, RunningJob], place: Placer, stats: PlanStats | None) -> None:
        self.snapshot, self.policy, self.now, self.running = snapshot, policy, now, running
        self.place, self.stats = place, stats
        self.first: dict[str, Reservation] = {}  # the first reservation per device type (named in reasons)
        self.count: dict[str, int] = {}
        self.until: dict[str, datetime | None] = {}  # earliest reserved start; None = no backfill past it
        self.phantoms: list[tuple[str, list[Device]]] = []
        self.held: dict[str, int] = {}  # devices held back per type

    # ---------------------------------------------------------------- holding devices back
    def hold(self, kind: str, devices: list[Device], reservation: Reservation) -> None:
        """Take ``devices`` out of the snapshot for ``reservation``'s job and count the reservation."""
        if devices:
            self.snapshot.take_devices(kind, devices)
            self.phantoms.append((kind, devices))
            self.held[kind] = self.held.get(kind, 0) + len(devices)
        self.first.setdefault(kind, reservation)
        self.count[kind] = self.count.get(kind, 0) + 1
        if self.count[kind] == 1:
            self.until[kind] = reservation.start
        else:
            until = self.until.get(kind)
            self.until[kind] = None if until is None or reservation.start is None else min(until, reservation.start)

    def undo(self) -> None:
        """Give every held device back (the end of the pass)."""
        for kind, devices in reversed(self.phantoms):
            self.snapshot.give_devices(kind, devices)
        self.phantoms.clear()

    # ---------------------------------------------------------------- backfill
    def backfill(self, job: PendingJob) -> Placement | Wait | None:
        """For a job that did not fit: None when reservations are not what blocks it; else a placement on held
        devices when it ends before the reserved start (backfill), or why it waits for the job they are held for."""
        kind = job.request.gpu_type
        held = self.held.get(kind, 0)
        if not held or self.snapshot.free_count(kind) + held < job.request.gpu_count:
            return None
        holder, until = self.first.get(kind), self.until.get(kind)
        ends = (self.now + timedelta(seconds=job.expected_duration_s)) if job.expected_duration_s else None
        if until is not None and ends is not None and ends <= until:
            placed = self._place_ignoring_reservations(job)
            if placed is not None:
                return placed
        who = holder.job_id if holder else "jobs ahead in the queue"
        when = f"; it should start by {holder.start.isoformat(timespec='seconds')}" if holder and holder.start else ""
        return Wait(job.job_id, f"priority: the free {kind} devices are held for {who}, "
                                f"which is ahead in the queue{when}", True, "priority")

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
                self.held[kind] -= len(devices) - len(keep)
        return result

    # ---------------------------------------------------------------- reserving
    def wait_for_capacity(self, job: PendingJob, result: Unschedulable) -> Wait:
        """Why a job capacity blocks waits; the first ones in line (``policy.reservations`` a type) reserve."""
        kind = job.request.gpu_type
        reason = result.message
        if self.policy.backfill and self.count.get(kind, 0) < self.policy.reservations:
            reservation = self._reserve(job)
            if reservation is not None:
                reason += f"; next in line for {kind}: free devices in {reservation.where} are held for it"
                if reservation.start:
                    reason += f", expected start {reservation.start.isoformat(timespec='seconds')}"
        return Wait(job.job_id, reason, result.fits_when_idle, result.kind)

    def _reserve(self, job: PendingJob) -> Reservation | None:
        """Hold the free devices of the unit the head job will start in (one per device type)."""
        snap, request = self.snapshot, job.request
        agg = snap.aggregates_for(request)
        need = request.gpu_count
        level = idle_level(agg, need, request.mode)
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
        reservation = Reservation(job.job_id, request.gpu_type, tuple(held), start, unit_name(snap, level, unit))
        self.hold(request.gpu_type, held, reservation)
        if self.stats is not None:
            self.stats.reservations.append(reservation)
        return reservation

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
