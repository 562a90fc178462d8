"""The planner's vocabulary: what a pass is given (:class:`PendingJob`, :class:`RunningJob`) and what it decides
(:class:`Admit`, :class:`Wait`, :class:`Preempt`), with the reservations it makes and the figures it can report.
Plain data: :mod:`planner` and its parts (:mod:`quota`, :mod:`backfill`, :mod:`preemption`) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from trainyard_contract.devices import Device

from trainyard_scheduler.gang import GangRequest, Placement, Unschedulable
from trainyard_scheduler.topology import ClusterSnapshot

WAIT_KINDS = ("quota", "capacity", "topology", "priority", "preemption", "backoff")


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
