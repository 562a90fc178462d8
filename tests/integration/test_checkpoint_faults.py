"""Checkpoints become READY within a bound after a fault heals, whatever was restarted in between.

One test per fault that, in the chaos runs, left an attempt training on with none of its
checkpoints becoming READY (issue #11): the coordinator killed with a checkpoint's shards half
collected; Redis killed while the coordinator was settling (between the manifest write and the
READY mark) and its retry back-off; the broker restarted empty with a ShardWritten in flight; the
coordinator restarted while retention runs; and the job that trains on unprotected is flagged
(CheckpointsStalled). The coordinator runs against the real broker and a real Redis — private
ones where a test kills them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.conftest import env_vars
from tests.integration.test_coordinator import (
    Stack,
    given_job,
    publish,
    shard_events,
    start_stack,
    stop_stack,
    wait_for,
    write_shards,
)
from trainyard_checkpoint_coordinator import coordinator as coordinator_module
from trainyard_checkpoint_coordinator.protection import Protection, protection_key
from tests.support.api import client_for, running_api
from trainyard_cli import infra
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_contract.manifest import CheckpointManifest
from trainyard_contract.storage import ArtifactLayout, uri_to_path
from trainyard_runtime.store import Keys, StateStore, connect_redis

pytestmark = pytest.mark.slow

#: Heal → READY: a retry back-off (1 s), a consumer group's rejoin after a broker restart (a few
#: seconds on the embedded broker), a coordinator's start-up on a loaded host.
BOUND_S = 30.0


async def _ready(stack: Stack, job_id: str, step: int, attempt: int = 1) -> Any:
    try:
        record = await stack.record(job_id, step, attempt)
    except RedisConnectionError:  # this client's pooled connection died with a restarted Redis
        return None
    return record if record is not None and record.state == "READY" else None


def _manifest_of(record: Any) -> CheckpointManifest:
    return CheckpointManifest.model_validate_json(uri_to_path(record.manifest_uri).read_bytes())


# --------------------------------------------------------------------------- coordinator killed mid-assembly


class CoordinatorProcess:
    """``python -m trainyard_checkpoint_coordinator`` as a process of its own, killed with -9."""

    def __init__(self, env: dict[str, Any]) -> None:
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, redis: Any) -> float:
        """Start it and wait for its own health beacon; returns when it beaconed (monotonic)."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trainyard_checkpoint_coordinator",
            env={**os.environ, **env_vars(self.env), "TRAINYARD_LOG_LEVEL": "WARNING"},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        beacon = Keys.health("checkpoint-coordinator", f"{socket.gethostname()}:{self.proc.pid}")
        await wait_for(lambda: redis.exists(beacon), timeout_s=120, what="the coordinator's health beacon")
        return time.monotonic()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()


@pytest.fixture
async def publisher(env: dict[str, Any]) -> AsyncIterator[Stack]:
    """A publisher of rank events and the shared stores, without a coordinator (the test runs its own)."""
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    bus = Bus(env["kafka_bootstrap"], service_name="test-ranks", group_prefix=env["group_prefix"],
              topic_namespace=env["topic_namespace"])
    await bus.start()
    redis = connect_redis(env["redis_url"])
    try:
        yield Stack(env, bus, StateStore(redis), tail=None, layout=ArtifactLayout(env["artifact_root"]))  # type: ignore[arg-type]  # a test double
    finally:
        await bus.aclose()
        await redis.aclose()


async def test_a_coordinator_killed_with_shards_half_collected_settles_them_after_its_restart(
        env: dict[str, Any], publisher: Stack) -> None:
    stack = publisher
    job_id = "job-half-collected"
    epoch = await given_job(stack, job_id)
    rank0, rank1 = shard_events(job_id, 40, write_shards(stack, job_id, 40), epoch=epoch)
    first = CoordinatorProcess(env)
    second = CoordinatorProcess(env)
    try:
        await first.start(stack.redis)
        await publish(stack, rank0)
        await wait_for(lambda: stack.redis.hlen(Keys.shards(job_id, 1, 40)), what="rank 0's shard recorded")
        assert (await stack.record(job_id, 40)).state == "PENDING"

        await first.kill()  # one shard collected, the other still to come
        await publish(stack, rank1)  # reported while no coordinator runs: it waits in the broker
        up = await second.start(stack.redis)
        record = await wait_for(lambda: _ready(stack, job_id, 40), timeout_s=BOUND_S + 60, what="READY after restart")
        assert time.monotonic() - up < BOUND_S, "READY took longer than the bound after the coordinator was back"
        assert [s.rank for s in _manifest_of(record).shards] == [0, 1]
        assert await stack.redis.zcard(Keys.pending_checkpoints) == 0
    finally:
        await first.kill()
        await second.kill()


