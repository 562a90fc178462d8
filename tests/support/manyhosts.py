"""The local stack spread over simulated hosts (:mod:`tests.support.netns`): the broker, Redis and the
services on this host, listening on its address on the hosts' switch (never on loopback), and one
node agent per simulated host, inside that host's network namespace, advertising the host's address
(``TRAINYARD_HOST``). The ranks an agent launches inherit its namespace.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.support.netns import HostNetwork, SimulatedHost
from trainyard_cli import infra
from trainyard_cli.stack import EMBEDDED_BACKGROUND_FETCH_MAX_WAIT_MS, EMBEDDED_FETCH_MAX_WAIT_MS, LocalStack, \
    StackSettings

#: Settings of every component (each takes its own): fast failure detection, short waits.
MANY_HOSTS_ENV = {
    "TRAINYARD_CONSUMER_FETCH_MAX_WAIT_MS": str(EMBEDDED_FETCH_MAX_WAIT_MS),  # tansu (see LocalStack.service_env)
    "TRAINYARD_CONSUMER_BACKGROUND_FETCH_MAX_WAIT_MS": str(EMBEDDED_BACKGROUND_FETCH_MAX_WAIT_MS),
    "TRAINYARD_TICK_S": "0.5",  # scheduler
    "TRAINYARD_RECONCILE_INTERVAL_S": "1",
    "TRAINYARD_NODE_TIMEOUT_S": "6",
    "TRAINYARD_RETRY_BACKOFF_S": "0.5",
    "TRAINYARD_RETRY_BACKOFF_MAX_S": "2",
    "TRAINYARD_START_TIMEOUT_S": "120",
    "TRAINYARD_HEARTBEAT_S": "1",  # node agents
    "TRAINYARD_KILL_GRACE_S": "2",
    "TRAINYARD_LEASE_CHECK_S": "1",
    "TRAINYARD_WARM_RANKS": "0",  # three agents on a small machine: no torch imported ahead of need
    "TRAINYARD_SWEEP_INTERVAL_S": "2",  # checkpoint coordinator
    "TRAINYARD_SHARD_REPORT_RETRY_MAX_S": "2",
    "TRAINYARD_LOG_LEVEL": "INFO",
}


class ManyHostsStack(LocalStack):
    """A :class:`LocalStack` whose node ``i`` runs in ``net.hosts[i]``; broker and Redis are the caller's."""

    def __init__(self, settings: StackSettings, net: HostNetwork, *, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(settings, extra_env=extra_env)
        self.net = net

    def host_of(self, node_id: str) -> SimulatedHost:
        return self.net.hosts[int(node_id.rsplit("-", 1)[1])]

    def _spawn_service(self, service: str, *, name: str | None = None, node_index: int = 0) -> None:
        if service != "node-agent":
            super()._spawn_service(service, name=name, node_index=node_index)
            return
        host = self.net.hosts[node_index]
        name = name or f"node-agent-{node_index}"
        env = self.service_env(service)
        env.update({
            "TRAINYARD_NODE_ID": f"node-{node_index}",
            "TRAINYARD_HOST": host.address,  # what it advertises: peers rendezvous with its ranks there
            "TRAINYARD_DEVICE_COUNT": str(self.s.devices_per_node),
            "TRAINYARD_RACK": f"rack-{node_index}",
            "TRAINYARD_DRAIN_TIMEOUT_S": str(self.s.drain_timeout_s),
        })
        # the broker, Redis and the API as the host's namespace reaches them: on the switch's address
        env.setdefault("TRAINYARD_NODE_RANK_BLOCKED", ",".join(
            [*self.control_plane(env), f"{self.net.gateway}:{self.s.api_port}"]))
        log_path = self.s.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module, in the host's namespace
                host.command([sys.executable, "-m", "trainyard_node_agent"]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(self.s.root.parent), start_new_session=True,
            )
        self.procs.record(name, proc.pid)  # nsenter execs the agent: this pid is the agent's


@contextlib.contextmanager
def many_hosts_stack(state_dir: Path, hosts: int, *, devices_per_node: int = 1,
                     extra_env: dict[str, str] | None = None) -> Iterator[ManyHostsStack]:
    """Namespaces, broker and Redis on the switch address, the services, one agent per host; all torn down
    afterwards, whatever happened (the namespaces also at interpreter exit)."""
    net = HostNetwork(hosts)
    launched: list[infra.Launched] = []
    stack: ManyHostsStack | None = None
    try:
        net.open()
        gw = net.gateway
        logs = state_dir / "logs"
        kafka_port, redis_port = infra.free_port(gw), infra.free_port(gw)
        launched.append(infra.start_broker(kafka_port, logs / "broker.log", host=gw))
        launched.append(infra.start_redis(redis_port, state_dir / "redis", logs / "redis.log", host=gw))
        settings = StackSettings(
            state_dir=state_dir, kafka_bootstrap=f"{gw}:{kafka_port}", redis_url=f"redis://{gw}:{redis_port}/0",
            api_port=infra.free_port(), nodes=hosts, devices_per_node=devices_per_node, ready_timeout_s=180,
            drain_timeout_s=5,
        )
        stack = ManyHostsStack(settings, net, extra_env={**MANY_HOSTS_ENV, **(extra_env or {})})
        stack.up()
        yield stack
    finally:
        try:
            if stack is not None:
                for host in net.hosts:  # an agent cut off would wait out its drain and close on a dead link
                    with contextlib.suppress(Exception):
                        net.restore(host)
                stack.down(timeout_s=15)
        finally:
            for server in reversed(launched):
                server.stop()
            net.close()
