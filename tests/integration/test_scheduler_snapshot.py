"""The leader's snapshot (snapshot.py) on a real Redis: it follows the change log, reloads when the log was
trimmed past it, counts what a reload had to repair, leaves out a lease whose attempt it saw end (its
release follows) but keeps an orphan; and a running scheduler places a job that exists only as a record
and its change-log entry — no JobSubmitted on the bus — because the log itself wakes the pass."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from trainyard_contract.events import DeviceInfo, NodeHeartbeat, utcnow
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys, StateStore
from trainyard_scheduler import Scheduler, SchedulerSettings
from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.snapshot import SNAPSHOT_REPAIRS, SnapshotCache
from tests.support.api import spec_with
from tests.support.datasets import verified

pytestmark = pytest.mark.integration


def job(job_id: str, **fields: Any) -> JobRecord:
    spec = TrainingSpec.model_validate(spec_with())
    return JobRecord(job_id=job_id, tenant="t1", spec=spec, spec_hash=spec.spec_hash(), **fields)


def running(job_id: str, allocation_id: str, devices: list[str]) -> JobRecord:
    return job(job_id, state="running", attempts=[AttemptRecord(
        attempt=1, allocation_id=allocation_id, epoch=1, world_size=len(devices), state="running",
        nodes=sorted({d.rsplit(":", 1)[0] for d in devices}), devices=devices)])


async def test_the_snapshot_follows_the_change_log_and_reloads_when_it_was_trimmed(redis: Redis) -> None:
    store = StateStore(redis)
    cache = SnapshotCache(redis, clock=utcnow)
    assert (await cache.refresh()).jobs == {}

    await store.create_job(job("job-a"))  # with its change-log entry, as every writer does
    view = await cache.refresh()
    assert set(view.jobs) == {"job-a"} and view.new_jobs == ("job-a",)
    cache.accepted.add("job-a")
    assert (await cache.refresh()).new_jobs == ()  # nothing changed: nothing re-read, nothing new

    await store.put_job(job("job-a", state="cancelled"))
    assert (await cache.refresh()).jobs == {}  # terminal: out of the snapshot

    # a log trimmed past the cursor: everything is reloaded (the active set, then the records)
    await store.create_job(job("job-b"))
    await redis.sadd(SchedulerKeys.active, "job-b")
    await redis.xtrim(Keys.changes, maxlen=0)
    await store.create_job(job("job-c"))
    view = await cache.refresh()
    assert set(view.jobs) == {"job-b", "job-c"}

    # a record changed without its entry is what the incremental path cannot see; a reload repairs it
    before = SNAPSHOT_REPAIRS.labels("jobs")._value.get()
    await redis.set(Keys.job("job-b"), job("job-b", state="failed").dumps())
    assert "job-b" in (await cache.refresh()).jobs
    assert await cache.verify() == 1
    assert SNAPSHOT_REPAIRS.labels("jobs")._value.get() == before + 1
    assert set((await cache.refresh()).jobs) == {"job-c"}


async def test_a_lease_whose_attempt_ended_is_left_out_but_an_orphan_is_kept(redis: Redis) -> None:
    store = StateStore(redis)
    leases = LeaseManager(redis)
    await store.put_job(running("job-r", "alloc-r", ["n1:0"]))
    await store.put_job(job("job-o"))  # queued; a crashed leader left a lease for it (an orphan)
    await redis.sadd(SchedulerKeys.active, "job-r", "job-o")
    await leases.acquire("job-r", "alloc-r", [Device("n1", 0)])
    await leases.acquire("job-o", "alloc-o", [Device("n1", 1)])
    cache = SnapshotCache(redis, clock=utcnow)
    assert set((await cache.refresh()).held) == {"alloc-r", "alloc-o"}

    ended = running("job-r", "alloc-r", ["n1:0"])
    assert ended.current is not None
    ended.current.state = "failed"
    ended.state = "queued"
    await store.put_job(ended)  # the attempt ended; its lease key is still there until the release
    assert await redis.exists(Keys.lease("n1", 0))
    assert set((await cache.refresh()).held) == {"alloc-o"}

    await cache.rescan_leases()  # a scan believes the keys again
    assert set((await cache.refresh()).held) == {"alloc-r", "alloc-o"}


@pytest.fixture
async def scheduler(env: dict[str, Any]) -> AsyncIterator[Scheduler]:
    settings = SchedulerSettings(**env, tick_s=3600, reconcile_interval_s=3600, instance_id="snapshot-test")
    runtime = ServiceRuntime("scheduler", settings)
    s = Scheduler(runtime, settings)
    s.install()
    await runtime.start()
    try:
        yield s
    finally:
        await s.aclose()
        await runtime.aclose()


async def test_a_stored_job_is_placed_without_its_event_because_the_change_log_wakes_the_pass(
        scheduler: Scheduler) -> None:
    await scheduler.nodes.on_heartbeat(NodeHeartbeat(node_id="n1", host="h1", devices=[
        DeviceInfo(index=i, type="cpu", memory_bytes=1 << 34) for i in range(4)]))
    spec = TrainingSpec.model_validate(spec_with())
    await verified(scheduler.store, spec.dataset)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while scheduler.leader_epoch is None and loop.time() < deadline:  # the first tick takes the lease
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # that pass is over: the next one is an hour away unless something wakes it

    await scheduler.store.create_job(job("job-quiet"))  # what the API's submission writes; no event follows
    placed = None
    while placed is None and loop.time() < deadline:
        record = await scheduler.store.get_job("job-quiet")
        placed = record if record is not None and record.current is not None else None
        await asyncio.sleep(0.05)
    assert placed is not None and placed.current is not None, await scheduler.store.get_job("job-quiet")
    assert placed.current.nodes == ["n1"]
    assert "job-quiet" in await scheduler.redis.smembers(SchedulerKeys.active)  # taken in, as its event would
