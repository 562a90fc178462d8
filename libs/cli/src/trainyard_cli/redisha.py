"""Redis that fails over, on this host: a primary, a replica and Sentinels (Debian ``redis-sentinel``).

Used by ``TRAINYARD_REDIS_HA=1 make up`` (three Sentinels, quorum 2) and by the failover tests (one
Sentinel, quorum 1, fast timings). Services reach it with a ``redis+sentinel://`` URL
(:meth:`RedisHA.url`), follow each failover, and use an epoch increment only once the replica holds
it (docs/design.md §5.2.1). Each server runs from a config file that Sentinel rewrites (CONFIG
REWRITE), so a restart keeps the topology of the last failover; both data servers run with AOF and
fsync on every write, like the standalone Redis (:func:`trainyard_cli.infra.start_redis`).
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import redis as redis_sync

from trainyard_cli.infra import Launched, _spawn, redis_binary, require_free_port, wait_for_port
from trainyard_contract.errors import InfrastructureError
from trainyard_runtime.replication import SENTINEL_SCHEME

SERVICE = "trainyard"  # the name the Sentinels monitor the primary under


@dataclass(frozen=True)
class Timings:
    """Sentinel's failure detection: a primary silent for ``down_after_ms`` is down; a failover that takes
    longer than ``failover_timeout_ms`` is abandoned (and, unless forced, not retried for twice that)."""

    down_after_ms: int = 5000
    failover_timeout_ms: int = 10000


# tests: a failover in a second or two (500 ms made a loaded 2-core host fail over again right after a failover)
FAST = Timings(down_after_ms=1000, failover_timeout_ms=2000)


def sentinel_command() -> list[str]:
    """``redis-sentinel`` (Debian's package), or the same binary as ``redis-server --sentinel``."""
    found = shutil.which("redis-sentinel")
    return [found] if found else [redis_binary(), "--sentinel"]


@dataclass
class RedisHA:
    """Two data servers (``ports[0]`` started as the primary) and the Sentinels watching them."""

    root: Path
    log_dir: Path
    ports: tuple[int, int]
    sentinel_ports: tuple[int, ...]
    service: str = SERVICE
    host: str = "127.0.0.1"
    auth: tuple[str, str] | None = None  # the user Sentinel and the replica use (all permissions), password
    servers: dict[int, Launched] = field(default_factory=dict)
    sentinels: dict[int, Launched] = field(default_factory=dict)

    # ------------------------------------------------------------------ addresses
    def url(self, user: str | None = None, password: str | None = None, db: int = 0) -> str:
        """The ``redis+sentinel://`` URL services use (``user``/``password``: an ACL user of the data servers)."""
        credentials = f"{quote(user or '', safe='')}:{quote(password or '', safe='')}@" if password else ""
        hosts = ",".join(f"{self.host}:{p}" for p in self.sentinel_ports)
        return f"{SENTINEL_SCHEME}://{credentials}{hosts}/{self.service}/{db}"

    def server_dir(self, port: int) -> Path:
        return self.root / f"server-{port}"

    def _client(self, port: int, *, sentinel: bool = False) -> redis_sync.Redis:
        user, password = (None, None) if sentinel or self.auth is None else self.auth
        return redis_sync.Redis(host=self.host, port=port, username=user, password=password, decode_responses=True,
                                socket_timeout=2.0, socket_connect_timeout=2.0)

    def primary_port(self) -> int | None:
        """The primary's port as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            named = self._named(port)
            if named is not None:
                return named
        return None

    # ------------------------------------------------------------------ start / stop
    def start(self, *, timings: Timings = Timings(), quorum: int | None = None,
              skip: Sequence[str] = ()) -> RedisHA:
        """Start every server and Sentinel (except the names in ``skip``, ``redis-<port>`` and
        ``redis-sentinel-<port>``: already running), then wait until the primary has its replica linked
        and the Sentinels name it."""
        for i, port in enumerate(self.ports):
            if f"redis-{port}" not in skip:
                self.start_server(port, replica_of=None if i == 0 else self.ports[0])
        # Sentinel learns the replicas from the primary's INFO, at once and then every 10 s: it starts once
        # the replica is linked, so that it can fail over from the first second
        self._wait(lambda: self._linked_primary() is not None, 30.0, "the replica did not link to its primary")
        for port in self.sentinel_ports:
            if f"redis-sentinel-{port}" not in skip:
                self._start_sentinel(port, timings, quorum or len(self.sentinel_ports) // 2 + 1)
        self.wait_ready()
        return self

    def start_server(self, port: int, *, replica_of: int | None = None, force_replica_of: bool = False) -> Launched:
        """A data server from its config file (written on first start; later Sentinel's rewrites rule).
        ``force_replica_of``: start it as a replica of that port whatever its file says."""
        require_free_port(port, "redis-server (HA)", "TRAINYARD_REDIS_PORT", self.host)
        data = self.server_dir(port)
        data.mkdir(parents=True, exist_ok=True)
        conf = data / "redis.conf"
        if not conf.exists():
            lines = [f"port {port}", f"bind {self.host}", f"dir {data.resolve()}", "appendonly yes",
                     "appendfsync always", 'save ""', "protected-mode no", "daemonize no",
                     # a resync (every demoted primary makes one) starts at once, without a disk copy
                     "repl-diskless-sync yes", "repl-diskless-sync-delay 0"]
            if self.auth is not None:
                lines += [f"masteruser {self.auth[0]}", f"masterauth {self.auth[1]}",
                          f"aclfile {(self.root / 'users.acl').resolve()}"]
            if replica_of is not None:
                lines.append(f"replicaof {self.host} {replica_of}")
            conf.write_text("\n".join(lines) + "\n")
        cmd = [redis_binary(), str(conf.resolve())]
        if force_replica_of and replica_of is not None:
            cmd += ["--replicaof", self.host, str(replica_of)]
        log = self.log_dir / f"redis-{port}.log"
        proc = _spawn(cmd, log)
        wait_for_port(port, process=proc, what=f"redis-server :{port}", log_path=log, host=self.host)
        launched = Launched(f"redis-{port}", proc, f"redis://{self.host}:{port}/0", log)
        self.servers[port] = launched
        if force_replica_of:
            with self._client(port) as c:
                c.config_rewrite()  # a restart keeps it a replica
        return launched

    def _start_sentinel(self, port: int, timings: Timings, quorum: int) -> Launched:
        require_free_port(port, "redis-sentinel", "TRAINYARD_REDIS_SENTINEL_PORT", self.host)
        data = self.root / f"sentinel-{port}"
        data.mkdir(parents=True, exist_ok=True)
        conf = data / "sentinel.conf"
        if not conf.exists():  # Sentinel rewrites it with what it learns (the current primary, its epochs)
            s = self.service
            lines = [f"port {port}", f"bind {self.host}", f"dir {data.resolve()}", "protected-mode no",
                     "daemonize no", f"sentinel monitor {s} {self.host} {self.ports[0]} {quorum}",
                     f"sentinel down-after-milliseconds {s} {timings.down_after_ms}",
                     f"sentinel failover-timeout {s} {timings.failover_timeout_ms}",
                     f"sentinel parallel-syncs {s} 1"]
            if self.auth is not None:
                lines += [f"sentinel auth-user {s} {self.auth[0]}", f"sentinel auth-pass {s} {self.auth[1]}"]
            conf.write_text("\n".join(lines) + "\n")
        log = self.log_dir / f"sentinel-{port}.log"
        proc = _spawn([*sentinel_command(), str(conf.resolve())], log)
        wait_for_port(port, process=proc, what=f"redis-sentinel :{port}", log_path=log, host=self.host)
        launched = Launched(f"redis-sentinel-{port}", proc, f"{self.host}:{port}", log)
        self.sentinels[port] = launched
        return launched

    def stop(self) -> None:
        for launched in (*self.sentinels.values(), *self.servers.values()):
            launched.stop()

    # ------------------------------------------------------------------ state
    def _role(self, port: int) -> dict[str, object]:
        with self._client(port) as c:
            return dict(c.info("replication"))

    def in_sync(self) -> int | None:
        """The primary's port when every Sentinel names the same primary, it is one, and the other data
        server replicates from it with its link up; else None."""
        named = {self._named(port) for port in self.sentinel_ports}
        if len(named) != 1 or None in named:
            return None
        primary = named.pop()
        return primary if primary is not None and self._linked_primary() == primary else None

    def _linked_primary(self) -> int | None:
        """The data server that is a primary, when the other replicates from it with its link up."""
        try:
            roles = {port: self._role(port) for port in self.ports}
        except (redis_sync.RedisError, OSError):
            return None
        primaries = [p for p, info in roles.items() if info.get("role") == "master"]
        if len(primaries) != 1:
            return None
        linked = all(info.get("role") == "slave" and int(str(info.get("master_port", 0))) == primaries[0]
                     and info.get("master_link_status") == "up" for p, info in roles.items() if p != primaries[0])
        return primaries[0] if linked else None

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise InfrastructureError(f"{what} within {timeout_s:.0f}s; see the logs in {self.log_dir}")
            time.sleep(0.05)

    def _named(self, sentinel_port: int) -> int | None:
        """The primary this Sentinel names to clients (SENTINEL MASTERS, as redis-py asks), once no
        failover is in progress and it does not think it down."""
        try:
            with self._client(sentinel_port, sentinel=True) as s:
                raw = s.execute_command("SENTINEL", "MASTER", self.service)
        except redis_sync.RedisError:
            return None
        state = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2]))
        return int(state["port"]) if state.get("flags") == "master" else None

    def wait_ready(self, timeout_s: float = 30.0) -> int:
        """Wait until :meth:`in_sync`; returns the primary's port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            primary = self.in_sync()
            if primary is not None:
                return primary
            time.sleep(0.05)
        raise InfrastructureError(f"the Redis HA setup was not in sync within {timeout_s:.0f}s; see the logs in "
                                  f"{self.log_dir}")

    # ------------------------------------------------------------------ failures (tests)
    def failover(self, timeout_s: float = 30.0) -> int:
        """``SENTINEL FAILOVER``: the replica is promoted at once, without waiting for it to catch up (what
        the primary had not sent yet is lost); returns the new primary's port once all is in sync again.

        Sentinel itself turns a live former primary into a replica only 10-20 s later (it waits for two
        INFO rounds); meanwhile clients still connected to it keep writing there, and WAIT refuses their
        epochs. To fail over many times a minute this does what Sentinel would do as soon as the new
        primary is named: REPLICAOF the new primary (writes there then fail with READONLY, and the clients
        ask the Sentinels again)."""
        old = self.wait_ready(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self._client(self.sentinel_ports[0], sentinel=True) as s:
                    s.execute_command("SENTINEL", "FAILOVER", self.service)
                break
            except redis_sync.ResponseError:  # INPROG, NOGOODSLAVE: the Sentinel's view is not there yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        new = self._wait_named(old, deadline)
        with self._client(old) as c:
            c.replicaof(self.host, new)  # read-only now: a client's next write gets READONLY and reconnects
            c.config_rewrite()
        return self._wait_moved(old, deadline)

    def kill_primary(self, timeout_s: float = 30.0) -> int:
        """kill -9 the primary; once Sentinel promoted the replica, start the old one again as its replica.
        Returns the new primary's port."""
        old = self.wait_ready(timeout_s)
        deadline = time.monotonic() + timeout_s
        new = self._kill_and_wait_promoted(old, deadline)
        self.start_server(old, replica_of=new, force_replica_of=True)
        return self.wait_ready(max(1.0, deadline - time.monotonic()))

    def kill_primary_back_as_it_was(self, timeout_s: float = 30.0) -> tuple[int, int]:
        """kill -9 the primary; once Sentinel promoted the replica, start the old one again from its own
        config and AOF — believing it is the primary — and return at once, before Sentinel demotes it:
        (old, new) primary ports. :meth:`wait_ready` then waits until it replicates from the new one."""
        old = self.wait_ready(timeout_s)
        new = self._kill_and_wait_promoted(old, time.monotonic() + timeout_s)
        self.start_server(old)
        return old, new

    def _kill_and_wait_promoted(self, old: int, deadline: float) -> int:
        victim = self.servers[old]
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        return self._wait_named(old, deadline)

    def _wait_named(self, old: int, deadline: float) -> int:
        while time.monotonic() < deadline:
            primary = self.primary_port()
            if primary is not None and primary != old:
                return primary
            time.sleep(0.05)
        raise InfrastructureError(f"Sentinel did not promote a new primary in time; see {self.log_dir}")

    def _wait_moved(self, old: int, deadline: float) -> int:
        while time.monotonic() < deadline:
            primary = self.in_sync()
            if primary is not None and primary != old:
                return primary
            time.sleep(0.05)
        raise InfrastructureError(f"the failover away from :{old} did not settle in time; see {self.log_dir}")
