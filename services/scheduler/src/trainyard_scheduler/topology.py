"""The cluster's topology index: pure, mutable, no I/O — what :mod:`placement` places gangs on.

The cluster is a tree: cluster → network tier (pod / spine block) → rack → NVLink domain (one
node, or a block of nodes such as an NVL72) → node → device. A node that reports no rack or
tier sits in the anonymous rack / tier; a node that reports no NVLink domain is its own domain.

:class:`ClusterSnapshot` numbers the units of every level, keeps each available node's free devices, and
hands out :class:`Aggregates`: incremental free-capacity indexes per ``(device type, TP size, memory floor)``
at every level, kept current as placements are taken and given back, so that deciding that a gang does *not*
fit is O(1) and placing one costs O(children visited), not O(nodes). Placing never mutates it; callers
``take`` / ``give`` placements.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from trainyard_contract.devices import Device
from trainyard_contract.events import DeviceInfo
from trainyard_contract.records import NodeRecord

from trainyard_scheduler.gang import GangRequest, Placement, Unschedulable

CLUSTER, TIER, RACK, DOMAIN, NODE = 0, 1, 2, 3, 4
LEVEL_NAMES = ("cluster", "network tier", "rack", "NVLink domain", "node")


@dataclass(frozen=True)
class NodeView:
    """One available node as the planner sees it.

    ``penalty`` is the seam for node reputation (issue 6: stragglers, flaky hosts): among
    otherwise equal choices, nodes with a higher penalty are used last. Unavailable or
    quarantined nodes are simply left out of the snapshot.
    """

    node_id: str
    host: str
    devices: tuple[DeviceInfo, ...]
    leased: frozenset[int] = frozenset()
    rack: str | None = None
    nvlink_domain: str | None = None
    network_tier: str | None = None
    penalty: float = 0.0

    @classmethod
    def from_record(cls, record: NodeRecord, leased: Iterable[int] = (), *, penalty: float = 0.0) -> NodeView:
        return cls(
            node_id=record.node_id, host=record.host, devices=tuple(record.devices), leased=frozenset(leased),
            rack=record.rack, nvlink_domain=record.nvlink_domain, network_tier=record.network_tier,
            penalty=penalty,
        )

    def healthy(self, gpu_type: str) -> tuple[int, ...]:
        """Indices of the healthy devices of ``gpu_type``, ascending."""
        return tuple(sorted(d.index for d in self.devices if d.type == gpu_type and d.healthy))

    def free(self, gpu_type: str) -> tuple[int, ...]:
        """Healthy devices of ``gpu_type`` that no live allocation holds, ascending."""
        return tuple(i for i in self.healthy(gpu_type) if i not in self.leased)


class Aggregates:
    """Usable capacity (whole TP groups of ``tp``) of one device type at every level.

    Built and kept current by :class:`ClusterSnapshot` (:meth:`ClusterSnapshot.aggregates`); callers
    such as the queue planner read it and never write it. Lists indexed by level (``CLUSTER``,
    ``TIER``, ``RACK``, ``DOMAIN``) hold one entry per unit of that level:

    - ``cap`` / ``idle``: usable devices now / were every healthy device free;
    - ``best_dom`` / ``best_rack``: the largest single domain / rack ``cap`` under each cluster, tier (and rack) unit;
    - ``idle_best_dom`` / ``idle_best_rack`` / ``idle_best_tier``: the largest single unit's ``idle``;
    - per node ``eligible`` (available and above the memory ``floor``) and ``node_u`` (its usable devices);
      per domain ``pooled`` (TP groups may span its nodes) and ``solo`` (one node, not pooled).
    """

    __slots__ = ("kind", "tp", "floor", "pooled", "solo", "eligible", "node_u", "cap", "best_dom", "best_rack",
                 "idle", "idle_best_dom", "idle_best_rack", "idle_best_tier")

    def __init__(self, kind: str, tp: int, floor: int) -> None:
        self.kind, self.tp, self.floor = kind, tp, floor
        self.pooled: list[bool] = []
        self.solo: list[bool] = []  # a domain of one node, not pooled: its capacity is the node's
        self.eligible: list[bool] = []
        self.node_u: list[int] = []
        self.cap: list[list[int]] = [[0], [], [], []]  # per level: cluster, tier, rack, domain
        self.best_dom: list[list[int]] = [[0], [], []]  # best single-domain cap under cluster/tier/rack
        self.best_rack: list[list[int]] = [[0], []]  # best single-rack cap under cluster/tier
        self.idle: list[list[int]] = [[0], [], [], []]
        self.idle_best_dom = 0
        self.idle_best_rack = 0
        self.idle_best_tier = 0

    def refresh_counts(self, snap: ClusterSnapshot, counts: dict[int, int]) -> None:
        """The fast path of :meth:`refresh_nodes` for take/give: ``{node: free devices of the kind}``."""
        tp, node_u, eligible, node_dom, dom_rack = self.tp, self.node_u, self.eligible, snap.node_dom, snap.dom_rack
        solo, dom_cap = self.solo, self.cap[DOMAIN]
        deltas: dict[int, int] = {}
        shared = []
        for n, count in counts.items():
            u = count // tp * tp if eligible[n] else 0
            old = node_u[n]
            if u == old:
                continue
            node_u[n] = u
            d = node_dom[n]
            if solo[d]:
                dom_cap[d] += u - old
                r = dom_rack[d]
                deltas[r] = deltas.get(r, 0) + u - old
            else:
                shared.append(n)
        if shared:
            self.refresh_nodes(snap, shared, idle=False, deltas=deltas)
            return
        self._push_up(snap, deltas)

    def qualifies(self, snap: ClusterSnapshot, n: int) -> bool:
        """Node ``n`` counts for this index: available, and its devices above the memory ``floor``."""
        return snap.available[n] and (not self.floor or snap.memory[n].get(self.kind, 0) >= self.floor)

    def _node_usable(self, snap: ClusterSnapshot, n: int, *, idle: bool) -> int:
        if not self.eligible[n]:
            return 0
        count = snap.healthy[n].get(self.kind, 0) if idle else len(snap.free[n].get(self.kind, ()))
        return count // self.tp * self.tp

    def _dom_usable(self, snap: ClusterSnapshot, d: int, *, idle: bool) -> int:
        nodes = snap.dom_nodes[d]
        if not self.pooled[d]:
            if idle:
                return sum(self._node_usable(snap, n, idle=True) for n in nodes)
            return self.node_u[nodes[0]] if len(nodes) == 1 else sum(self.node_u[n] for n in nodes)
        total = 0
        for n in nodes:
            if self.eligible[n]:
                total += snap.healthy[n].get(self.kind, 0) if idle else len(snap.free[n].get(self.kind, ()))
        return total // self.tp * self.tp

    @classmethod
    def build(cls, snap: ClusterSnapshot, kind: str, tp: int, floor: int) -> Aggregates:
        """The index of ``kind`` in TP groups of ``tp`` over the snapshot as it is now."""
        agg = cls(kind, tp, floor)
        for nodes in snap.dom_nodes:
            sizes = [snap.healthy[n].get(kind, 0) for n in nodes if snap.healthy[n].get(kind, 0)]
            agg.pooled.append(bool(sizes) and tp > min(sizes))
            agg.solo.append(len(nodes) == 1 and not agg.pooled[-1])
        agg.eligible = [agg.qualifies(snap, n) for n in range(snap.node_count())]
        agg.node_u = [agg._node_usable(snap, n, idle=False) for n in range(snap.node_count())]
        agg.cap = [[0], [0] * len(snap.tier_names), [0] * len(snap.rack_names), [0] * len(snap.dom_names)]
        agg.idle = [[0], [0] * len(snap.tier_names), [0] * len(snap.rack_names), [0] * len(snap.dom_names)]
        agg.best_dom = [[0], [0] * len(snap.tier_names), [0] * len(snap.rack_names)]
        agg.best_rack = [[0], [0] * len(snap.tier_names)]
        agg._apply_doms(snap, range(len(snap.dom_names)), idle=False)
        agg._apply_doms(snap, range(len(snap.dom_names)), idle=True)
        agg._refresh_best(snap, range(len(snap.rack_names)))
        agg._refresh_idle_best()
        return agg

    def refresh_nodes(self, snap: ClusterSnapshot, nodes: Iterable[int], *, idle: bool,
                      deltas: dict[int, int] | None = None) -> None:
        """Nodes' free devices changed (or their availability, ``idle``): update the aggregates."""
        kind, tp, free, node_u, eligible = self.kind, self.tp, snap.free, self.node_u, self.eligible
        node_dom, dom_nodes, dom_rack, pooled = snap.node_dom, snap.dom_nodes, snap.dom_rack, self.pooled
        dom_cap = self.cap[DOMAIN]
        deltas = {} if deltas is None else deltas
        shared: set[int] = set()
        touched: set[int] = set()
        for n in nodes:
            if idle:
                eligible[n] = self.qualifies(snap, n)
            u = len(free[n].get(kind, ())) // tp * tp if eligible[n] else 0
            old = node_u[n]
            node_u[n] = u
            d = node_dom[n]
            if idle:
                touched.add(d)
            if pooled[d] or len(dom_nodes[d]) > 1:
                shared.add(d)
            elif u != old:  # a node alone in its domain: the domain's capacity is the node's
                dom_cap[d] += u - old
                r = dom_rack[d]
                deltas[r] = deltas.get(r, 0) + u - old
        for d in shared:
            new = self._dom_usable(snap, d, idle=False)
            if new != dom_cap[d]:
                r = dom_rack[d]
                deltas[r] = deltas.get(r, 0) + new - dom_cap[d]
                dom_cap[d] = new
        if idle:
            self._apply_doms(snap, touched, idle=True)
            self._refresh_idle_best()
        self._push_up(snap, deltas)

    def _push_up(self, snap: ClusterSnapshot, deltas: dict[int, int]) -> None:
        """Add per-rack capacity changes to the racks, tiers and the cluster; refresh the maxima."""
        if not deltas:
            return
        rack_cap, tier_cap, rack_tier = self.cap[RACK], self.cap[TIER], snap.rack_tier
        total = 0
        for r, delta in deltas.items():
            rack_cap[r] += delta
            tier_cap[rack_tier[r]] += delta
            total += delta
        self.cap[CLUSTER][0] += total
        self._refresh_best(snap, deltas)

    def _apply_doms(self, snap: ClusterSnapshot, doms: Iterable[int], *, idle: bool) -> set[int]:
        """Recompute the domains' capacity and push the differences up to racks, tiers and the cluster."""
        caps = self.idle if idle else self.cap
        dom_cap, rack_cap, tier_cap = caps[DOMAIN], caps[RACK], caps[TIER]
        dom_rack, rack_tier = snap.dom_rack, snap.rack_tier
        deltas: dict[int, int] = {}
        for d in doms:
            new = self._dom_usable(snap, d, idle=idle)
            delta = new - dom_cap[d]
            r = dom_rack[d]
            if delta:
                dom_cap[d] = new
                deltas[r] = deltas.get(r, 0) + delta
            else:
                deltas.setdefault(r, 0)
        total = 0
        for r, delta in deltas.items():
            if delta:
                rack_cap[r] += delta
                tier_cap[rack_tier[r]] += delta
                total += delta
        caps[CLUSTER][0] += total
        return set(deltas)

    def _refresh_best(self, snap: ClusterSnapshot, racks: Iterable[int]) -> None:
        tiers = set()
        dom_cap = self.cap[DOMAIN]
        best_rack_dom, rack_doms, rack_tier = self.best_dom[RACK], snap.rack_doms, snap.rack_tier
        for r in racks:
            best_rack_dom[r] = max(map(dom_cap.__getitem__, rack_doms[r]), default=0)
            tiers.add(rack_tier[r])
        rack_cap = self.cap[RACK]
        for t in tiers:
            rs = snap.tier_racks[t]
            self.best_dom[TIER][t] = max(map(best_rack_dom.__getitem__, rs), default=0)
            self.best_rack[TIER][t] = max(map(rack_cap.__getitem__, rs), default=0)
        self.best_dom[CLUSTER][0] = max(self.best_dom[TIER], default=0)
        self.best_rack[CLUSTER][0] = max(self.best_rack[TIER], default=0)

    def _refresh_idle_best(self) -> None:
        self.idle_best_dom = max(self.idle[DOMAIN], default=0)
        self.idle_best_rack = max(self.idle[RACK], default=0)
        self.idle_best_tier = max(self.idle[TIER], default=0)


