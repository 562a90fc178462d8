"""The local stack's Redis ACL against a real redis-server: anonymous clients are refused, service
users reach trainyard's keys only and no @dangerous command, and — the one that lost data once —
what services wrote in MULTI/EXEC blocks and Lua scripts survives a restart (the AOF is replayed as
the default user: restricting it makes redis-server refuse the replayed transactions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from trainyard_cli import infra, redisacl

pytestmark = pytest.mark.integration


def test_acl_users_are_fenced_and_their_transactions_survive_a_restart(tmp_path: Path) -> None:
    passwords = redisacl.load_or_create(tmp_path / "users.json")
    acl = redisacl.write_acl_file(tmp_path / "data" / "users.acl", passwords)
    port = infra.free_port()

    def url(user: str) -> str:
        return redisacl.url_for(user, passwords[user], host="127.0.0.1", port=port)

    server = infra.start_redis(port, tmp_path / "data", tmp_path / "redis.log", acl_file=acl)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).get("ty:jobs")  # a training script without credentials
        scheduler = redis.Redis.from_url(url("scheduler"))
        with scheduler.pipeline(transaction=True) as pipe:  # MULTI/EXEC, as the outbox and the stores write
            pipe.hset("ty:job:j1", "state", "running").incr("ty:epoch:j1").execute()
        scheduler.eval("return redis.call('SET', KEYS[1], ARGV[1])", 1, "ty:lease:n1:0", "alloc-1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            scheduler.set("not-trainyard", 1)  # outside ~ty:*
        with pytest.raises(redis.exceptions.NoPermissionError):
            scheduler.flushall()  # @dangerous
        scheduler.close()
    finally:
        server.stop()

    server = infra.start_redis(port, tmp_path / "data", tmp_path / "redis-2.log", acl_file=acl)
    try:
        operator = redis.Redis.from_url(url("operator"), decode_responses=True)
        assert operator.hget("ty:job:j1", "state") == "running"
        assert operator.get("ty:epoch:j1") == "1"  # fencing epochs never go backwards across a restart
        assert operator.get("ty:lease:n1:0") == "alloc-1"
        operator.close()
        assert "NOPERM" not in (tmp_path / "redis-2.log").read_text()
    finally:
        server.stop()
