"""A device's identity: the node it is on and its index there (pure; no I/O).

Placement, planning and the scheduler's snapshot reason about devices without Redis; the lease
layer (:mod:`trainyard_runtime.leases`) stores them as ``node:index``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    node_id: str
    index: int

    def __str__(self) -> str:
        return f"{self.node_id}:{self.index}"