# --------------------------------------------------------------------------- Redis restarted while settling


@pytest.fixture
async def private_redis(env: dict[str, Any], tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """``env`` on a Redis of its own (AOF, fsync always) that the test may kill and start again."""
    port = infra.free_port()
    data, log = tmp_path / "redis", tmp_path / "redis.log"
    server = {"launched": infra.start_redis(port, data, log)}

    def kill() -> None:
        server["launched"].process.kill()
        server["launched"].process.wait(10)

    def restart() -> None:
        server["launched"] = infra.start_redis(port, data, log)

    try:
        yield {**env, "redis_url": f"redis://127.0.0.1:{port}/0", "_kill": kill, "_restart": restart}
    finally:
        server["launched"].stop()


async def test_redis_killed_between_the_manifest_write_and_the_ready_mark_settles_soon_after_it_is_back(
        private_redis: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in private_redis.items() if not k.startswith("_")}
    kill, restart = private_redis["_kill"], private_redis["_restart"]
    real_write = coordinator_module.commit_manifest
    killed_at: list[float] = []

    def write_then_lose_redis(root: Path, path: Path, data: bytes) -> None:
        real_write(root, path, data)
        if not killed_at:  # the manifest is on disk; Redis dies before the READY mark
            killed_at.append(time.monotonic())
            kill()

    monkeypatch.setattr(coordinator_module, "commit_manifest", write_then_lose_redis)
    stack = await start_stack(env)  # shard_report_retry_max_s 1 s (with 10 s, READY came 10.6 s after Redis was back)
    try:
        job_id = "job-redis-mid-settle"
        epoch = await given_job(stack, job_id)
        await publish(stack, *shard_events(job_id, 40, write_shards(stack, job_id, 40), epoch=epoch))
        await wait_for(lambda: killed_at, what="the manifest written and Redis killed")
        await asyncio.sleep(13.0)  # an outage long enough for an uncapped back-off to grow past 6 s
        restart()
        back = time.monotonic()
        record = await wait_for(lambda: _ready(stack, job_id, 40), timeout_s=60, what="READY after Redis is back")
        # the back-off is capped (shard_report_retry_max_s, 1 s): not the 10 s an idle consumer used to sleep
        assert time.monotonic() - back < 5.0, f"READY {time.monotonic() - back:.1f}s after Redis was back"
        assert _manifest_of(record).content_hash == record.content_hash
    finally:
        await stop_stack(stack)


async def test_a_client_of_a_restarted_redis_sends_its_next_command_over_a_fresh_connection(
        private_redis: dict[str, Any]) -> None:
    """Every pooled connection dies with Redis; the first command over each used to fail, seconds
    after the restart (a shard report retried late enough to be fenced: seed 1796110550)."""
    client = connect_redis(private_redis["redis_url"])
    try:
        await asyncio.gather(*(client.set(f"k{i}", i) for i in range(4)))  # several pooled connections
        private_redis["_kill"]()
        private_redis["_restart"]()
        assert [await client.get(f"k{i}") for i in range(4)] == ["0", "1", "2", "3"]  # AOF: nothing lost
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- broker restarted empty


async def test_a_broker_restarted_empty_with_a_shard_report_in_flight_settles_when_it_is_published_again(
        env: dict[str, Any], tmp_path: Path) -> None:
    """The node agent publishes an unconfirmed ShardWritten again (same event id) after a broker
    restart lost it; the coordinator's consumer, never restarted, must pick it up on the new broker."""
    port = infra.free_port()
    broker = infra.start_broker(port, tmp_path / "broker.log")
    env = {**env, "kafka_bootstrap": broker.address}
    stack = await start_stack(env)
    try:
        job_id = "job-broker-restart"
        epoch = await given_job(stack, job_id)
        rank0, rank1 = shard_events(job_id, 40, write_shards(stack, job_id, 40), epoch=epoch)
        await publish(stack, rank0)
        await wait_for(lambda: stack.redis.hlen(Keys.shards(job_id, 1, 40)), what="rank 0's shard recorded")

        broker.process.kill()  # rank 1's report is in flight: lost with the broker's memory
        broker.process.wait(10)
        broker = infra.start_broker(port, tmp_path / "broker.log")
        await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"],
                            namespace=env["topic_namespace"])
        back = time.monotonic()

        async def republish() -> Any:  # the agent's confirmation loop: again, until Redis shows it applied
            if not await stack.redis.hexists(Keys.shards(job_id, 1, 40), "1"):
                try:
                    await asyncio.wait_for(publish(stack, rank1), 5.0)
                except Exception:  # noqa: BLE001 - the producer is reconnecting
                    pass
            return await _ready(stack, job_id, 40)

        record = await wait_for(republish, timeout_s=BOUND_S + 30, what="READY after the broker restart")
        assert time.monotonic() - back < BOUND_S
        assert [s.rank for s in _manifest_of(record).shards] == [0, 1]
    finally:
        await stop_stack(stack)
        broker.stop()


