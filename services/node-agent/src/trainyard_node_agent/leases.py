"""Who holds this node's devices right now: the scheduler's device leases, read (never written) by the agent.
Admission fences a launch on them; the lease check stops ranks whose lease is gone (design.md §5)."""

from __future__ import annotations

import json
from typing import Any

from trainyard_runtime.store import Keys


async def lease_holders(redis: Any, node_id: str, indices: list[int]) -> dict[int, dict[str, Any] | None]:
    """Device index → its lease (``{"allocationId": …}``), or None where the device is not leased."""
    keys = [Keys.lease(node_id, i) for i in indices]
    raws = await redis.mget(keys) if keys else []
    return {i: (json.loads(raw) if raw else None) for i, raw in zip(indices, raws, strict=True)}
