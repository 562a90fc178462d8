"""Admin routes' shell: node inventory with quarantine, drain and reputation; reinstating, draining
and undraining a node.

Inventory is the scheduler's (``Keys.nodes``); quarantine, drain and reputation are the scheduler's
hashes ``Keys.node_quarantine``, ``Keys.node_drain`` and ``Keys.node_reputation`` (JSON per node), any
of which may be absent. Reinstating publishes NodeReinstated, draining NodeDrained and undraining
NodeUndrained via the outbox; the scheduler applies them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from trainyard_contract.errors import NotFoundError
from trainyard_contract.events import NodeDrained, NodeReinstated, NodeUndrained
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import NodeRecord, TenantToken
from trainyard_runtime.store import Keys, StateStore

from trainyard_api.schemas import DrainResponse, NodeDrainView, NodeQuarantineView, NodeView, ReinstateResponse

log = logging.getLogger(__name__)


def _json(raw: str | None, what: str) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        log.warning("unreadable %s in Redis; not shown", what)
        return None
    return value if isinstance(value, dict) else None


def node_view(node: NodeRecord, quarantine: Mapping[str, Any] | None, reputation: Mapping[str, Any] | None,
              drain: Mapping[str, Any] | None = None) -> NodeView:
    """A node as admins see it; a node is quarantined (drained) by the scheduler's hash or its own record."""
    q = NodeQuarantineView.model_validate(quarantine) if quarantine else (
        NodeQuarantineView(reason=node.quarantined) if node.quarantined else None)
    d = NodeDrainView.model_validate({k: drain.get(k) for k in ("reason", "by", "at")}) if drain else (
        NodeDrainView(reason=node.drained) if node.drained else None)
    return NodeView(
        node_id=node.node_id, host=node.host, rack=node.rack, nvlink_domain=node.nvlink_domain,
        network_tier=node.network_tier, devices=node.devices, healthy=node.healthy, last_seen=node.last_seen,
        quarantined=q is not None, quarantine=q, drained=d is not None, drain=d,
        reputation_score=reputation.get("score") if reputation else None,
        reputation_at=reputation.get("at") if reputation else None, sandbox=node.sandbox,
    )


class AdminService:
    def __init__(self, store: StateStore, outbox: Outbox) -> None:
        self.store = store
        self.redis = store.redis
        self.outbox = outbox

    async def nodes(self) -> list[NodeView]:
        nodes = sorted(await self.store.list_nodes(), key=lambda n: n.node_id)
        quarantine: dict[str, str] = await self.redis.hgetall(Keys.node_quarantine)  # type: ignore[assignment]  # decoded
        reputation: dict[str, str] = await self.redis.hgetall(Keys.node_reputation)  # type: ignore[assignment]  # decoded
        drains: dict[str, str] = await self.redis.hgetall(Keys.node_drain)  # type: ignore[assignment]  # decoded
        return [node_view(n, _json(quarantine.get(n.node_id), f"quarantine of {n.node_id}"),
                          _json(reputation.get(n.node_id), f"reputation of {n.node_id}"),
                          _json(drains.get(n.node_id), f"drain of {n.node_id}")) for n in nodes]

    async def reinstate(self, token: TenantToken, node_id: str, reason: str | None = None) -> ReinstateResponse:
        """Publish NodeReinstated(by=<the admin token's name>); 404 for a node never seen."""
        known = await self.redis.hexists(Keys.nodes, node_id) or await self.redis.hexists(Keys.node_quarantine,
                                                                                           node_id)
        if not known:
            raise NotFoundError(f"no node {node_id!r} in the inventory")
        event = NodeReinstated(node_id=node_id, reason=reason or f"reinstated by admin {token.name}", by=token.name)
        await self.outbox.put(event)
        return ReinstateResponse(node_id=node_id, by=token.name)

    async def drain(self, token: TenantToken, node_id: str, reason: str | None = None) -> DrainResponse:
        """Publish NodeDrained(by=<the admin token's name>); 404 for a node not in the inventory."""
        await self._known(node_id)
        await self.outbox.put(NodeDrained(node_id=node_id, reason=reason or f"drained by admin {token.name}",
                                          by=token.name))
        return DrainResponse(node_id=node_id, by=token.name)

    async def undrain(self, token: TenantToken, node_id: str, reason: str | None = None) -> DrainResponse:
        """Publish NodeUndrained(by=<the admin token's name>); 404 for a node not in the inventory."""
        await self._known(node_id)
        await self.outbox.put(NodeUndrained(node_id=node_id, reason=reason or f"undrained by admin {token.name}",
                                            by=token.name))
        return DrainResponse(node_id=node_id, by=token.name)

    async def _known(self, node_id: str) -> None:
        if not (await self.redis.hexists(Keys.nodes, node_id) or await self.redis.hexists(Keys.node_drain, node_id)):
            raise NotFoundError(f"no node {node_id!r} in the inventory")
