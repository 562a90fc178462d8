"""What the local stack's Redis says about it, read with the operator's user: which services beacon health
(and whether the API answers), which nodes reported, which attempts are live, which node agents are stopping
(draining). Each read opens
and closes its own client: the stack's commands are synchronous and short."""

from __future__ import annotations

import json
from collections.abc import Sequence

import httpx

from trainyard_contract.records import NodeRecord
from trainyard_runtime.store import Keys, StateStore, connect_redis

__all__ = ["StackState"]


class StackState:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    async def nodes(self) -> list[NodeRecord]:
        redis = connect_redis(self.redis_url)
        try:
            return await StateStore(redis).list_nodes()
        finally:
            await redis.aclose()

    async def missing(self, services: Sequence[str], *, nodes: int) -> list[str]:
        """Of ``services`` (and ``nodes`` node agents), those without a health beacon; a short node inventory."""
        missing: list[str] = []
        redis = connect_redis(self.redis_url)
        try:
            for service in (*services, "node-agent"):
                keys = [k async for k in redis.scan_iter(match=Keys.health(service, "*"), count=100)]
                need = nodes if service == "node-agent" else 1
                if len(keys) < need:
                    missing.append(f"{service} ({len(keys)}/{need})")
            recorded = await StateStore(redis).list_nodes()
            if len(recorded) < nodes:
                missing.append(f"node inventory ({len(recorded)}/{nodes} nodes)")
        finally:
            await redis.aclose()
        return missing

    async def not_ready(self, services: Sequence[str], *, nodes: int, api_url: str) -> list[str]:
        """:meth:`missing`, and the API when its ``/healthz`` does not answer 200."""
        missing = await self.missing(services, nodes=nodes)
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                resp = await client.get(f"{api_url}/healthz")
                if resp.status_code != 200:
                    missing.append(f"api /healthz ({resp.status_code})")
        except httpx.HTTPError:
            missing.append("api /healthz (no answer)")
        return missing

    async def live_attempts(self) -> list[str]:
        """Jobs whose current attempt is live (starting or running)."""
        redis = connect_redis(self.redis_url)
        try:
            store = StateStore(redis)
            ids: list[str] = await redis.zrange(Keys.jobs, 0, -1)  # type: ignore[assignment]  # decoded: str
            jobs = await store.get_jobs(list(ids)) if ids else []
            return [j.job_id for j in jobs if j.current is not None and j.current.state in ("starting", "running")
                    and j.state not in ("succeeded", "failed", "cancelled")]
        finally:
            await redis.aclose()

    async def stopping_agents(self, names: set[str]) -> set[str]:
        """Of ``names`` (node-agent-<i>), those whose node's drain was started by the incarnation that sent
        the node's latest heartbeat: that agent is stopping."""
        if not names:
            return set()
        redis = connect_redis(self.redis_url)
        try:
            drains = await redis.hgetall(Keys.node_drain)
            nodes = {n.node_id: n for n in await StateStore(redis).list_nodes()}
        finally:
            await redis.aclose()
        out = set()
        for name in names:
            node_id = "node-" + name.rsplit("-", 1)[1]
            raw, node = drains.get(node_id), nodes.get(node_id)
            entry = json.loads(raw) if raw else None
            if entry and node and entry.get("by") == "node-agent" and entry.get("bootId") == node.boot_id:
                out.add(name)
        return out
