"""The embedded local stack: broker, Redis, the services (API, telemetry, scheduler, checkpoint coordinator,
registry) and N simulated nodes, as processes on this host, tracked by pid files so ``down`` stops exactly
what ``up`` started.

Used by ``trainyard dev up|down|status`` (``make up``/``make down``) and by the end-to-end
tests, which run the same code against a temporary state directory and free ports.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainyard_cli import infra, observe, redisacl, redisha
from trainyard_cli.stackprocs import Component, Processes, pid_alive
from trainyard_cli.stacknet import MetricsPorts, rank_blocked
from trainyard_cli.stackredis import StackRedis
from trainyard_cli.stackstate import StackState
from trainyard_cli.stacktokens import DEV_TENANT, DevTokens, first_line
from trainyard_contract.errors import InfrastructureError
from trainyard_contract.records import NodeRecord
from trainyard_contract.storage import ObjectPath

__all__ = ["DEV_TENANT", "EMBEDDED_BACKGROUND_FETCH_MAX_WAIT_MS", "EMBEDDED_FETCH_MAX_WAIT_MS", "SERVICES", "Component",
           "LocalStack", "StackSettings", "pid_alive", "rank_blocked"]

SERVICES = ("api", "telemetry", "scheduler", "checkpoint-coordinator", "registry")


EMBEDDED_FETCH_MAX_WAIT_MS = 20
"""A consumer's fetch wait against the embedded broker (see :meth:`LocalStack.service_env`)."""
EMBEDDED_BACKGROUND_FETCH_MAX_WAIT_MS = 250
"""The same for consumers nobody waits on: each idle consumer polls 4 times a second instead of 50."""
EMBEDDED_IDLE_PAUSE_S = 0.5
"""A consumer with no record for this long stops fetching until a doorbell rings (trainyard_runtime.idlefetch):
every trainyard producer rings, so it only needs to outlast the rings' coalescing (0.25 s)."""


class StackSettings(BaseSettings):
    """Where and how the local stack runs (TRAINYARD_* variables)."""

    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")

    state_dir: Path = Field(default=Path(".trainyard"), description="pids, logs, Redis data, artifacts")
    kafka_port: int = Field(default=9092, gt=0, lt=65536)
    redis_port: int = Field(default=6390, gt=0, lt=65536)
    api_port: int = Field(default=8080, gt=0, lt=65536)
    kafka_bootstrap: str | None = Field(default=None, description="use this broker instead of starting one")
    redis_url: str | None = Field(default=None, description="use this Redis instead of starting one")
    redis_ha: bool = Field(
        default=False,
        description="run Redis that fails over: a primary (TRAINYARD_REDIS_PORT), a replica "
                    "(TRAINYARD_REDIS_REPLICA_PORT) and three Sentinels (TRAINYARD_REDIS_SENTINEL_PORT and the next "
                    "two), data under <state dir>/redis-ha; services get a redis+sentinel:// URL (docs/production.md)")
    redis_replica_port: int = Field(default=6391, gt=0, lt=65536)
    redis_sentinel_port: int = Field(default=26390, gt=0, lt=65534)
    nodes: int = Field(default=2, ge=0, le=64, description="node agents to run (0: the control plane alone, e.g. for "
                                                                 "simulated nodes: bench/cluster_scale)")
    devices_per_node: int = Field(default=4, ge=1, le=64)
    topic_partitions: int = Field(default=3, gt=0)
    topic_namespace: str = ""
    ready_timeout_s: float = Field(default=90.0, gt=0)
    drain_timeout_s: float = Field(
        default=120.0, ge=0,
        description="`down` drains first: node agents ask running attempts to checkpoint and stop, for up to "
                    "this long (0: stop at once); the jobs resume from that checkpoint after `up`",
    )
    prometheus: bool = Field(default=False, description="also run Prometheus scraping every service and node agent "
                                                        "(`make observe`; trainyard_cli.observe)")
    prometheus_port: int = Field(default=0, ge=0, lt=65536, description="Prometheus' port (0: a free one)")
    prometheus_scrape_interval_s: float = Field(default=5.0, gt=0)
    artifact_store: str | None = Field(
        default=None,
        description="an object store as the artifact root (s3://bucket/prefix; credentials and endpoint from the "
                    "AWS_* variables, which the node agents pass on to their ranks): checkpoints and datasets live "
                    "there, each node's own files (rank logs, spools, caches) stay under <state dir>/artifacts; the "
                    "node agents run ranks trusted-single-tenant (docs/production.md, Object storage)")

    @field_validator("artifact_store")
    @classmethod
    def _a_url(cls, value: str | None) -> str | None:
        if value is not None:
            ObjectPath.parse(value)  # ValueError: reported against TRAINYARD_ARTIFACT_STORE
        return value

    @property
    def root(self) -> Path:
        return self.state_dir.expanduser().resolve()

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    @property
    def artifact_root(self) -> Path:
        return self.root / "artifacts"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"


