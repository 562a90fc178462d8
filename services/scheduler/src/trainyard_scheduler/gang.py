"""What a gang asks for and what it is given: :class:`GangRequest` in, :class:`Placement` or
:class:`Unschedulable` out. Plain data shared by the topology index, the placement algorithm, the planner
and the job transitions (an attempt records its placement).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from trainyard_contract.devices import Device
from trainyard_contract.events import NodeAssignment, PlacementDetail, RankAssignment
from trainyard_contract.spec import TrainingSpec

MODES = ("pack", "tier", "rack", "domain", "spread")


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
    if value in MODES:
        return value, 0
    if value.startswith("spread:") and value[7:].isdigit() and int(value[7:]) > 0:
        return "spread", int(value[7:])
    if re.fullmatch(r"\d+-(gpu|device)s?-nodes?", value):
        return "pack", 0  # the seed's shape description ("8-gpu-nodes"): whole nodes, packed
    return value, 0


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