# --------------------------------------------------------------------------- a job that trains on unprotected


async def test_a_job_training_on_without_ready_checkpoints_is_flagged_checkpoints_stalled(env: dict[str, Any]) -> None:
    stack = await start_stack(env, sweep_interval_s=0.2, stall_intervals=3)
    try:
        job_id = "job-unprotected"
        epoch = await given_job(stack, job_id)  # checkpointPolicy.everySteps 20
        await publish(stack, *shard_events(job_id, 20, write_shards(stack, job_id, 20), epoch=epoch))
        await wait_for(lambda: _ready(stack, job_id, 20), what="step 20 READY")

        def metrics(step: int) -> ev.StepMetrics:
            return ev.StepMetrics(job_id=job_id, tenant="acme", attempt=1, rank=0, step=step, max_steps=400,
                                  loss=1.0, lr=1e-3, consumed_tokens=step * 2048, step_seconds=0.1)

        async def protection() -> Protection | None:
            raw = await stack.redis.get(protection_key(job_id))
            return Protection.loads(raw) if raw else None

        await publish(stack, metrics(50))  # 30 steps past the READY one: 1 interval, protected
        fine = await wait_for(lambda: _at_step(protection, 50), what="the condition at step 50")
        assert not fine.stalled and fine.protected_step == 20

        await publish(stack, metrics(81))  # 61 steps: 3 whole intervals without a READY checkpoint
        stalled = await wait_for(lambda: _at_step(protection, 81), what="the condition at step 81")
        assert stalled.stalled and stalled.unprotected_intervals == 3, stalled
        assert "no READY checkpoint for 3 intervals" in stalled.reason
        # the job's owner sees it as a condition of the job (GET /v1/training-jobs/{id})
        async with running_api(env) as api:
            await api.runtime.store.add_token("token-acme", "acme", "ann")
            async with client_for(api.url, "token-acme") as ann:
                body = (await ann.get(f"/v1/training-jobs/{job_id}")).raise_for_status().json()
        (condition,) = body["conditions"]
        assert condition["type"] == "CheckpointsStalled" and condition["attempt"] == 1
        assert condition["unprotectedIntervals"] == 3 and "no READY checkpoint" in condition["reason"]

        await publish(stack, *shard_events(job_id, 80, write_shards(stack, job_id, 80), epoch=epoch))
        await wait_for(lambda: _ready(stack, job_id, 80), what="step 80 READY")
        cleared = await wait_for(lambda: _not_stalled(protection), what="the condition cleared")
        assert cleared.protected_step == 80
    finally:
        await stop_stack(stack)


async def _at_step(probe: Any, step: int) -> Protection | None:
    found = await probe()
    return found if found is not None and found.step == step else None


async def _not_stalled(probe: Any) -> Protection | None:
    found = await probe()
    return found if found is not None and not found.stalled else None
