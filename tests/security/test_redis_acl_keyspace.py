"""The ACLs generated from the keyspace declaration (trainyard_runtime.keyspace) on a real redis-server: each
service user writes its own key families and reads the ones it is a named reader of, and is refused (NOPERM)
every other write — the node agent above all: no job record, tenant, token, lease, epoch or scheduler key,
not even from a Lua script, and no other service's dedup keys or outbox."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from trainyard_cli import infra, redisacl
from trainyard_runtime import keyspace
from trainyard_runtime.keyspace import FAMILIES, NODE_AGENT, SERVICES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, redis.Redis]]:
    root = tmp_path_factory.mktemp("acl")
    passwords = redisacl.load_or_create(root / "users.json")
    acl = redisacl.write_acl_file(root / "data" / "users.acl", passwords)
    port = infra.free_port()
    server = infra.start_redis(port, root / "data", root / "redis.log", acl_file=acl)
    clients = {u: redis.Redis.from_url(redisacl.url_for(u, passwords[u], host="127.0.0.1", port=port),
                                       decode_responses=True) for u in (*SERVICES, redisacl.OPERATOR)}
    try:
        yield clients
    finally:
        for client in clients.values():
            client.close()
        server.stop()


def _key(family: keyspace.Family, service: str) -> str:
    template = family.template.replace("<service>", service)
    if family.name == "agent-outbox":
        return "ty:outbox:node-agent:n1"
    return keyspace._sample(template)


def _writes(client: redis.Redis, key: str) -> bool:
    try:
        client.set(key, "1")
    except redis.exceptions.NoPermissionError:
        return False
    client.delete(key)
    return True


def _reads(client: redis.Redis, key: str) -> bool:
    try:
        client.get(key)
    except redis.exceptions.NoPermissionError:
        return False
    return True


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_writes_its_families_reads_its_reads_and_is_refused_the_rest(
        users: dict[str, redis.Redis], service: str) -> None:
    client = users[service]
    widened = {f for _, f in keyspace.wider_writes(service)}
    for family in FAMILIES:
        owner = service if family.per_service and service in family.writers else (family.writers or ("-",))[0]
        key = _key(family, owner)
        if service in family.writers:
            assert _writes(client, key), f"{service} cannot write its own {family.name} ({key})"
        elif family.name not in widened:
            assert not _writes(client, key), f"{service} may write {family.name} ({key}) it does not own"
        if service in family.readers:
            assert _reads(client, key), f"{service} cannot read {family.name} ({key}), a declared read"
    for other in SERVICES:
        if other != service:  # the per-service families: never another service's
            for name in ("outbox", "health", "stuck", "seen"):
                key = _key(keyspace.family(name), other)
                assert not _writes(client, key) and not _reads(client, key), (service, key)
    assert not _writes(client, "not-trainyard") and not _reads(client, "ty:undeclared")


def test_the_node_agent_cannot_touch_what_it_does_not_own(users: dict[str, redis.Redis]) -> None:
    agent, operator = users[NODE_AGENT], users[redisacl.OPERATOR]
    operator.set("ty:job:job-1", '{"state": "RUNNING"}')
    for key in ("ty:job:job-1", "ty:job:job-1:control", "ty:tenants", "ty:tokens", "ty:sched:leader",
                "ty:sched:leader-epoch", "ty:lease:n1:0", "ty:epoch:job-1", "ty:alloc:a1", "ty:nodes",
                "ty:sched:node-drain", "ty:ckpt:job-1", "ty:seen:scheduler:trainyard.scheduler:e1",
                "ty:outbox:scheduler", "ty:changes", "ty:sched:incoming"):
        assert not _writes(agent, key), key
    assert agent.get("ty:job:job-1")  # it reads the job records it is handed
    for command in (lambda: agent.hset("ty:tokens", "digest", "{}"), lambda: agent.delete("ty:job:job-1"),
                    lambda: agent.incr("ty:epoch:job-1"), lambda: agent.xadd("ty:changes", {"kind": "job"}),
                    lambda: agent.eval("return redis.call('SET', KEYS[1], '1')", 1, "ty:sched:leader"),
                    lambda: agent.eval("return redis.call('SET', 'ty:tenants', '1')", 1, "ty:agent:n1:epochs"),
                    lambda: agent.flushall()):
        with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|no permissions|can't access"):
            command()  # NoPermissionError, or a script's error reply naming the refused key
    assert operator.get("ty:job:job-1") == '{"state": "RUNNING"}' and not operator.exists("ty:sched:leader")
    with agent.pipeline(transaction=True) as pipe:  # its own keys, as it writes them (MULTI/EXEC)
        pipe.hset("ty:agent:n1:epochs", "job-1", 3).sadd("ty:agent:n1:launched", "a1").execute()
    assert agent.hget("ty:agent:n1:epochs", "job-1") == "3"


def test_channels_are_the_declared_ones(users: dict[str, redis.Redis]) -> None:
    for service in SERVICES:
        users[service].publish("ty:bus:doorbell", "trainyard.jobs")
        with pytest.raises(redis.exceptions.NoPermissionError):
            users[service].publish("ty:other-channel", "x")
