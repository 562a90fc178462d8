"""``python -m trainyard_node_agent`` / ``trainyard-node-agent``: run one node agent until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Mapping

from redis.exceptions import RedisError

from trainyard_runtime.bus import KafkaAuth, ensure_topics
from trainyard_runtime.retry import Backoff, RetryPolicy
from trainyard_contract.errors import TrainyardError
from trainyard_runtime.service import ServiceRuntime, serve_until_signalled, service_main

from trainyard_node_agent.agent import NodeAgent
from trainyard_node_agent.network import ipv4_interfaces, rendezvous_env
from trainyard_node_agent.settings import NodeAgentSettings

log = logging.getLogger("trainyard_node_agent")

SUMMARY = (
    "trainyard node agent: reports this node's devices (NodeHeartbeat), launches one process per "
    "local rank of each GangAllocated naming this node (refusing stale epochs), captures rank logs, "
    "relays rank events, reports WorkerStarted / WorkerExited (with a classified reason), kills ranks on "
    "AllocationRevoked, on a lost device lease, and all ranks of an attempt that stops making progress "
    "(hang). A restarted agent adopts the ranks that still run instead of killing them. "
    "On SIGTERM it drains first: it heartbeats 'draining' (nothing new is placed here) and asks its ranks to "
    "checkpoint at an agreed step and stop (up to TRAINYARD_DRAIN_TIMEOUT_S), then stops what still runs "
    "(SIGTERM, SIGKILL after the grace) and exits; the interrupted jobs resume from that checkpoint."
)


async def serve(settings: NodeAgentSettings, base_env: Mapping[str, str]) -> None:
    """Run one node agent until SIGTERM/SIGINT, then stop its ranks and close."""
    runtime = ServiceRuntime("node-agent", settings, outbox_name=f"node-agent:{settings.node_id}")
    # ranks bind gloo to the interface of the address peers reach this node at, not the hostname's
    base_env = rendezvous_env(base_env, settings.host, ipv4_interfaces(), extra=settings.rank_env)
    agent = NodeAgent(runtime, settings, base_env=base_env)
    agent.sandbox.check()  # ConfigError (exit 2, loudly) when TRAINYARD_NODE_SANDBOX=enforce cannot be had here
    agent.install()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    await serve_until_signalled(NodeAgentProcess(runtime, settings, agent, stop), "node agent", stop)


class NodeAgentProcess:
    """The node agent's process as a :class:`~trainyard_runtime.service.Lifecycle`. start: adopt what an earlier
    agent left running, wait for Redis and the broker (returning quietly when stopped meanwhile), start the
    runtime, then the agent. aclose: the agent (its ranks), then the runtime, bounded."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, agent: NodeAgent,
                 stop: asyncio.Event) -> None:
        self.runtime, self.settings, self.agent, self.stop = runtime, settings, agent, stop
        self._closed = False

    async def start(self) -> None:
        await self.agent.prepare()
        if not await wait_for_dependencies(self.runtime, self.settings, self.stop):
            return  # stopped before they came: nothing more to start, aclose follows
        await self.runtime.start()
        await self.agent.start()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.agent.aclose()
        log.info("closing the broker and Redis connections")
        await close_runtime(self.runtime)
        log.info("closed")


async def close_runtime(runtime: ServiceRuntime, timeout_s: float = 20.0) -> None:
    """``runtime.aclose()``, bounded: on Python 3.11 ``asyncio.wait_for`` can swallow a cancellation
    that races its wake-up (CPython gh-86296), which leaves the outbox relay running and aclose waiting
    for it forever; cancelling what is left once more ends it."""
    closing = asyncio.ensure_future(runtime.aclose())
    done, _ = await asyncio.wait({closing}, timeout=timeout_s)
    if done:
        closing.result()
        return
    stuck = [t for t in asyncio.all_tasks() if t is not closing and t is not asyncio.current_task()]
    log.error("closing took over %.0fs; cancelling %d task(s) again", timeout_s, len(stuck))
    for task in stuck:
        task.cancel()
    await asyncio.wait({closing}, timeout=10.0)


def dump_tasks() -> None:
    """SIGUSR1: log where every asyncio task of the agent is waiting (for a stuck agent)."""
    import io

    for task in asyncio.all_tasks():
        out = io.StringIO()
        task.print_stack(limit=8, file=out)
        log.warning("task %s:\n%s", task.get_name(), out.getvalue())


async def wait_for_dependencies(runtime: ServiceRuntime, settings: NodeAgentSettings, stop: asyncio.Event) -> bool:
    """Wait until Redis and the broker answer (ranks adopted meanwhile keep running); False if stopped."""
    backoff = Backoff(RetryPolicy(initial_interval_s=0.5, maximum_interval_s=5.0))
    while not stop.is_set():
        try:
            await asyncio.wait_for(runtime.redis.ping(), 5.0)
            await ensure_topics(settings.kafka_bootstrap, partitions=settings.topic_partitions,
                                replication=settings.topic_replication, namespace=settings.topic_namespace,
                                timeout_s=10.0, auth=KafkaAuth.from_settings(settings))
            return True
        except (RedisError, OSError, asyncio.TimeoutError, TrainyardError) as exc:
            delay = backoff.failed()
            log.warning("waiting for Redis and the broker: %r; retry in %.1fs", exc, delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            pass
    return False


def main(argv: list[str] | None = None) -> None:
    base_env = dict(os.environ)  # the ranks inherit it (minus TRAINYARD_*), read here once
    service_main(argv, prog="trainyard-node-agent", description=SUMMARY, settings_cls=NodeAgentSettings,
                 serve=lambda settings: serve(settings, base_env), service="node-agent")


if __name__ == "__main__":
    main()
