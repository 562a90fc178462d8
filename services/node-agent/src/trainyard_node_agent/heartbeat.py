"""The node's presence: its heartbeat (inventory, running allocations, draining, boot id; the scheduler's
view of the node, design.md §5) and, on Kubernetes, its cordon followed as a drain."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from trainyard_contract.events import (
    DeviceInfo,
    NodeDrained,
    NodeHeartbeat,
    NodeUndrained,
)
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import Keys

from trainyard_node_agent import kube
from trainyard_node_agent.lifecycle import Lifecycle
from trainyard_node_agent.rank_table import RankTable
from trainyard_node_agent.settings import NodeAgentSettings

log = logging.getLogger(__name__)


class Heartbeat:
    """Builds and sends this node's NodeHeartbeat (numbered, with this incarnation's boot id)."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, table: RankTable, *,
                 lifecycle: Lifecycle, boot_id: str, warm_interpreters: int) -> None:
        self.runtime, self.settings, self.table, self.lifecycle = runtime, settings, table, lifecycle
        self.boot_id, self.warm_interpreters = boot_id, warm_interpreters
        self._seq = 0

    def event(self) -> NodeHeartbeat:
        s = self.settings
        self._seq += 1
        return NodeHeartbeat(
            node_id=s.node_id, host=s.host, rack=s.rack, nvlink_domain=s.nvlink_domain,
            network_tier=s.network_tier,
            devices=[DeviceInfo(index=i, type=s.device_type, memory_bytes=s.device_memory_bytes)
                     for i in range(s.device_count)],
            running_allocations=self.table.running_allocations(),
            healthy=not self.lifecycle.closing,
            seq=self._seq,
            draining=self.lifecycle.closing,
            boot_id=self.boot_id,
            sandbox=s.node_sandbox,
            warm_interpreters=self.warm_interpreters,
        )

    async def send(self) -> None:
        await self.runtime.bus.publish(self.event())


class CordonFollower:
    """A cordoned (or `kubectl drain`-ed) Kubernetes node is drained; uncordoned, its drain ends."""

    def __init__(self, runtime: ServiceRuntime, node_id: str, watch: kube.KubeNodeWatch) -> None:
        self.runtime, self.node_id, self.kube = runtime, node_id, watch
        self._sent: tuple[kube.Action, float] | None = None

    async def follow(self) -> None:
        cordoned = await self.kube.cordoned()
        raw: Any = await self.runtime.redis.hget(Keys.node_drain, self.node_id)
        action = kube.cordon_action(cordoned, json.loads(raw) if raw else None)
        now = time.monotonic()
        if not kube.due(action, self._sent, now):
            if action is None:
                self._sent = None  # the record agrees with the Node: nothing is pending
            return
        assert action is not None
        self._sent = (action, now)
        if action == "drain":
            log.warning("Kubernetes node %s is cordoned: draining it", self.kube.node_name)
            await self.runtime.bus.publish(NodeDrained(
                node_id=self.node_id, by=kube.KUBERNETES,
                reason=f"Kubernetes node {self.kube.node_name} cordoned (drain)"))
        elif action == "undrain":
            log.warning("Kubernetes node %s is schedulable again: its drain ends", self.kube.node_name)
            await self.runtime.bus.publish(NodeUndrained(
                node_id=self.node_id, by=kube.KUBERNETES, reason=f"Kubernetes node {self.kube.node_name} uncordoned"))

    async def aclose(self) -> None:
        await self.kube.aclose()
