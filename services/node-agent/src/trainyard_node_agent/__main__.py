"""``python -m trainyard_node_agent`` / ``trainyard-node-agent``: run one node agent until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Mapping

from trainyard_common.service import ServiceRuntime, service_main

from trainyard_node_agent.agent import NodeAgent
from trainyard_node_agent.settings import NodeAgentSettings

log = logging.getLogger("trainyard_node_agent")

SUMMARY = (
    "trainyard node agent: reports this node's devices (NodeHeartbeat), launches one process per "
    "local rank of each GangAllocated naming this node (refusing stale epochs), captures rank logs, "
    "relays rank events, reports WorkerStarted / WorkerExited, and kills ranks on AllocationRevoked. "
    "On SIGTERM it stops its ranks (SIGTERM, SIGKILL after the grace) and exits."
)


async def serve(settings: NodeAgentSettings, base_env: Mapping[str, str]) -> None:
    """Run one node agent until SIGTERM/SIGINT, then stop its ranks and close."""
    runtime = ServiceRuntime("node-agent", settings, outbox_name=f"node-agent:{settings.node_id}")
    agent = NodeAgent(runtime, settings, base_env=base_env)
    agent.install()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.prepare()
        await runtime.start()
        await agent.start()
        await stop.wait()
    finally:
        await agent.aclose()
        log.info("closing the broker and Redis connections")
        await runtime.aclose()
        log.info("closed")


def main(argv: list[str] | None = None) -> None:
    base_env = dict(os.environ)  # the ranks inherit it (minus TRAINYARD_*), read here once
    service_main(argv, prog="trainyard-node-agent", description=SUMMARY, settings_cls=NodeAgentSettings,
                 serve=lambda settings: serve(settings, base_env), service="node-agent")


if __name__ == "__main__":
    main()
