"""The embedded local stack: broker, Redis, the five services and N simulated nodes, as
processes on this host, tracked by pid files so ``down`` stops exactly what ``up`` started.

Used by ``trainyard dev up|down|status`` (``make up``/``make down``) and by the end-to-end
tests, which run the same code against a temporary state directory and free ports.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainyard_cli import infra, observe, redisacl, redisha
from trainyard_contract.errors import ConfigError, InfrastructureError
from trainyard_contract.records import NodeRecord
from trainyard_contract.storage import ObjectPath
from trainyard_runtime.store import Keys, StateStore, connect_redis

SERVICES = ("api", "telemetry", "scheduler", "checkpoint-coordinator", "registry")
DEV_TENANT = "dev"


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
    nodes: int = Field(default=2, ge=1, le=64)
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


@dataclass(frozen=True)
class Component:
    name: str
    pid: int
    log: Path

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as dead
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


class LocalStack:
    """Start, inspect and stop the local stack described by ``settings``."""

    def __init__(self, settings: StackSettings, *, extra_env: dict[str, str] | None = None,
                 say: Callable[[str], None] = lambda _m: None) -> None:
        self.s = settings
        self.extra_env = dict(extra_env or {})
        self.say = say
        self._ports: dict[str, int] = {}  # metrics (and Prometheus') ports chosen in this process, by component

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
        if self.s.redis_url:
            return self.s.redis_url
        passwords = redisacl.load_or_create(self.redis_users_file)
        if self.s.redis_ha:
            return self.redis_ha().url(user, passwords[user])
        return redisacl.url_for(user, passwords[user], host="127.0.0.1", port=self.s.redis_port)

    @property
    def redis_users_file(self) -> Path:
        return self.s.root / "redis-users.json"

    @property
    def prometheus_url(self) -> str | None:
        """The stack's Prometheus, when it runs one (written by :meth:`up`)."""
        return _first_line(self.s.root / "prometheus-url") or None

    @property
    def token_file(self) -> Path:
        return self.s.root / "dev-token"

    @property
    def admin_token_file(self) -> Path:
        """The platform-admin token the API bootstraps (TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE)."""
        return self.s.root / "admin-token"

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
            env.setdefault("TRAINYARD_CONSUMER_BACKGROUND_FETCH_MAX_WAIT_MS", str(EMBEDDED_BACKGROUND_FETCH_MAX_WAIT_MS))
            # ... and at 20 ms an idle consumer would ask 50 times a second: idle ones sleep until a doorbell rings
            env.setdefault("TRAINYARD_CONSUMER_IDLE_PAUSE_S", str(EMBEDDED_IDLE_PAUSE_S))
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------ pid files
    def _pidfile(self, name: str) -> Path:
        return self.s.run_dir / f"{name}.pid"

    def components(self) -> list[Component]:
        found = []
        if self.s.run_dir.is_dir():
            for pidfile in sorted(self.s.run_dir.glob("*.pid")):
                try:
                    pid = int(pidfile.read_text().strip())
                except ValueError:
                    continue
                found.append(Component(pidfile.stem, pid, self.s.log_dir / f"{pidfile.stem}.log"))
        return found

    def running(self) -> list[Component]:
        return [c for c in self.components() if c.alive]

    def _record(self, name: str, pid: int) -> None:
        self.s.run_dir.mkdir(parents=True, exist_ok=True)
        self._pidfile(name).write_text(f"{pid}\n")

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
            self._pidfile(stale).unlink(missing_ok=True)
        if not self.s.kafka_bootstrap and "broker" not in alive:
            self.say(f"starting the Kafka-protocol broker (tansu, memory storage) on :{self.s.kafka_port}")
            launched = infra.start_broker(self.s.kafka_port, self.s.log_dir / "broker.log")
            self._record("broker", launched.process.pid)
        if not self.s.redis_url and self.s.redis_ha:
            self._start_redis_ha(alive)
        elif not self.s.redis_url and "redis" not in alive:
            self.say(f"starting redis-server (AOF, fsync always) on :{self.s.redis_port}")
            acl = redisacl.write_acl_file(self.s.root / "redis" / "users.acl",
                                          redisacl.load_or_create(self.redis_users_file))
            launched = infra.start_redis(self.s.redis_port, self.s.root / "redis", self.s.log_dir / "redis.log",
                                         acl_file=acl)
            self._record("redis", launched.process.pid)
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
        return self._dev_token_when_the_api_answers()

    def redis_ha(self) -> redisha.RedisHA:
        """The primary, replica and Sentinels of ``TRAINYARD_REDIS_HA`` (see :mod:`trainyard_cli.redisha`)."""
        passwords = redisacl.load_or_create(self.redis_users_file)
        first = self.s.redis_sentinel_port
        return redisha.RedisHA(self.s.root / "redis-ha", self.s.log_dir, (self.s.redis_port, self.s.redis_replica_port),
                               (first, first + 1, first + 2), auth=(redisacl.OPERATOR, passwords[redisacl.OPERATOR]))

    def _start_redis_ha(self, alive: set[str]) -> None:
        ha = self.redis_ha()
        names = [f"redis-{p}" for p in ha.ports] + [f"redis-sentinel-{p}" for p in ha.sentinel_ports]
        if all(n in alive for n in names):
            return
        self.say(f"starting Redis with failover: redis-server on :{ha.ports[0]} and :{ha.ports[1]} (AOF, fsync "
                 f"always; one replicates the other), redis-sentinel on :{', :'.join(map(str, ha.sentinel_ports))}")
        redisacl.write_acl_file(ha.root / "users.acl", redisacl.load_or_create(self.redis_users_file))
        try:
            ha.start(skip=[n for n in names if n in alive])
        finally:  # what did start is recorded even when the rest failed: `make down` stops it
            for launched in (*ha.servers.values(), *ha.sentinels.values()):
                self._record(launched.name, launched.process.pid)

    def _wait_for_stopping_agents(self, alive: set[str]) -> set[str]:
        """Node agents still running but stopping (SIGTERM-ed: their node is drained by their own incarnation)
        are waited for, so that `up` starts them again instead of counting them as running; their names."""
        stopping = asyncio.run(self._stopping_agents({n for n in alive if n.startswith("node-agent-")}))
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
            self._pidfile(name).unlink(missing_ok=True)
        return stopping

    async def _stopping_agents(self, names: set[str]) -> set[str]:
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

    def _dev_token_when_the_api_answers(self, timeout_s: float = 60.0) -> str:
        """:meth:`_ensure_dev_token`, retried while the API is unreachable or answers 5xx (it may still be
        connecting to the broker right after it turned healthy); other errors at once."""
        from trainyard_cli.client import ApiError

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._ensure_dev_token()
            except ApiError as exc:
                transient = exc.status is None or exc.status >= 500
                if not transient or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    async def _prepare_infra(self) -> None:
        from trainyard_runtime.bus import ensure_topics

        await ensure_topics(self.kafka_bootstrap, partitions=self.s.topic_partitions,
                            namespace=self.s.topic_namespace)

    def _ensure_dev_token(self) -> str:
        """The dev token (tenant-admin of tenant ``dev``): the file's while the API accepts it, else a new one
        issued through the API with the bootstrap admin token. Nothing here writes Redis."""
        from trainyard_cli.client import ApiAuthError, ApiClient, ApiConflictError

        token = _first_line(self.token_file)
        if token:
            with ApiClient(self.s.api_url, token) as api:
                try:
                    api.list_jobs(limit=1)
                    return token
                except ApiAuthError:
                    pass  # unknown (a fresh Redis), revoked or expired: issue another
        admin = _first_line(self.admin_token_file)
        if not admin:
            raise InfrastructureError(
                f"the API accepts no dev token and wrote no admin token to {self.admin_token_file}; an active "
                "platform-admin token exists elsewhere: issue the dev token with it (`trainyard --token <admin> "
                f"admin tokens create --tenant {DEV_TENANT} --role tenant-admin > {self.token_file}`)",
                retryable=False)
        with ApiClient(self.s.api_url, admin) as api:
            try:
                api.call_json("POST", "/v1/admin/tenants", body={"tenant": DEV_TENANT})
            except ApiConflictError:
                pass  # exists already
            issued = api.call_json("POST", f"/v1/admin/tenants/{DEV_TENANT}/tokens",
                                   body={"name": "dev", "role": "tenant-admin"})
        _write_private(self.token_file, issued["token"])
        return str(issued["token"])

    def _spawn_service(self, service: str, *, name: str | None = None, node_index: int = 0) -> None:
        name = name or service
        env = self.service_env(service)
        module = "trainyard_" + service.replace("-", "_")
        if service == "api":
            env["TRAINYARD_API_PORT"] = str(self.s.api_port)
            env["TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE"] = str(self.admin_token_file)
            # one user's own machine: code.repo may name a checkout on it (off by default elsewhere)
            env.setdefault("TRAINYARD_API_GIT_LOCAL_REPOS", "true")
        if service == "node-agent":
            env.update(
                {
                    "TRAINYARD_NODE_ID": f"node-{node_index}",
                    "TRAINYARD_DEVICE_COUNT": str(self.s.devices_per_node),
                    "TRAINYARD_RACK": f"rack-{node_index // 2}",
                    "TRAINYARD_DRAIN_TIMEOUT_S": str(self.s.drain_timeout_s),
                    # the stack's whole state directory is hidden from ranks, not only the artifact root
                    "TRAINYARD_SANDBOX_HIDE": str(self.s.root),
                }
            )
            if self.s.artifact_store:
                env.update(self._object_store_agent_env(env))
            if "TRAINYARD_NODE_RANK_BLOCKED" not in env:  # the operator's own list (even an empty one) wins
                env["TRAINYARD_NODE_RANK_BLOCKED"] = ",".join(self.control_plane(env))
        if self.s.prometheus:  # a metrics port and a scrape target of its own
            port = self._port(name)
            env["TRAINYARD_METRICS_PORT"] = str(port)
            env["TRAINYARD_METRICS_TOKEN"] = observe.metrics_token(self.s.root)
            observe.write_target(self.s.root, name, service, port)
        log_path = self.s.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-m", module],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(self.s.root.parent), start_new_session=True,
            )
        self._record(name, proc.pid)
        self.say(f"started {name} (pid {proc.pid}); log {log_path}")

    def _object_store_agent_env(self, env: dict[str, str]) -> dict[str, str]:
        """A node agent's settings under an object-store root: its own files in the stack's directory, the
        AWS configuration passed on to its ranks, ranks unsandboxed (a sandbox cannot scope the credentials)."""
        return {
            "TRAINYARD_NODE_STATE_DIR": str(self.s.artifact_root),
            "TRAINYARD_RANK_PASS_ENV": env.get("TRAINYARD_RANK_PASS_ENV") or ",".join(
                sorted(k for k in env if k.startswith(("AWS_", "FSSPEC_S3_")))),
            "TRAINYARD_NODE_SANDBOX": env.get("TRAINYARD_NODE_SANDBOX") or "trusted-single-tenant",
        }

    def control_plane(self, env: dict[str, str]) -> list[str]:
        """Every endpoint of the stack a rank must not reach (its node agents' TRAINYARD_NODE_RANK_BLOCKED): the
        broker, Redis (with its replica and Sentinels), the API, with Prometheus every component's metrics port
        and Prometheus itself, an S3 endpoint of ``env``. Not an OTLP collector: ranks send their own spans there.
        Ports of components started later by another `up` (a crashed one started again) are not in the lists of
        agents already running."""
        if self.s.redis_url:
            redis: list[str] = []  # the operator's: what its URL names (rank_blocked)
        elif self.s.redis_ha:
            ha = self.redis_ha()
            redis = [f"127.0.0.1:{p}" for p in (*ha.ports, *ha.sentinel_ports)]
        else:
            redis = [f"127.0.0.1:{self.s.redis_port}"]
        metrics: list[int] = []
        if self.s.prometheus:
            names = [*SERVICES, *(f"node-agent-{i}" for i in range(self.s.nodes))]
            metrics = [self._port(n) for n in names] + [self.s.prometheus_port or self._port("prometheus")]
        return rank_blocked(kafka_bootstrap=self.kafka_bootstrap, redis_url=self.s.redis_url, redis=redis,
                            api_port=self.s.api_port, metrics_ports=metrics, env=env)

    def _port(self, component: str) -> int:
        """The metrics port of ``component`` (or Prometheus' port): chosen once, so that the node agents started
        before it can list it."""
        if component not in self._ports:
            self._ports[component] = infra.free_port()
        return self._ports[component]

    def _start_prometheus(self) -> None:
        port = self.s.prometheus_port or self._port("prometheus")
        launched = observe.start_prometheus(self.s.root, port, self.s.log_dir / "prometheus.log",
                                            scrape_interval_s=self.s.prometheus_scrape_interval_s)
        self._record("prometheus", launched.process.pid)
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
        missing: list[str] = []
        redis = connect_redis(self.redis_url)
        try:
            for service in (*SERVICES, "node-agent"):
                keys = [k async for k in redis.scan_iter(match=Keys.health(service, "*"), count=100)]
                need = self.s.nodes if service == "node-agent" else 1
                if len(keys) < need:
                    missing.append(f"{service} ({len(keys)}/{need})")
            nodes = await StateStore(redis).list_nodes()
            if len(nodes) < self.s.nodes:
                missing.append(f"node inventory ({len(nodes)}/{self.s.nodes} nodes)")
        finally:
            await redis.aclose()
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                resp = await client.get(f"{self.s.api_url}/healthz")
                if resp.status_code != 200:
                    missing.append(f"api /healthz ({resp.status_code})")
        except httpx.HTTPError:
            missing.append("api /healthz (no answer)")
        return missing

    def nodes(self) -> list[NodeRecord]:
        """The node inventory as the scheduler recorded it from the agents' heartbeats."""
        async def read() -> list[NodeRecord]:
            redis = connect_redis(self.redis_url)
            try:
                return await StateStore(redis).list_nodes()
            finally:
                await redis.aclose()
        return sorted(asyncio.run(read()), key=lambda n: n.node_id)

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
        for c in group:
            _signal_group(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(c.alive for c in group):
            time.sleep(0.2)
        for c in group:
            if c.alive:
                _signal_group(c.pid, signal.SIGKILL)
            self._pidfile(c.name).unlink(missing_ok=True)
        return [c.name for c in group]

    def _live_attempts(self) -> list[str]:
        """Jobs whose current attempt is live (starting or running), from Redis; [] if unreachable."""
        async def go() -> list[str]:
            redis = connect_redis(self.redis_url)
            try:
                store = StateStore(redis)
                ids = await redis.zrange(Keys.jobs, 0, -1)
                jobs = await store.get_jobs(list(ids)) if ids else []
                return [j.job_id for j in jobs if j.current is not None and j.current.state in ("starting", "running")
                        and j.state not in ("succeeded", "failed", "cancelled")]
            finally:
                await redis.aclose()

        try:
            return asyncio.run(go())
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


def rank_blocked(*, kafka_bootstrap: str, redis_url: str | None, redis: list[str], api_port: int,
                 metrics_ports: list[int], env: dict[str, str]) -> list[str]:
    """The ``host:port`` entries of a local stack's control plane (see :meth:`LocalStack.control_plane`). Pure."""
    found = [b.strip() for b in kafka_bootstrap.split(",") if b.strip()]
    found += [*redis, *_url_endpoints(redis_url), f"127.0.0.1:{api_port}"]
    found += [f"127.0.0.1:{p}" for p in metrics_ports]
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        found += _url_endpoints(env.get(name))
    return list(dict.fromkeys(found))


def _url_endpoints(url: str | None) -> list[str]:
    """``host:port`` of each host of a URL (``redis+sentinel://a:1,b:2/…`` names several; default ports by
    scheme), none when there is no URL."""
    if not url or "://" not in url:
        return []
    scheme, rest = url.split("://", 1)
    hosts = rest.split("/", 1)[0].rpartition("@")[2]
    default = {"http": 80, "https": 443, "redis": 6379, "rediss": 6379}.get(scheme, 26379 if "sentinel" in scheme else 0)
    out = []
    for host in filter(None, hosts.split(",")):
        if host.startswith("["):  # [v6]:port
            addr, _, port = host[1:].partition("]")
            port = port.lstrip(":")
            out.append(f"[{addr}]:{port or default}")
            continue
        addr, _, port = host.partition(":")
        out.append(f"{addr}:{port or default}")
    return [e for e in out if not e.endswith(":0")]


def _first_line(path: Path) -> str:
    try:
        return path.read_text().strip().split("\n", 1)[0].strip()
    except OSError:
        return ""


def _write_private(path: Path, secret: str) -> None:
    """``secret`` into ``path``, readable by its owner only from the moment it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    path.chmod(0o600)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group our start_new_session gave the component (its children too)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        raise ConfigError(f"not allowed to stop pid {pid}: {exc}") from exc
