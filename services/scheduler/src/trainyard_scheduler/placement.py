"""Gang placement over a topology index: pure, whole gang or nothing.

The cluster is a tree: cluster → network tier (pod / spine block) → rack → NVLink domain (one
node, or a block of nodes such as an NVL72) → node → device. A node that reports no rack or
tier sits in the anonymous rack / tier; a node that reports no NVLink domain is its own domain.

Rules, in order of importance:

1. every rank gets a healthy, unleased device of ``gpu_type`` (with at least ``min_memory_bytes``)
   on an available node — all ranks or none;
2. a tensor-parallel group never leaves one NVLink domain. When ``tensor`` fits in a node, each
   node's share is a multiple of it (the trainer needs ``LOCAL_WORLD_SIZE % tensor == 0``); a
   larger group may span the nodes of one multi-node domain;
3. locality: the gang goes into the smallest unit that holds it — one domain, else one rack,
   else one tier, else the cluster — and, among the units that do, into the *fullest* one (best
   fit), so that empty racks stay empty for the next big gang;
4. inside the chosen unit, the fewest children: the roomiest children are taken whole and the
   remainder goes to the tightest child that holds it (recursively), so DP replicas spread only
   as far as needed. Ranks are numbered in that order (tensor fastest, then data, then pipeline,
   as the trainer lays them out), so a TP group, a pipeline stage and adjacent stages sit as
   close together as the free devices allow.

Modes (``resources.topology`` of the spec): ``pack`` (default), ``tier`` / ``rack`` / ``domain``
(the whole gang must fit in one such unit, else it waits), ``spread`` / ``spread:N`` (balance the
gang over as many racks as it has TP groups, or at most N racks: bandwidth traded for a smaller
share of the gang per failure domain).

:class:`ClusterSnapshot` is a mutable index with incremental free-capacity aggregates per
``(device type, TP size)`` at every level, so that deciding that a gang does *not* fit is O(1)
and placing one costs O(children visited), not O(nodes). ``place`` never mutates it; callers
``take`` / ``give`` placements. No I/O here.
"""

from __future__ import annotations

import re

import math
from functools import cached_property
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import eq, ne
from typing import NamedTuple

from trainyard_contract.devices import Device
from trainyard_contract.events import DeviceInfo, NodeAssignment, PlacementDetail, RankAssignment
from trainyard_contract.records import NodeRecord
from trainyard_contract.spec import TrainingSpec

CLUSTER, TIER, RACK, DOMAIN, NODE = 0, 1, 2, 3, 4
LEVEL_NAMES = ("cluster", "network tier", "rack", "NVLink domain", "node")
MODES = ("pack", "tier", "rack", "domain", "spread")
_MODE_LIMIT = {"pack": CLUSTER, "tier": TIER, "rack": RACK, "domain": DOMAIN}
# Link weights by the widest boundary a link crosses: NVLink, rack switch, tier spine, core.
LINK_WEIGHTS = (1.0, 4.0, 8.0, 16.0)


# ----------------------------------------------------------------------------- inputs


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


