"""Quotas and fair sharing within one planning pass: pure, in memory.

Each tenant holds devices of each type; it may hold its ``guaranteed`` share plus what it may borrow up to its
``cap``, and a cohort of tenants at most the cohort's limit (:mod:`policy`). Across tenants the pass serves the
head with the smallest *weighted dominant share* (DRF: the largest fraction of any device type the tenant holds,
divided by its weight), recomputed as the pass admits, so that tenants interleave fairly. A tenant above its
guarantee is *borrowing*: what it borrowed may be reclaimed by preemption (:mod:`preemption`).
"""

from __future__ import annotations

from collections.abc import Iterable

from trainyard_scheduler.decisions import RunningJob
from trainyard_scheduler.gang import GangRequest
from trainyard_scheduler.policy import QueueConfig
from trainyard_scheduler.topology import ClusterSnapshot


class Quota:
    """What each tenant (and cohort) holds during a pass, and what that allows."""

    def __init__(self, snapshot: ClusterSnapshot, policy: QueueConfig, running: Iterable[RunningJob] = ()) -> None:
        self.snapshot, self.policy = snapshot, policy
        self.usage: dict[tuple[str, str], int] = {}
        self.cohort_usage: dict[tuple[str, str], int] = {}
        self._shares: dict[str, float] = {}
        self._capacities: dict[str, int] = {}
        self._limits: dict[tuple[str, str], tuple[int, int]] = {}
        for r in running:
            self.use(r.tenant, r.gpu_type, r.size)

    def use(self, tenant: str, kind: str, n: int) -> None:
        """``tenant`` now holds ``n`` more devices of ``kind``."""
        self.usage[(tenant, kind)] = self.usage.get((tenant, kind), 0) + n
        self._shares.pop(tenant, None)
        cohort = self.policy.tenant(tenant).cohort
        self.cohort_usage[(cohort, kind)] = self.cohort_usage.get((cohort, kind), 0) + n

    def used(self, tenant: str, kind: str) -> int:
        return self.usage.get((tenant, kind), 0)

    def share(self, tenant: str) -> float:
        """Weighted dominant share: the largest fraction of any device type the tenant holds, over its weight."""
        share = self._shares.get(tenant)
        if share is None:
            used = [n / self._capacity(k) for (t, k), n in self.usage.items() if t == tenant and n]
            share = self._shares[tenant] = max(used, default=0.0) / self.policy.tenant(tenant).weight
        return share

    def limits(self, tenant: str, kind: str) -> tuple[int, int]:
        """(guaranteed, cap) of the tenant for the device type."""
        limits = self._limits.get((tenant, kind))
        if limits is None:
            limits = self._limits[(tenant, kind)] = (self.policy.guaranteed(tenant, kind),
                                                     self.policy.cap(tenant, kind))
        return limits

    def problem(self, tenant: str, request: GangRequest) -> str | None:
        """Why ``tenant`` may not take ``request`` now (its cap, or its cohort's limit); None if it may."""
        kind, need = request.gpu_type, request.gpu_count
        used = self.used(tenant, kind)
        g, cap = self.limits(tenant, kind)
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

    def within_guarantee(self, tenant: str, request: GangRequest) -> bool:
        """Would ``tenant`` stay within its guaranteed share holding ``request`` too?"""
        kind = request.gpu_type
        return self.used(tenant, kind) + request.gpu_count <= self.limits(tenant, kind)[0]

    def over_cap_by(self, tenant: str, request: GangRequest) -> int:
        """How many devices ``tenant`` would hold beyond its cap with ``request`` (≤ 0: none)."""
        kind = request.gpu_type
        return self.used(tenant, kind) + request.gpu_count - self.limits(tenant, kind)[1]

    def borrowing(self, tenant: str, kind: str) -> bool:
        """Does ``tenant`` hold more ``kind`` devices than it is guaranteed?"""
        return self.used(tenant, kind) > self.limits(tenant, kind)[0]

    def borrowers(self, kind: str, *, besides: str) -> bool:
        """Does any tenant other than ``besides`` borrow ``kind`` devices now?"""
        return any(t != besides and n and self.borrowing(t, k) for (t, k), n in self.usage.items() if k == kind)

    def _capacity(self, kind: str) -> int:
        if kind not in self._capacities:
            self._capacities[kind] = max(1, self.snapshot.capacity(kind))
        return self._capacities[kind]