def _device_inventory(view: NodeView) -> tuple[dict[str, int], dict[str, int], dict[str, list[int]]]:
    """A node's healthy devices by type: how many, the smallest memory, and the free (unleased) indices, sorted."""
    healthy: dict[str, int] = {}
    memory: dict[str, int] = {}
    free: dict[str, list[int]] = {}
    for d in view.devices:
        if not d.healthy:
            continue
        healthy[d.type] = healthy.get(d.type, 0) + 1
        memory[d.type] = min(memory.get(d.type, d.memory_bytes), d.memory_bytes)
        if d.index not in view.leased:
            free.setdefault(d.type, []).append(d.index)
    for indices in free.values():
        indices.sort()
    return healthy, memory, free


class ClusterSnapshot:
    """Available nodes and their free devices, indexed by topology (mutable; see module docstring)."""

    def __init__(self, nodes: Iterable[NodeView] = ()) -> None:
        views = sorted(nodes, key=lambda n: n.node_id)
        self._views: list[NodeView] = views
        self.pos: dict[str, int] = {v.node_id: i for i, v in enumerate(views)}
        # 1. topology: network tiers > racks > NVLink domains > nodes, each numbered as first met in node order
        self.tier_names: list[str] = []
        self.rack_names: list[str] = []
        self.dom_names: list[str] = []
        self.rack_tier: list[int] = []
        self.dom_rack: list[int] = []
        self.node_dom: list[int] = []
        self.tier_racks: list[list[int]] = []
        self.rack_doms: list[list[int]] = []
        self.dom_nodes: list[list[int]] = []
        self._index_topology(views)
        # 2. per node: availability, penalty, healthy devices and their memory by type, free device indices
        self.available: list[bool] = [True] * len(views)
        self.penalty: list[float] = [v.penalty for v in views]
        self.dom_penalty: list[float] = [max((self.penalty[n] for n in ns), default=0.0) for ns in self.dom_nodes]
        self.healthy: list[dict[str, int]] = []
        self.memory: list[dict[str, int]] = []
        self.free: list[dict[str, list[int]]] = []
        for v in views:
            healthy, memory, free = _device_inventory(v)
            self.healthy.append(healthy)
            self.memory.append(memory)
            self.free.append(free)
        # 3. caches, rebuilt lazily
        self._aggs: dict[tuple[str, int, int], Aggregates] = {}
        # the placement algorithm's memos of this snapshot's refusals (placement.impossible, placement._short)
        self.impossible_cache: dict[tuple[object, ...], Unschedulable | None] = {}
        self.shortfall_cache: dict[tuple[object, ...], Unschedulable] = {}
        self.smallest_memory: dict[str, int] = {}  # device type -> its smallest memory on any node (memory_floor)

    def _index_topology(self, views: Sequence[NodeView]) -> None:
        """Number the tiers, racks and domains of ``views`` and link each level to the next."""
        tiers: dict[str, int] = {}
        racks: dict[tuple[str, str], int] = {}
        domains: dict[tuple[str, str, str], int] = {}
        for i, v in enumerate(views):
            tier_key = v.network_tier or ""
            rack_key = (tier_key, v.rack or "")
            dom_key = (*rack_key, v.nvlink_domain or f"node:{v.node_id}")
            if tier_key not in tiers:
                tiers[tier_key] = len(self.tier_names)
                self.tier_names.append(tier_key)
                self.tier_racks.append([])
            if rack_key not in racks:
                racks[rack_key] = len(self.rack_names)
                self.rack_names.append(rack_key[1])
                self.rack_tier.append(tiers[tier_key])
                self.tier_racks[tiers[tier_key]].append(racks[rack_key])
                self.rack_doms.append([])
            if dom_key not in domains:
                domains[dom_key] = len(self.dom_names)
                self.dom_names.append(dom_key[2])
                self.dom_rack.append(racks[rack_key])
                self.rack_doms[racks[rack_key]].append(domains[dom_key])
                self.dom_nodes.append([])
            self.node_dom.append(domains[dom_key])
            self.dom_nodes[domains[dom_key]].append(i)

    # -- construction ------------------------------------------------------------
    @classmethod
    def build(cls, records: Iterable[NodeRecord], leased: Mapping[str, Iterable[int]],
              *, penalties: Mapping[str, float] | None = None) -> ClusterSnapshot:
        """From node records and ``{node_id: leased device indices}`` (and optional node penalties)."""
        penalties = penalties or {}
        return cls(NodeView.from_record(r, leased.get(r.node_id, ()), penalty=penalties.get(r.node_id, 0.0))
                   for r in records)

    def copy(self) -> ClusterSnapshot:
        """An independent copy (aggregates are rebuilt lazily)."""
        other = ClusterSnapshot.__new__(ClusterSnapshot)
        other.__dict__.update(self.__dict__)
        other.available = list(self.available)
        other.free = [{k: list(v) for k, v in f.items()} for f in self.free]
        other._aggs = {}
        other.impossible_cache = {}
        other.shortfall_cache = {}
        return other

    def with_leased(self, placement: Placement) -> ClusterSnapshot:
        """A copy after ``placement`` took its devices."""
        other = self.copy()
        other.take(placement)
        return other

    # -- queries ------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[NodeView, ...]:
        return tuple(self._views)

    def node_count(self) -> int:
        return len(self._views)

    def device_types(self) -> list[str]:
        return sorted({k for i, h in enumerate(self.healthy) if self.available[i] for k in h})

    def capacity(self, kind: str) -> int:
        """Healthy devices of ``kind`` on available nodes."""
        return sum(h.get(kind, 0) for i, h in enumerate(self.healthy) if self.available[i])

    def free_count(self, kind: str, tp: int = 1) -> int:
        """Free devices of ``kind`` usable in whole TP groups of ``tp``."""
        return self.aggregates(kind, tp).cap[CLUSTER][0]

    def free_devices(self, kind: str) -> int:
        return self.free_count(kind, 1)

    def node_id(self, n: int) -> str:
        return self._views[n].node_id

    def view(self, n: int) -> NodeView:
        return self._views[n]

    def unit_of(self, n: int, level: int) -> int:
        """The index of node ``n``'s ancestor at ``level``."""
        if level == NODE:
            return n
        d = self.node_dom[n]
        if level == DOMAIN:
            return d
        r = self.dom_rack[d]
        if level == RACK:
            return r
        return self.rack_tier[r] if level == TIER else 0

    def children(self, level: int, i: int) -> list[int]:
        if level == CLUSTER:
            return list(range(len(self.tier_names)))
        if level == TIER:
            return self.tier_racks[i]
        if level == RACK:
            return self.rack_doms[i]
        return self.dom_nodes[i]

    def fragmentation(self, kind: str, whole: int | None = None) -> float:
        """Share of the free ``kind`` devices that sit on partly used nodes (0 = none stranded)."""
        free = stranded = 0
        for n, f in enumerate(self.free):
            if not self.available[n]:
                continue
            k = len(f.get(kind, ()))
            h = self.healthy[n].get(kind, 0)
            free += k
            if 0 < k < (whole or h):
                stranded += k
        return stranded / free if free else 0.0

    # -- mutation -----------------------------------------------------------------
    def take(self, placement: Placement) -> None:
        """Mark the placement's devices leased."""
        self._change(self._pieces_of(placement), take=True)

    def give(self, placement: Placement) -> None:
        """Mark the placement's devices free again (the allocation ended)."""
        self._change(self._pieces_of(placement), take=False)

    def take_devices(self, kind: str, devices: Iterable[Device]) -> None:
        self._change(self._group(kind, devices), take=True)

    def give_devices(self, kind: str, devices: Iterable[Device]) -> None:
        self._change(self._group(kind, devices), take=False)

    def set_available(self, node_id: str, available: bool) -> None:
        """A node stops (or resumes) heart-beating: its devices leave (or rejoin) every capacity."""
        n = self.pos[node_id]
        if self.available[n] == available:
            return
        self.available[n] = available
        self.impossible_cache.clear()
        for agg in self._aggs.values():
            agg.refresh_nodes(self, [n], idle=True)

    def _pieces_of(self, placement: Placement) -> list[tuple[int, str, list[int]]]:
        kind = placement.gpu_type or self._kind_at(placement)
        return [(self.pos[s.node_id], kind, list(s.device_indices)) for s in placement.nodes]

    def _kind_at(self, placement: Placement) -> str:
        share = placement.nodes[0]
        view = self._views[self.pos[share.node_id]]
        index = share.device_indices[0]
        return next(d.type for d in view.devices if d.index == index)

    def _group(self, kind: str, devices: Iterable[Device]) -> list[tuple[int, str, list[int]]]:
        grouped: dict[int, list[int]] = {}
        for d in devices:
            n = self.pos.get(d.node_id)
            if n is not None:
                grouped.setdefault(n, []).append(int(d.index))
        return [(n, kind, idx) for n, idx in grouped.items()]

    def _change(self, pieces: Sequence[tuple[int, str, list[int]]], *, take: bool) -> None:
        touched: dict[str, dict[int, int]] = {}  # kind → {node: its free devices of the kind}
        for n, kind, indices in pieces:
            free = self.free[n].get(kind)
            if free is None:
                free = self.free[n][kind] = []
            if take:
                if len(indices) >= len(free) and set(indices) >= set(free):
                    free.clear()
                else:
                    gone = set(indices)
                    free[:] = [i for i in free if i not in gone]
            elif free:
                free[:] = sorted(set(free).union(indices))
            else:
                free.extend(sorted(indices))
            touched.setdefault(kind, {})[n] = len(free)
        for (kind, _, _), agg in self._aggs.items():
            if kind in touched:
                agg.refresh_counts(self, touched[kind])

    # -- aggregates ---------------------------------------------------------------
    def aggregates(self, kind: str, tp: int, floor: int = 0) -> Aggregates:
        """The capacity index of ``kind`` in whole TP groups of ``tp`` on nodes whose devices have at least
        ``floor`` bytes (0: every node), built on first use and kept current by take / give."""
        key = (kind, tp, floor)
        agg = self._aggs.get(key)
        if agg is None:
            agg = self._aggs[key] = Aggregates.build(self, kind, tp, floor)
        return agg

    def aggregates_for(self, request: GangRequest) -> Aggregates:
        """:meth:`aggregates` for a gang's device type, TP size and memory floor."""
        return self.aggregates(request.gpu_type, request.tensor, memory_floor(self, request))

    def best_under(self, agg: Aggregates, level: int, i: int, target: int) -> int:
        """The largest single ``target``-level unit capacity inside unit ``i`` of ``level``."""
        if level == target:
            return agg.cap[level][i]
        if target == DOMAIN:
            return agg.best_dom[level][i]
        if target == RACK:
            return agg.best_rack[level][i]
        return max(agg.cap[TIER]) if target == TIER and agg.cap[TIER] else agg.cap[CLUSTER][0]


def memory_floor(snapshot: ClusterSnapshot, request: GangRequest) -> int:
    """The memory floor as an aggregate key: 0 when every device of the type is big enough."""
    need = request.min_memory_bytes
    if not need:
        return 0
    smallest = snapshot.smallest_memory.get(request.gpu_type)
    if smallest is None:  # once per type and snapshot, not per gang: O(nodes) each (a pass asks per queued job)
        smallest = snapshot.smallest_memory[request.gpu_type] = min(
            (m[request.gpu_type] for m in snapshot.memory if request.gpu_type in m), default=0)
    return 0 if smallest >= need else need