@dataclass(frozen=True)
class GangRequest:
    """What a gang needs: ``gpu_count`` devices of ``gpu_type`` in whole TP groups of ``tensor``.

    ``mode``: ``pack`` | ``tier`` | ``rack`` | ``domain`` | ``spread`` (``spread`` racks at most,
    0 = as many as useful); anything else is reported as a topology error.
    """

    gpu_type: str
    gpu_count: int
    tensor: int = 1
    pipeline: int = 1
    mode: str = "pack"
    spread: int = 0
    min_memory_bytes: int = 0

    @classmethod
    def from_spec(cls, spec: TrainingSpec, *, min_memory_bytes: int = 0) -> GangRequest:
        mode, spread = parse_topology(spec.resources.topology)
        return cls(spec.resources.gpu_type, spec.resources.gpu_count, spec.parallelism.tensor,
                   spec.parallelism.pipeline, mode, spread, min_memory_bytes)

    @property
    def data(self) -> int:
        return max(1, self.gpu_count // max(1, self.tensor * self.pipeline))


def parse_topology(text: str | None) -> tuple[str, int]:
    """``resources.topology`` → ``(mode, spread)``; an unknown value is kept as the mode (and refused)."""
    value = (text or "pack").strip().lower()
    if value in ("pack", "tier", "rack", "domain", "spread"):
        return value, 0
    if value.startswith("spread:") and value[7:].isdigit() and int(value[7:]) > 0:
        return "spread", int(value[7:])
    if re.fullmatch(r"\d+-(gpu|device)s?-nodes?", value):
        return "pack", 0  # the seed's shape description ("8-gpu-nodes"): whole nodes, packed
    return value, 0


# ----------------------------------------------------------------------------- results


class RankSlot(NamedTuple):
    rank: int
    local_rank: int
    device_index: int


class NodeShare(NamedTuple):
    """One node's part of a gang: consecutive ranks from ``first_rank`` on ``device_indices``."""

    node_id: str
    host: str
    first_rank: int
    device_indices: tuple[int, ...]

    @property
    def ranks(self) -> tuple[RankSlot, ...]:
        return tuple(RankSlot(self.first_rank + j, j, idx) for j, idx in enumerate(self.device_indices))


@dataclass(frozen=True)
class Placement:
    """Where every rank of a gang runs.

    ``score`` in (0, 1]: links inside one NVLink domain / bandwidth-weighted links (weights
    :data:`LINK_WEIGHTS`); 1.0 = the whole gang talks over NVLink. ``detail`` explains it.
    """

    nodes: tuple[NodeShare, ...]
    score: float = 1.0
    detail: PlacementDetail | None = None
    gpu_type: str = ""

    @property
    def master_addr(self) -> str:
        return self.nodes[0].host

    @property
    def world_size(self) -> int:
        return sum(len(n.device_indices) for n in self.nodes)

    def devices(self) -> list[Device]:
        return [Device(n.node_id, i) for n in self.nodes for i in n.device_indices]

    def assignments(self) -> list[NodeAssignment]:
        """As the GangAllocated event carries it."""
        return [
            NodeAssignment(
                node_id=n.node_id,
                host=n.host,
                ranks=[RankAssignment(rank=r.rank, local_rank=r.local_rank, device_index=r.device_index)
                       for r in n.ranks],
            )
            for n in self.nodes
        ]


@dataclass(frozen=True)
class Unschedulable:
    """Why a gang cannot be placed now.

    ``kind``: ``capacity`` (not enough free devices of the type) or ``topology`` (enough devices,
    but not in the shape asked for). ``fits_when_idle`` False: it never fits this cluster as it is.
    """

    reason: str
    fits_when_idle: bool = field(default=True)
    kind: str = "capacity"

    @cached_property
    def message(self) -> str:
        """``"<kind>: <reason>"``, as a queued job shows it."""
        return f"{self.kind}: {self.reason}"


# ----------------------------------------------------------------------------- the index


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
        self._impossible: dict[tuple[object, ...], Unschedulable | None] = {}
        self._short: dict[tuple[object, ...], Unschedulable] = {}

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
        other._impossible = {}
        other._short = {}
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
        self._impossible.clear()
        for agg in self._aggs.values():
            self._refresh_nodes(agg, [n], idle=True)

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
        touched: dict[str, list[int]] = {}
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
                self._refresh_counts(agg, touched[kind])

    def _refresh_counts(self, agg: Aggregates, counts: dict[int, int]) -> None:
        """The fast path of :meth:`_refresh_nodes` for take/give: ``{node: free devices of the kind}``."""
        tp, node_u, eligible, node_dom, dom_rack = agg.tp, agg.node_u, agg.eligible, self.node_dom, self.dom_rack
        solo, dom_cap = agg.solo, agg.cap[DOMAIN]
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
            self._refresh_nodes(agg, shared, idle=False, deltas=deltas)
            return
        self._push_up(agg, deltas)

    # -- aggregates ---------------------------------------------------------------
    def aggregates(self, kind: str, tp: int, floor: int = 0) -> Aggregates:
        """The capacity index of ``kind`` in whole TP groups of ``tp`` on nodes whose devices have at least
        ``floor`` bytes (0: every node), built on first use and kept current by take / give."""
        key = (kind, tp, floor)
        agg = self._aggs.get(key)
        if agg is None:
            agg = self._aggs[key] = self._build_agg(kind, tp, floor)
        return agg

    def aggregates_for(self, request: GangRequest) -> Aggregates:
        """:meth:`aggregates` for a gang's device type, TP size and memory floor."""
        return self.aggregates(request.gpu_type, request.tensor, memory_floor(self, request))

    def _eligible(self, n: int, agg: Aggregates) -> bool:
        return self.available[n] and (not agg.floor or self.memory[n].get(agg.kind, 0) >= agg.floor)

    def _node_usable(self, n: int, agg: Aggregates, *, idle: bool) -> int:
        if not agg.eligible[n]:
            return 0
        count = self.healthy[n].get(agg.kind, 0) if idle else len(self.free[n].get(agg.kind, ()))
        return count // agg.tp * agg.tp

    def _dom_usable(self, d: int, agg: Aggregates, *, idle: bool) -> int:
        nodes = self.dom_nodes[d]
        if not agg.pooled[d]:
            if idle:
                return sum(self._node_usable(n, agg, idle=True) for n in nodes)
            return agg.node_u[nodes[0]] if len(nodes) == 1 else sum(agg.node_u[n] for n in nodes)
        total = 0
        for n in nodes:
            if agg.eligible[n]:
                total += self.healthy[n].get(agg.kind, 0) if idle else len(self.free[n].get(agg.kind, ()))
        return total // agg.tp * agg.tp

    def _build_agg(self, kind: str, tp: int, floor: int) -> Aggregates:
        agg = Aggregates(kind, tp, floor)
        for nodes in self.dom_nodes:
            sizes = [self.healthy[n].get(kind, 0) for n in nodes if self.healthy[n].get(kind, 0)]
            agg.pooled.append(bool(sizes) and tp > min(sizes))
            agg.solo.append(len(nodes) == 1 and not agg.pooled[-1])
        agg.eligible = [self._eligible(n, agg) for n in range(len(self._views))]
        agg.node_u = [self._node_usable(n, agg, idle=False) for n in range(len(self._views))]
        agg.cap = [[0], [0] * len(self.tier_names), [0] * len(self.rack_names), [0] * len(self.dom_names)]
        agg.idle = [[0], [0] * len(self.tier_names), [0] * len(self.rack_names), [0] * len(self.dom_names)]
        agg.best_dom = [[0], [0] * len(self.tier_names), [0] * len(self.rack_names)]
        agg.best_rack = [[0], [0] * len(self.tier_names)]
        self._apply_doms(agg, range(len(self.dom_names)), idle=False)
        self._apply_doms(agg, range(len(self.dom_names)), idle=True)
        self._refresh_best(agg, range(len(self.rack_names)))
        self._refresh_idle_best(agg)
        return agg

    def _refresh_nodes(self, agg: Aggregates, nodes: Iterable[int], *, idle: bool,
                       deltas: dict[int, int] | None = None) -> None:
        """Nodes' free devices changed (or their availability, ``idle``): update the aggregates."""
        kind, tp, free, node_u, eligible = agg.kind, agg.tp, self.free, agg.node_u, agg.eligible
        node_dom, dom_nodes, dom_rack, pooled = self.node_dom, self.dom_nodes, self.dom_rack, agg.pooled
        dom_cap = agg.cap[DOMAIN]
        deltas = {} if deltas is None else deltas
        shared: set[int] = set()
        touched: set[int] = set()
        for n in nodes:
            if idle:
                eligible[n] = self._eligible(n, agg)
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
            new = self._dom_usable(d, agg, idle=False)
            if new != dom_cap[d]:
                r = dom_rack[d]
                deltas[r] = deltas.get(r, 0) + new - dom_cap[d]
                dom_cap[d] = new
        if idle:
            self._apply_doms(agg, touched, idle=True)
            self._refresh_idle_best(agg)
        self._push_up(agg, deltas)

    def _push_up(self, agg: Aggregates, deltas: dict[int, int]) -> None:
        """Add per-rack capacity changes to the racks, tiers and the cluster; refresh the maxima."""
        if not deltas:
            return
        rack_cap, tier_cap, rack_tier = agg.cap[RACK], agg.cap[TIER], self.rack_tier
        total = 0
        for r, delta in deltas.items():
            rack_cap[r] += delta
            tier_cap[rack_tier[r]] += delta
            total += delta
        agg.cap[CLUSTER][0] += total
        self._refresh_best(agg, deltas)

    def _apply_doms(self, agg: Aggregates, doms: Iterable[int], *, idle: bool) -> set[int]:
        """Recompute the domains' capacity and push the differences up to racks, tiers and the cluster."""
        caps = agg.idle if idle else agg.cap
        dom_cap, rack_cap, tier_cap = caps[DOMAIN], caps[RACK], caps[TIER]
        dom_rack, rack_tier = self.dom_rack, self.rack_tier
        deltas: dict[int, int] = {}
        for d in doms:
            new = self._dom_usable(d, agg, idle=idle)
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

    def _refresh_best(self, agg: Aggregates, racks: Iterable[int]) -> None:
        tiers = set()
        dom_cap = agg.cap[DOMAIN]
        best_rack_dom, rack_doms, rack_tier = agg.best_dom[RACK], self.rack_doms, self.rack_tier
        for r in racks:
            best_rack_dom[r] = max(map(dom_cap.__getitem__, rack_doms[r]), default=0)
            tiers.add(rack_tier[r])
        rack_cap = agg.cap[RACK]
        for t in tiers:
            rs = self.tier_racks[t]
            agg.best_dom[TIER][t] = max(map(best_rack_dom.__getitem__, rs), default=0)
            agg.best_rack[TIER][t] = max(map(rack_cap.__getitem__, rs), default=0)
        agg.best_dom[CLUSTER][0] = max(agg.best_dom[TIER], default=0)
        agg.best_rack[CLUSTER][0] = max(agg.best_rack[TIER], default=0)

    def _refresh_idle_best(self, agg: Aggregates) -> None:
        agg.idle_best_dom = max(agg.idle[DOMAIN], default=0)
        agg.idle_best_rack = max(agg.idle[RACK], default=0)
        agg.idle_best_tier = max(agg.idle[TIER], default=0)

    def best_under(self, agg: Aggregates, level: int, i: int, target: int) -> int:
        """The largest single ``target``-level unit capacity inside unit ``i`` of ``level``."""
        if level == target:
            return agg.cap[level][i]
        if target == DOMAIN:
            return agg.best_dom[level][i]
        if target == RACK:
            return agg.best_rack[level][i]
        return max(agg.cap[TIER]) if target == TIER and agg.cap[TIER] else agg.cap[CLUSTER][0]


# ----------------------------------------------------------------------------- placing


def place(snapshot: ClusterSnapshot, request: GangRequest) -> Placement | Unschedulable:
    """Place the whole gang or explain why not (see the module docstring for the rules)."""
    if problem := impossible(snapshot, request):
        return problem
    return place_possible(snapshot, request)


def place_possible(snapshot: ClusterSnapshot, request: GangRequest) -> Placement | Unschedulable:
    """:func:`place` for a request already known not to be :func:`impossible`."""
    tp, need, kind = request.tensor, request.gpu_count, request.gpu_type
    agg = snapshot.aggregates_for(request)
    free = agg.cap[CLUSTER][0]
    if free < need:
        return _short(snapshot, request, agg)
    if request.mode == "spread":
        pieces = _spread(snapshot, agg, need, request.spread)
        if pieces is None:
            return Unschedulable(
                f"waiting for {need} {kind} devices spread over racks in groups of {tp} "
                f"({free} free, but not spreadable that way)", True, "topology")
    else:
        target = smallest_level(snapshot, agg, need)
        limit = _MODE_LIMIT[request.mode]
        if target < limit:
            best = snapshot.best_under(agg, CLUSTER, 0, limit)
            return Unschedulable(
                f"waiting for {need} free {kind} devices inside one {LEVEL_NAMES[limit]} "
                f"(topology {request.mode!r}); the best {LEVEL_NAMES[limit]} has {best} free", True, "topology")
        pieces = []
        fill(snapshot, agg, target, descend(snapshot, agg, target, need), need, pieces)
    return build_placement(snapshot, request, pieces)


def smallest_level(snapshot: ClusterSnapshot, agg: Aggregates, need: int) -> int:
    """The lowest level (domain, rack, tier, else cluster) at which one unit holds ``need`` now."""
    if agg.best_dom[CLUSTER][0] >= need:
        return DOMAIN
    if agg.best_rack[CLUSTER][0] >= need:
        return RACK
    if agg.cap[TIER] and max(agg.cap[TIER]) >= need:
        return TIER
    return CLUSTER


def descend(snapshot: ClusterSnapshot, agg: Aggregates, target: int, need: int) -> int:
    """Best fit: at each level, the fullest child that still holds ``need`` in one ``target`` unit."""
    level, i = CLUSTER, 0
    while level < target:
        child_level = level + 1
        caps = agg.cap[child_level]
        pen = snapshot.dom_penalty if child_level == DOMAIN else None
        best, best_key = -1, None
        for c in snapshot.children(level, i):
            if snapshot.best_under(agg, child_level, c, target) < need:
                continue
            # A gang spanning racks goes to the tier where it needs the fewest racks, then best fit.
            spans = _racks_needed(snapshot, agg, c, need) if target == TIER else 0
            nodes = len(snapshot.dom_nodes[c]) if child_level == DOMAIN else 0  # fewer nodes among equals
            key = (pen[c] if pen else 0.0, spans, caps[c], nodes, c)
            if best_key is None or key < best_key:
                best, best_key = c, key
        level, i = child_level, best
    return i


def _racks_needed(snapshot: ClusterSnapshot, agg: Aggregates, tier: int, need: int) -> int:
    """Racks a gang of ``need`` takes in ``tier`` when the roomiest racks go first."""
    rack_cap = agg.cap[RACK]
    count = 0
    for cap in sorted((rack_cap[r] for r in snapshot.tier_racks[tier]), reverse=True):
        if need <= 0:
            break
        need -= cap
        count += 1
    return count


def fill(snapshot: ClusterSnapshot, agg: Aggregates, level: int, i: int, need: int,
         out: list[tuple[int, int]]) -> None:
    """Append ``(node, count)`` pieces taking ``need`` usable devices from unit ``i`` of ``level``."""
    if level == NODE:
        out.append((i, need))
        return
    if level == DOMAIN and agg.pooled[i]:
        _fill_pooled(snapshot, agg, i, need, out)
        return
    child_level = level + 1
    caps = agg.node_u if child_level == NODE else agg.cap[child_level]
    if need >= agg.cap[level][i]:
        _fill_whole(snapshot, agg, level, i, out)
        return
    children = [c for c in snapshot.children(level, i) if caps[c] > 0]
    pen = snapshot.penalty if child_level == NODE else snapshot.dom_penalty if child_level == DOMAIN else None
    pool = sorted(children, key=lambda c: (pen[c] if pen else 0.0, -caps[c], c))
    remaining = need
    left = list(pool)
    for c in pool:
        fitting = [x for x in left if caps[x] >= remaining]
        if fitting:  # the tightest child that holds the rest
            pick = min(fitting, key=lambda x: (pen[x] if pen else 0.0, caps[x], x))
            fill(snapshot, agg, child_level, pick, remaining, out)
            return
        fill(snapshot, agg, child_level, c, caps[c], out)
        remaining -= caps[c]
        left.remove(c)


def _fill_whole(snapshot: ClusterSnapshot, agg: Aggregates, level: int, i: int, out: list[tuple[int, int]]) -> None:
    """Everything usable in the unit, in topology (index) order."""
    doms: list[int] = [i] if level == DOMAIN else []
    if level < DOMAIN:
        racks = [i] if level == RACK else snapshot.tier_racks[i] if level == TIER else range(len(snapshot.rack_names))
        dom_cap = agg.cap[DOMAIN]
        doms = [d for r in racks for d in snapshot.rack_doms[r] if dom_cap[d]]
    node_u = agg.node_u
    for d in doms:
        if agg.pooled[d]:
            _fill_pooled(snapshot, agg, d, agg.cap[DOMAIN][d], out)
        else:
            out.extend((n, node_u[n]) for n in snapshot.dom_nodes[d] if node_u[n])


def _fill_pooled(snapshot: ClusterSnapshot, agg: Aggregates, d: int, need: int, out: list[tuple[int, int]]) -> None:
    """A domain whose TP groups span nodes: fewest nodes, roomiest first."""
    nodes = [n for n in snapshot.dom_nodes[d] if snapshot._eligible(n, agg)]
    sizes = {n: len(snapshot.free[n].get(agg.kind, ())) for n in nodes}
    remaining = need
    for n in sorted(nodes, key=lambda n: (snapshot.penalty[n], -sizes[n], n)):
        if remaining <= 0:
            break
        take = min(sizes[n], remaining)
        if take:
            out.append((n, take))
            remaining -= take


def _spread(snapshot: ClusterSnapshot, agg: Aggregates, need: int, limit: int) -> list[tuple[int, int]] | None:
    """Balance ``need`` over racks (water-filling in TP groups); None if it cannot be done."""
    tp = agg.tp
    groups = need // tp
    racks = sorted((r for r, c in enumerate(agg.cap[RACK]) if c >= tp), key=lambda r: (-agg.cap[RACK][r], r))
    most = min(limit or groups, groups, len(racks))
    for k in range(max(1, most), len(racks) + 1):
        chosen = sorted(racks[:k], key=lambda r: (agg.cap[RACK][r], r))
        shares: dict[int, int] = {}
        remaining = groups
        for j, r in enumerate(chosen):
            share = min(agg.cap[RACK][r] // tp, math.ceil(remaining / (k - j)))
            shares[r] = share
            remaining -= share
        if remaining == 0:
            pieces: list[tuple[int, int]] = []
            for r in sorted(shares):
                if shares[r]:
                    fill(snapshot, agg, RACK, r, shares[r] * tp, pieces)
            return pieces
        if limit and k >= limit:
            return None
    return None


def build_placement(snapshot: ClusterSnapshot, request: GangRequest, pieces: Sequence[tuple[int, int]]) -> Placement:
    """Number the ranks over the pieces in order; score the result."""
    shares: list[NodeShare] = []
    rank = 0
    kind = request.gpu_type
    for n, count in pieces:
        view = snapshot._views[n]
        shares.append(NodeShare(view.node_id, view.host, rank, tuple(snapshot.free[n][kind][:count])))
        rank += count
    score, detail = describe(snapshot, request, pieces)
    return Placement(tuple(shares), score=score, detail=detail, gpu_type=kind)


def describe(snapshot: ClusterSnapshot, request: GangRequest, pieces: Sequence[tuple[int, int]]
             ) -> tuple[float, PlacementDetail]:
    """Count the gang's links by the widest boundary each crosses; score = links / weighted links.

    Links: TP ring neighbours, DP ring neighbours (same TP index, same pipeline stage) and the
    pairs of adjacent pipeline stages, with ranks numbered tensor-fastest, then data, then pipeline.
    """
    dom, rack, tier = _rank_locations(snapshot, pieces)
    world = len(dom)
    tp = max(1, request.tensor)
    pp = max(1, min(request.pipeline, world // tp or 1))
    stage = max(tp, world // pp)
    counts = _count_links(dom, rack, tier, tp=tp, stage=stage)
    split = sum(map(ne, dom[0::tp], dom[tp - 1::tp])) if tp > 1 else 0
    total = sum(counts)
    weighted = sum(c * w for c, w in zip(counts, LINK_WEIGHTS, strict=True))
    return (round(total / weighted, 4) if weighted else 1.0), _detail(snapshot, request, pieces, counts, split)


def _rank_locations(snapshot: ClusterSnapshot, pieces: Sequence[tuple[int, int]]
                    ) -> tuple[list[int], list[int], list[int]]:
    """Each rank's NVLink domain, rack and network tier, in rank order."""
    dom: list[int] = []
    rack: list[int] = []
    tier: list[int] = []
    node_dom, dom_rack, rack_tier = snapshot.node_dom, snapshot.dom_rack, snapshot.rack_tier
    for n, count in pieces:
        d = node_dom[n]
        r = dom_rack[d]
        dom += [d] * count
        rack += [r] * count
        tier += [rack_tier[r]] * count
    return dom, rack, tier


def _count_links(dom: list[int], rack: list[int], tier: list[int], *, tp: int, stage: int) -> list[int]:
    """The gang's links by the widest boundary each crosses: [in a domain, in a rack, in a tier, across tiers]."""
    world = len(dom)
    counts = [0, 0, 0, 0]

    def links(first: slice, second: slice) -> None:
        """Classify the pairs (first[i], second[i]) at once."""
        total = len(dom[first])
        same_dom = sum(map(eq, dom[first], dom[second]))
        same_rack = sum(map(eq, rack[first], rack[second]))
        same_tier = sum(map(eq, tier[first], tier[second]))
        counts[0] += same_dom
        counts[1] += same_rack - same_dom
        counts[2] += same_tier - same_rack
        counts[3] += total - same_tier

    if tp > 1:  # TP rings
        for j in range(tp - 1):
            links(slice(j, None, tp), slice(j + 1, None, tp))
        if tp > 2:
            links(slice(tp - 1, None, tp), slice(0, None, tp))
    for s in range(0, world, stage):  # DP rings inside each pipeline stage
        size = min(stage, world - s)
        dp = size // tp
        if dp < 2:
            continue
        links(slice(s, s + size - tp), slice(s + tp, s + size))
        if dp > 2:
            links(slice(s + size - tp, s + size), slice(s, s + tp))
    if world > stage:  # adjacent pipeline stages
        links(slice(0, world - stage), slice(stage, world))
    return counts


def _detail(snapshot: ClusterSnapshot, request: GangRequest, pieces: Sequence[tuple[int, int]],
            counts: list[int], split: int) -> PlacementDetail:
    """What the placement spans and crosses, for the job's record."""
    total = sum(counts)
    nodes = {n for n, _ in pieces}
    doms = {snapshot.node_dom[n] for n in nodes}
    racks = {snapshot.dom_rack[d] for d in doms}
    return PlacementDetail(
        mode=request.mode if not request.spread else f"spread:{request.spread}",
        nodes=len(nodes), nvlink_domains=len(doms), racks=len(racks),
        network_tiers=len({snapshot.rack_tier[r] for r in racks}), links=total,
        cross_node_links=total - counts[0], cross_rack_links=counts[2] + counts[3], cross_tier_links=counts[3],
        tp_groups_split=split,
    )


# ----------------------------------------------------------------------------- refusals


def memory_floor(snapshot: ClusterSnapshot, request: GangRequest) -> int:
    """The memory floor as an aggregate key: 0 when every device of the type is big enough."""
    need = request.min_memory_bytes
    if not need:
        return 0
    smallest = min((m[request.gpu_type] for m in snapshot.memory if request.gpu_type in m), default=0)
    return 0 if smallest >= need else need


def impossible(snapshot: ClusterSnapshot, request: GangRequest) -> Unschedulable | None:
    """Why the gang can never fit this cluster even idle (cached per request shape); None if it could."""
    key = (request.gpu_type, request.gpu_count, request.tensor, request.mode, request.spread,
           request.min_memory_bytes)
    if key not in snapshot._impossible:
        snapshot._impossible[key] = _impossible(snapshot, request)
    return snapshot._impossible[key]


def _impossible(snapshot: ClusterSnapshot, request: GangRequest) -> Unschedulable | None:
    kind, need, tp = request.gpu_type, request.gpu_count, request.tensor
    if request.mode not in MODES:
        return Unschedulable(f"unknown resources.topology {request.mode!r}; use pack, tier, rack, domain, "
                             "spread or spread:N", False, "topology")
    if need % tp:
        return Unschedulable(f"needs {need} devices, which is not a multiple of the tensor-parallel size {tp}",
                             False, "topology")
    whole = snapshot.aggregates(kind, 1)
    healthy = whole.idle[CLUSTER][0]
    if healthy < need:
        holders = sum(1 for n in range(snapshot.node_count()) if snapshot.available[n] and snapshot.healthy[n].get(kind))
        if healthy == 0:
            types = ", ".join(snapshot.device_types()) or "none"
            return Unschedulable(f"needs {need} {kind} devices; the cluster has no healthy {kind} devices "
                                 f"({sum(snapshot.available)} available nodes; device types: {types})", False)
        return Unschedulable(f"needs {need} {kind} devices; the cluster has {healthy} healthy {kind} devices "
                             f"on {holders} node{'s' if holders != 1 else ''}", False)
    if request.min_memory_bytes:
        biggest = max((m[kind] for m in snapshot.memory if kind in m), default=0)
        if biggest < request.min_memory_bytes:
            return Unschedulable(
                f"needs {_gib(request.min_memory_bytes)} GiB per device even fully sharded with full "
                f"recomputation; the largest {kind} device has {_gib(biggest)} GiB", False)
    agg = snapshot.aggregates_for(request)
    largest = whole.idle_best_dom
    if tp > largest:
        return Unschedulable(f"a tensor-parallel group of {tp} must stay inside one NVLink domain; the largest "
                             f"{kind} domain has {largest} healthy devices", False, "topology")
    if agg.idle[CLUSTER][0] < need:
        return Unschedulable(
            f"needs {need} {kind} devices in whole tensor-parallel groups of {tp} inside one NVLink domain; "
            f"the cluster offers {agg.idle[CLUSTER][0]} that way", False, "topology")
    limit = _MODE_LIMIT.get(request.mode, CLUSTER)
    best = {DOMAIN: agg.idle_best_dom, RACK: agg.idle_best_rack, TIER: agg.idle_best_tier}.get(limit)
    if best is not None and best < need:
        return Unschedulable(f"needs {need} {kind} devices inside one {LEVEL_NAMES[limit]} (topology "
                             f"{request.mode!r}); the largest has {best}", False, "topology")
    return None


def _short(snapshot: ClusterSnapshot, request: GangRequest, agg: Aggregates) -> Unschedulable:
    kind, need, tp = request.gpu_type, request.gpu_count, request.tensor
    free = snapshot.free_count(kind, 1) if tp > 1 or agg.floor else agg.cap[CLUSTER][0]
    key = (kind, need, tp, agg.floor, agg.cap[CLUSTER][0], free)
    cached = snapshot._short.get(key)
    if cached is None:
        if len(snapshot._short) > 4096:
            snapshot._short.clear()
        cached = snapshot._short[key] = _shortfall(kind, need, tp, free)
    return cached


def _shortfall(kind: str, need: int, tp: int, free: int) -> Unschedulable:
    if free < need or tp == 1:
        return Unschedulable(f"waiting for {need} free {kind} devices ({free} free)")
    return Unschedulable(
        f"waiting for {need} free {kind} devices in whole tensor-parallel groups of {tp} per NVLink domain "
        f"({free} free, but fragmented across nodes)", True, "topology")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"
