"""The local stack's Redis: one server (AOF, fsync always) or a failover set (primary, replica, three Sentinels),
started with the ACL users of :mod:`trainyard_cli.redisacl` — one per service, the telemetry service's
included, and the operator — and each user's URL.

``TRAINYARD_REDIS_URL`` replaces all of it with the operator's own Redis (every user then gets that URL).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainyard_cli import infra, redisacl, redisha

__all__ = ["StackRedis"]


class StackRedis:
    """Where the stack's Redis lives (``root``), how it is reached, and how it is started."""

    def __init__(self, root: Path, log_dir: Path, *, port: int, replica_port: int, sentinel_port: int, ha: bool,
                 url: str | None) -> None:
        self.root = root
        self.log_dir = log_dir
        self.port = port
        self.replica_port = replica_port
        self.sentinel_port = sentinel_port
        self.ha = ha
        self.url = url  # the operator's own Redis (TRAINYARD_REDIS_URL), or None: the stack runs one

    @property
    def users_file(self) -> Path:
        return self.root / "redis-users.json"

    def url_for(self, user: str) -> str:
        """Redis as ``user`` sees it: the stack's Redis with that ACL user (TRAINYARD_REDIS_URL when given)."""
        if self.url:
            return self.url
        passwords = redisacl.load_or_create(self.users_file)
        if self.ha:
            return self.failover().url(user, passwords[user])
        return redisacl.url_for(user, passwords[user], host="127.0.0.1", port=self.port)

    def failover(self) -> redisha.RedisHA:
        """The primary, replica and Sentinels of ``TRAINYARD_REDIS_HA`` (see :mod:`trainyard_cli.redisha`)."""
        passwords = redisacl.load_or_create(self.users_file)
        first = self.sentinel_port
        return redisha.RedisHA(self.root / "redis-ha", self.log_dir, (self.port, self.replica_port),
                               (first, first + 1, first + 2), auth=(redisacl.OPERATOR, passwords[redisacl.OPERATOR]))

    def endpoints(self) -> list[str]:
        """What a rank must not reach of it (an operator's Redis: none here, its URL names them)."""
        if self.url:
            return []
        if self.ha:
            ha = self.failover()
            return [f"127.0.0.1:{p}" for p in (*ha.ports, *ha.sentinel_ports)]
        return [f"127.0.0.1:{self.port}"]

    def start(self, alive: set[str], record: Callable[[str, int], None], say: Callable[[str], None]) -> None:
        """Start what is not running of the stack's Redis (nothing with TRAINYARD_REDIS_URL)."""
        if self.url:
            return
        if self.ha:
            self._start_failover(alive, record, say)
        elif "redis" not in alive:
            say(f"starting redis-server (AOF, fsync always) on :{self.port}")
            acl = redisacl.write_acl_file(self.root / "redis" / "users.acl", redisacl.load_or_create(self.users_file))
            launched = infra.start_redis(self.port, self.root / "redis", self.log_dir / "redis.log", acl_file=acl)
            record("redis", launched.process.pid)

    def _start_failover(self, alive: set[str], record: Callable[[str, int], None], say: Callable[[str], None]) -> None:
        ha = self.failover()
        names = [f"redis-{p}" for p in ha.ports] + [f"redis-sentinel-{p}" for p in ha.sentinel_ports]
        if all(n in alive for n in names):
            return
        say(f"starting Redis with failover: redis-server on :{ha.ports[0]} and :{ha.ports[1]} (AOF, fsync "
            f"always; one replicates the other), redis-sentinel on :{', :'.join(map(str, ha.sentinel_ports))}")
        redisacl.write_acl_file(ha.root / "users.acl", redisacl.load_or_create(self.users_file))
        try:
            ha.start(skip=[n for n in names if n in alive])
        finally:  # what did start is recorded even when the rest failed: `make down` stops it
            for launched in (*ha.servers.values(), *ha.sentinels.values()):
                record(launched.name, launched.process.pid)