class LocalStack:
    """Start, inspect and stop the local stack described by ``settings``.

    The parts, by concern: :class:`~trainyard_cli.stackprocs.Processes` (pid files, spawning, stopping),
    :class:`~trainyard_cli.stackredis.StackRedis` (Redis or its failover set, ACL users and their URLs),
    :class:`~trainyard_cli.stacknet.MetricsPorts` and :func:`~trainyard_cli.stacknet.rank_blocked` (ports and
    the ranks' block list), :class:`~trainyard_cli.stacktokens.DevTokens` (the dev and admin tokens),
    :class:`~trainyard_cli.stackstate.StackState` (what Redis says: health, nodes, live attempts, draining
    agents). This class orders them: ``up`` (infrastructure, services, node agents, Prometheus, readiness,
    the dev token) and ``down`` (drain, services, infrastructure)."""

    def __init__(self, settings: StackSettings, *, extra_env: dict[str, str] | None = None,
                 say: Callable[[str], None] = lambda _m: None) -> None:
        self.s = settings
        self.extra_env = dict(extra_env or {})
        self.say = say
        self.procs = Processes(settings.run_dir, settings.log_dir)
        self.redis_server = StackRedis(settings.root, settings.log_dir, port=settings.redis_port,
                                replica_port=settings.redis_replica_port, sentinel_port=settings.redis_sentinel_port,
                                ha=settings.redis_ha, url=settings.redis_url)
        self.tokens = DevTokens(settings.root)
        self.ports = MetricsPorts()  # metrics (and Prometheus') ports chosen in this process, by component

    # ------------------------------------------------------------------ addresses
    @property
    def kafka_bootstrap(self) -> str:
        return self.s.kafka_bootstrap or f"127.0.0.1:{self.s.kafka_port}"

    @property
    def redis_url(self) -> str:
        """The operator's URL (the CLI's own commands, tests); services get their own (:meth:`redis_url_for`)."""
        return self.redis_url_for(redisacl.OPERATOR)

    def redis_url_for(self, user: str) -> str:
        """Redis as ``user`` sees it: the stack's Redis with that ACL user (TRAINYARD_REDIS_URL when given)."""
        return self.redis_server.url_for(user)

    @property
    def redis_users_file(self) -> Path:
        return self.redis_server.users_file

    def redis_ha(self) -> redisha.RedisHA:
        """The primary, replica and Sentinels of ``TRAINYARD_REDIS_HA`` (see :mod:`trainyard_cli.redisha`)."""
        return self.redis_server.failover()

    @property
    def prometheus_url(self) -> str | None:
        """The stack's Prometheus, when it runs one (written by :meth:`up`)."""
        return first_line(self.s.root / "prometheus-url") or None

    @property
    def token_file(self) -> Path:
        return self.tokens.token_file

    @property
    def admin_token_file(self) -> Path:
        """The platform-admin token the API bootstraps (TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE)."""
        return self.tokens.admin_token_file

    @property
    def state(self) -> StackState:
        return StackState(self.redis_url)

    def service_env(self, service: str = redisacl.OPERATOR) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "TRAINYARD_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
                "TRAINYARD_REDIS_URL": self.redis_url_for(service if service in redisacl.SERVICE_USERS
                                                          else redisacl.OPERATOR),
                "TRAINYARD_ARTIFACT_ROOT": self.s.artifact_store or str(self.s.artifact_root),
                "TRAINYARD_TOPIC_PARTITIONS": str(self.s.topic_partitions),
                "TRAINYARD_TOPIC_NAMESPACE": self.s.topic_namespace,
                "PYTHONUNBUFFERED": "1",
            }
        )
        if not self.s.kafka_bootstrap:
            # the embedded broker answers a waiting fetch only when its wait ends, not when a record arrives
            # (Apache Kafka does): a short wait keeps each event hop at a few ms (the default 500 ms would be
            # hundreds of ms per hop). Each idle consumer then polls 50 times a second, which costs CPU (an
            # idle stack: ~0.7 of a core with every consumer at 20 ms), so the consumers nobody waits on
            # (metrics, registry, triggers, live feed) poll 4 times a second.
            env.setdefault("TRAINYARD_CONSUMER_FETCH_MAX_WAIT_MS", str(EMBEDDED_FETCH_MAX_WAIT_MS))
            env.setdefault("TRAINYARD_CONSUMER_BACKGROUND_FETCH_MAX_WAIT_MS",
                           str(EMBEDDED_BACKGROUND_FETCH_MAX_WAIT_MS))
            # ... and at 20 ms an idle consumer would ask 50 times a second: idle ones sleep until a doorbell rings
            env.setdefault("TRAINYARD_CONSUMER_IDLE_PAUSE_S", str(EMBEDDED_IDLE_PAUSE_S))
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------ processes
    def components(self) -> list[Component]:
        return self.procs.components()

    def running(self) -> list[Component]:
        return [c for c in self.components() if c.alive]

    def nodes(self) -> list[NodeRecord]:
        """The node inventory as the scheduler recorded it from the agents' heartbeats."""
        return sorted(asyncio.run(self.state.nodes()), key=lambda n: n.node_id)

    # ------------------------------------------------------------------ up
    def up(self) -> str:
        """Start everything not yet running, wait until healthy; returns the dev token."""
        # the stack's state (Redis' AOF, the tokens, every tenant's artifacts) is its owner's alone; ranks never
        # see it either (TRAINYARD_SANDBOX_HIDE below covers it in their sandbox)
        self.s.root.mkdir(parents=True, exist_ok=True)
        self.s.root.chmod(0o700)
        for d in (self.s.run_dir, self.s.log_dir, self.s.artifact_root):
            d.mkdir(parents=True, exist_ok=True)
        alive = {c.name for c in self.running()}
        for stale in {c.name for c in self.components()} - alive:
            self.procs.forget(stale)
        if not self.s.kafka_bootstrap and "broker" not in alive:
            self.say(f"starting the Kafka-protocol broker (tansu, memory storage) on :{self.s.kafka_port}")
            launched = infra.start_broker(self.s.kafka_port, self.s.log_dir / "broker.log")
            self.procs.record("broker", launched.process.pid)
        self.redis_server.start(alive, self.procs.record, self.say)
        asyncio.run(self._prepare_infra())
        alive -= self._wait_for_stopping_agents(alive)
        if "api" not in alive:
            infra.require_free_port(self.s.api_port, "the API", "TRAINYARD_API_PORT")
        for name in SERVICES:
            if name not in alive:
                self._spawn_service(name)
        for i in range(self.s.nodes):
            name = f"node-agent-{i}"
            if name not in alive:
                self._spawn_service("node-agent", name=name, node_index=i)
        if self.s.prometheus and "prometheus" not in alive:
            self._start_prometheus()
        self._wait_ready()
        (self.s.root / "api-url").write_text(self.s.api_url + "\n")
        return self.tokens.when_the_api_answers(self.s.api_url)

    def _wait_for_stopping_agents(self, alive: set[str]) -> set[str]:
        """Node agents still running but stopping (SIGTERM-ed: their node is drained by their own incarnation)
        are waited for, so that `up` starts them again instead of counting them as running; their names."""
        stopping = asyncio.run(self.state.stopping_agents({n for n in alive if n.startswith("node-agent-")}))
        if not stopping:
            return set()
        grace = self.s.drain_timeout_s + 60.0
        self.say(f"{', '.join(sorted(stopping))} stopping (draining); waiting up to {grace:.0f}s to start again")
        group = [c for c in self.components() if c.name in stopping]
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(c.alive for c in group):
            time.sleep(0.2)
        still = [c.name for c in group if c.alive]
        if still:
            raise InfrastructureError(
                f"{', '.join(still)} did not finish stopping within {grace:.0f}s; see its log "
                f"({self.s.log_dir}) or stop it (`make down`), then `make up` again", retryable=True)
        for name in stopping:
            self.procs.forget(name)
        return stopping

    async def _prepare_infra(self) -> None:
        from trainyard_runtime.bus import ensure_topics

        await ensure_topics(self.kafka_bootstrap, partitions=self.s.topic_partitions,
                            namespace=self.s.topic_namespace)

    def _spawn_service(self, service: str, *, name: str | None = None, node_index: int = 0) -> None:
        name = name or service
        env = self.service_env(service)
        if service == "api":
            env["TRAINYARD_API_PORT"] = str(self.s.api_port)
            env["TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE"] = str(self.admin_token_file)
            # one user's own machine: code.repo may name a checkout on it (off by default elsewhere)
            env.setdefault("TRAINYARD_API_GIT_LOCAL_REPOS", "true")
        if service == "node-agent":
            env.update(self._agent_env(env, node_index))
        if self.s.prometheus:  # a metrics port and a scrape target of its own
            port = self._port(name)
            env["TRAINYARD_METRICS_PORT"] = str(port)
            env["TRAINYARD_METRICS_TOKEN"] = observe.metrics_token(self.s.root)
            observe.write_target(self.s.root, name, service, port)
        pid = self.procs.spawn(name, "trainyard_" + service.replace("-", "_"), env, cwd=self.s.root.parent)
        self.say(f"started {name} (pid {pid}); log {self.s.log_dir / f'{name}.log'}")

    def _agent_env(self, env: dict[str, str], node_index: int) -> dict[str, str]:
        """A node agent's own settings: its node, its rack, the drain, what its ranks may not see or reach."""
        out = {
            "TRAINYARD_NODE_ID": f"node-{node_index}",
            "TRAINYARD_DEVICE_COUNT": str(self.s.devices_per_node),
            "TRAINYARD_RACK": f"rack-{node_index // 2}",
            "TRAINYARD_DRAIN_TIMEOUT_S": str(self.s.drain_timeout_s),
            # the stack's whole state directory is hidden from ranks, not only the artifact root
            "TRAINYARD_SANDBOX_HIDE": str(self.s.root),
        }
        if self.s.artifact_store:
            out.update(object_store_agent_env(env, self.s.artifact_root))
        if "TRAINYARD_NODE_RANK_BLOCKED" not in env:  # the operator's own list (even an empty one) wins
            out["TRAINYARD_NODE_RANK_BLOCKED"] = ",".join(self.control_plane({**env, **out}))
        return out

    def control_plane(self, env: dict[str, str]) -> list[str]:
        """Every endpoint of the stack a rank must not reach (its node agents' TRAINYARD_NODE_RANK_BLOCKED): the
        broker, Redis (with its replica and Sentinels), the API, with Prometheus every component's metrics port
        (every service's, the telemetry service's included) and Prometheus itself, an S3 endpoint of ``env``.
        Not an OTLP collector: ranks send their own spans there. Ports of components started later by another
        `up` (a crashed one started again) are not in the lists of agents already running."""
        metrics: list[int] = []
        if self.s.prometheus:
            names = [*SERVICES, *(f"node-agent-{i}" for i in range(self.s.nodes))]
            metrics = [self._port(n) for n in names] + [self.s.prometheus_port or self._port("prometheus")]
        return rank_blocked(kafka_bootstrap=self.kafka_bootstrap, redis_url=self.s.redis_url,
                            redis=self.redis_server.endpoints(), api_port=self.s.api_port, metrics_ports=metrics,
                            env=env)

    def _port(self, component: str) -> int:
        """The metrics port of ``component`` (or Prometheus' port): chosen once, so that the node agents started
        before it can list it."""
        return self.ports.port(component)

    def _start_prometheus(self) -> None:
        port = self.s.prometheus_port or self._port("prometheus")
        launched = observe.start_prometheus(self.s.root, port, self.s.log_dir / "prometheus.log",
                                            scrape_interval_s=self.s.prometheus_scrape_interval_s)
        self.procs.record("prometheus", launched.process.pid)
        (self.s.root / "prometheus-url").write_text(launched.address + "\n")
        self.say(f"started prometheus on {launched.address} (storage {self.s.root / 'prometheus' / 'data'})")
        unscraped = [c.name for c in self.running() if c.name not in ("broker", "redis", "prometheus")
                     and not c.name.startswith("redis-")
                     and not (observe.targets_dir(self.s.root) / f"{c.name}.json").exists()]
        if unscraped:
            self.say(f"{', '.join(unscraped)} already ran without a metrics port: `make down`, then `make observe`, "
                     "to scrape them too")

    def _wait_ready(self) -> None:
        """Every service beacons its health key; the API answers; every node has reported."""
        deadline = time.monotonic() + self.s.ready_timeout_s
        missing: list[str] = []
        while time.monotonic() < deadline:
            dead = [c for c in self.components() if not c.alive]
            if dead:
                c = dead[0]
                tail = c.log.read_text(errors="replace")[-3000:] if c.log.exists() else ""
                raise InfrastructureError(f"{c.name} exited during start-up; last log lines:\n{tail}",
                                          retryable=False)
            missing = asyncio.run(self._not_ready())
            if not missing:
                return
            time.sleep(0.5)
        raise InfrastructureError(
            f"the stack was not healthy after {self.s.ready_timeout_s:.0f}s; waiting for: {', '.join(missing)}. "
            f"See the logs in {self.s.log_dir} (`make logs`)."
        )

    async def _not_ready(self) -> list[str]:
        return await self.state.not_ready(SERVICES, nodes=self.s.nodes, api_url=self.s.api_url)

    # ------------------------------------------------------------------ down
    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Drain, then stop what the pid files name: node agents first (each asks its running ranks to
        checkpoint at an agreed step and stop, up to ``drain_timeout_s``), then — once the scheduler has
        recorded every attempt as interrupted by maintenance — the services, then Redis and the broker."""
        comps = self.components()
        agents = [c for c in comps if c.name.startswith("node-agent")]
        infra_ = [c for c in comps if c.name in ("broker", "redis") or c.name.startswith("redis-")]  # redis-*: HA
        services = [c for c in comps if c not in agents and c not in infra_]
        stopped: list[str] = []
        drain = self.s.drain_timeout_s
        if agents and drain > 0 and any(c.alive for c in agents):
            live = self._live_attempts()
            self.say(f"draining: {len(live)} running attempt(s) checkpoint and stop (waiting up to {drain:.0f}s); "
                     "they resume from that checkpoint after `make up`" if live else "draining: no running attempts")
            grace = drain + 20.0 if live else timeout_s
        else:
            live, grace = [], timeout_s
        stopped += self._stop(agents, grace)
        if live:
            left = self._wait_recorded(timeout_s)
            self.say(f"{len(live) - len(left)} attempt(s) interrupted by maintenance (no failure)"
                     + (f"; {', '.join(left)} not recorded in time (the scheduler sorts them out at the next "
                        "start)" if left else ""))
        stopped += self._stop(services, timeout_s)
        stopped += self._stop(infra_, timeout_s)
        observe.forget(self.s.root, stopped)
        return stopped

    def _stop(self, group: list[Component], timeout_s: float) -> list[str]:
        return self.procs.stop(group, timeout_s)

    def _live_attempts(self) -> list[str]:
        """Jobs whose current attempt is live (starting or running), from Redis; [] if unreachable."""
        try:
            return asyncio.run(self.state.live_attempts())
        except Exception:  # noqa: BLE001 - Redis already down: nothing to wait for
            return []

    def _wait_recorded(self, timeout_s: float) -> list[str]:
        """Wait until no attempt is live any more (the scheduler revoked the drained ones); those left."""
        deadline = time.monotonic() + timeout_s
        left = self._live_attempts()
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = self._live_attempts()
        return left


def object_store_agent_env(env: dict[str, str], artifact_root: Path) -> dict[str, str]:
    """A node agent's settings under an object-store root: its own files in the stack's directory, the
    AWS configuration passed on to its ranks, ranks unsandboxed (a sandbox cannot scope the credentials)."""
    return {
        "TRAINYARD_NODE_STATE_DIR": str(artifact_root),
        "TRAINYARD_RANK_PASS_ENV": env.get("TRAINYARD_RANK_PASS_ENV") or ",".join(
            sorted(k for k in env if k.startswith(("AWS_", "FSSPEC_S3_")))),
        "TRAINYARD_NODE_SANDBOX": env.get("TRAINYARD_NODE_SANDBOX") or "trusted-single-tenant",
    }
