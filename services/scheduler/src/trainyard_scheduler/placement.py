"""Gang placement: pure, whole gang or nothing.

Rules, in order of importance:

1. every rank gets a healthy, unleased device of ``resources.gpuType`` on an available node;
2. a tensor-parallel group never crosses a node: each node's share of ranks is a multiple of
   ``parallelism.tensor``, and ranks are consecutive per node (rank r and r+1 of one TP group
   sit side by side);
3. best fit: the fewest nodes; among equals, nodes already partly used are preferred so that
   idle nodes stay whole for the next big gang (less fragmentation).

Rank 0's host is the rendezvous address. No I/O here: the scheduler's shell builds the
:class:`ClusterSnapshot` from Redis and applies the :class:`Placement`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from trainyard_common.events import DeviceInfo, NodeAssignment, RankAssignment
from trainyard_common.leases import Device
from trainyard_common.records import NodeRecord
from trainyard_common.spec import TrainingSpec


@dataclass(frozen=True)
class NodeView:
    """One available node as the planner sees it: its devices and which of them are leased."""

    node_id: str
    host: str
    devices: tuple[DeviceInfo, ...]
    leased: frozenset[int] = frozenset()
    rack: str | None = None
    nvlink_domain: str | None = None

    @classmethod
    def from_record(cls, record: NodeRecord, leased: Iterable[int] = ()) -> NodeView:
        return cls(
            node_id=record.node_id,
            host=record.host,
            devices=tuple(record.devices),
            leased=frozenset(leased),
            rack=record.rack,
            nvlink_domain=record.nvlink_domain,
        )

    def healthy(self, gpu_type: str) -> tuple[int, ...]:
        """Indices of the healthy devices of ``gpu_type``, ascending."""
        return tuple(sorted(d.index for d in self.devices if d.type == gpu_type and d.healthy))

    def free(self, gpu_type: str) -> tuple[int, ...]:
        """Healthy devices of ``gpu_type`` that no live allocation holds, ascending."""
        return tuple(i for i in self.healthy(gpu_type) if i not in self.leased)

    def partly_used(self, gpu_type: str) -> bool:
        return any(i in self.leased for i in self.healthy(gpu_type))


@dataclass(frozen=True)
class ClusterSnapshot:
    """Available nodes at one instant (unavailable nodes are simply absent)."""

    nodes: tuple[NodeView, ...] = ()

    @classmethod
    def build(cls, records: Iterable[NodeRecord], leased: Mapping[str, Iterable[int]]) -> ClusterSnapshot:
        """From node records and ``{node_id: leased device indices}``."""
        views = (NodeView.from_record(r, leased.get(r.node_id, ())) for r in records)
        return cls(tuple(sorted(views, key=lambda n: n.node_id)))

    def with_leased(self, placement: Placement) -> ClusterSnapshot:
        """The snapshot after ``placement`` took its devices (for planning several gangs in one pass)."""
        taken: dict[str, set[int]] = {}
        for share in placement.nodes:
            taken.setdefault(share.node_id, set()).update(r.device_index for r in share.ranks)
        return ClusterSnapshot(
            tuple(replace(n, leased=n.leased | taken.get(n.node_id, set())) for n in self.nodes)
        )

    def device_types(self) -> list[str]:
        return sorted({d.type for n in self.nodes for d in n.devices if d.healthy})


@dataclass(frozen=True)
class GangRequest:
    """What a gang needs: ``gpu_count`` devices of ``gpu_type`` in whole TP groups of ``tensor``."""

    gpu_type: str
    gpu_count: int
    tensor: int = 1

    @classmethod
    def from_spec(cls, spec: TrainingSpec) -> GangRequest:
        return cls(spec.resources.gpu_type, spec.resources.gpu_count, spec.parallelism.tensor)


@dataclass(frozen=True)
class RankSlot:
    rank: int
    local_rank: int
    device_index: int


@dataclass(frozen=True)
class NodeShare:
    node_id: str
    host: str
    ranks: tuple[RankSlot, ...]


@dataclass(frozen=True)
class Placement:
    """Where every rank of a gang runs. ``score`` in (0, 1]: 1 = every chosen node fully used."""

    nodes: tuple[NodeShare, ...]
    score: float = 1.0

    @property
    def master_addr(self) -> str:
        return self.nodes[0].host

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    def devices(self) -> list[Device]:
        return [Device(n.node_id, r.device_index) for n in self.nodes for r in n.ranks]

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
    """Why a gang cannot be placed. ``fits_when_idle``: it would fit once running jobs finish."""

    reason: str
    fits_when_idle: bool = field(default=True)


def place(snapshot: ClusterSnapshot, request: GangRequest) -> Placement | Unschedulable:
    """Place the whole gang or explain why not (see the module docstring for the rules)."""
    if problem := _impossible(snapshot, request):
        return Unschedulable(problem, fits_when_idle=False)
    tp, need, kind = request.tensor, request.gpu_count, request.gpu_type
    usable = {n.node_id: len(n.free(kind)) // tp * tp for n in snapshot.nodes}
    candidates = [n for n in snapshot.nodes if usable[n.node_id] > 0]
    free_total = sum(len(n.free(kind)) for n in snapshot.nodes)
    if sum(usable[n.node_id] for n in candidates) < need:
        if free_total < need:
            return Unschedulable(f"waiting for {need} free {kind} devices ({free_total} free)")
        return Unschedulable(
            f"waiting for {need} free {kind} devices in whole tensor-parallel groups of {tp} per node "
            f"({free_total} free, but fragmented across nodes)"
        )
    chosen = _choose_nodes(candidates, usable, need, kind)
    return _assign(chosen, need, kind)


def _impossible(snapshot: ClusterSnapshot, request: GangRequest) -> str | None:
    """A reason the gang can never fit this cluster, even idle; None if it could."""
    kind, need, tp = request.gpu_type, request.gpu_count, request.tensor
    holders = [n for n in snapshot.nodes if n.healthy(kind)]
    healthy = sum(len(n.healthy(kind)) for n in holders)
    if healthy == 0:
        types = ", ".join(snapshot.device_types()) or "none"
        return (f"needs {need} {kind} devices; the cluster has no healthy {kind} devices "
                f"({len(snapshot.nodes)} available nodes; device types: {types})")
    if healthy < need:
        return (f"needs {need} {kind} devices; the cluster has {healthy} healthy {kind} devices "
                f"on {len(holders)} node{'s' if len(holders) != 1 else ''}")
    if need % tp:
        return f"needs {need} devices, which is not a multiple of the tensor-parallel size {tp}"
    largest = max(len(n.healthy(kind)) for n in holders)
    if tp > largest:
        return (f"a tensor-parallel group of {tp} must stay inside one node; the largest {kind} node "
                f"has {largest} healthy devices")
    whole_groups = sum(len(n.healthy(kind)) // tp * tp for n in holders)
    if whole_groups < need:
        return (f"needs {need} {kind} devices in whole tensor-parallel groups of {tp} per node; "
                f"the cluster offers {whole_groups} that way")
    return None


def _choose_nodes(
    candidates: list[NodeView], usable: Mapping[str, int], need: int, kind: str
) -> list[tuple[NodeView, int]]:
    """Fewest nodes: take the roomiest nodes whole, then the tightest node that fits the rest."""

    def tight(n: NodeView) -> tuple[int, int, str]:
        return (usable[n.node_id], 0 if n.partly_used(kind) else 1, n.node_id)

    def roomy(n: NodeView) -> tuple[int, int, str]:
        return (-usable[n.node_id], 0 if n.partly_used(kind) else 1, n.node_id)

    chosen: list[tuple[NodeView, int]] = []
    remaining = need
    pool = sorted(candidates, key=roomy)
    while remaining > 0:
        fitting = [n for n in pool if usable[n.node_id] >= remaining]
        if fitting:
            node = min(fitting, key=tight)
            chosen.append((node, remaining))
            return chosen
        node = pool.pop(0)
        chosen.append((node, usable[node.node_id]))
        remaining -= usable[node.node_id]
    return chosen


def _assign(chosen: list[tuple[NodeView, int]], need: int, kind: str) -> Placement:
    shares: list[NodeShare] = []
    rank = 0
    capacity = 0
    for node, count in chosen:
        indices = node.free(kind)[:count]
        slots = tuple(RankSlot(rank + i, i, idx) for i, idx in enumerate(indices))
        shares.append(NodeShare(node.node_id, node.host, slots))
        rank += count
        capacity += len(node.healthy(kind))
    used_before = sum(len(n.healthy(kind)) - len(n.free(kind)) for n, _ in chosen)
    return Placement(tuple(shares), score=round((need + used_before) / capacity, 4))
