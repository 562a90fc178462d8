"""The fenced leader lease and the fenced device-lease scripts, against the real Redis."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from trainyard_contract.errors import FencingError, LeaseConflictError
from trainyard_runtime.leases import Device
from trainyard_runtime.store import Keys, connect_redis
from trainyard_scheduler.fencing import FencedLeases, LeaderKeys, Leadership
from trainyard_scheduler.policy import UNLIMITED

D = [Device("n1", 0), Device("n1", 1)]


@pytest.fixture
async def redis(env: dict[str, Any]) -> Any:
    client = connect_redis(env["redis_url"])
    try:
        yield client
    finally:
        await client.aclose()


async def test_leadership_moves_with_an_increasing_epoch(redis: Any) -> None:
    a = Leadership(redis, "a", ttl_s=30)
    b = Leadership(redis, "b", ttl_s=30)
    assert await a.maintain() == 1
    assert await b.maintain() is None
    assert await a.maintain() == 1  # renewal keeps the epoch
    await _lapse(redis, LeaderKeys.leader)  # a stops renewing (paused, partitioned, dead): its TTL runs out
    assert await b.maintain() == 2
    assert await a.maintain() is None and a.epoch is None
    assert await Leadership(redis, "a", ttl_s=30).current() == (2, "b")
    await a.resign()  # not the holder: changes nothing
    assert await redis.get(LeaderKeys.leader) == "2 b"
    await b.resign()
    assert await redis.get(LeaderKeys.leader) is None
    assert await a.maintain() == 3  # the epoch never goes back


async def _lapse(redis: Any, *keys: str) -> None:
    """Let keys expire as an unrenewed TTL would (Redis expires them, not the test's clock)."""
    for key in keys:
        assert await redis.pexpire(key, 1)
    for key in keys:
        while await redis.exists(key):
            await asyncio.sleep(0.01)


async def test_a_restarted_instance_with_the_same_id_takes_over_at_once(redis: Any) -> None:
    first = Leadership(redis, "sched", ttl_s=30)
    assert await first.maintain() == 1
    again = Leadership(redis, "sched", ttl_s=30)  # same instance id after a restart: no wait for the TTL
    assert await again.maintain() == 2
    with pytest.raises(FencingError, match="STALE_LEADER"):  # the old incarnation's writes are fenced
        await FencedLeases(redis).acquire(1, "j", "j-a1", D)


async def test_grants_need_the_current_leader_epoch(redis: Any) -> None:
    leases = FencedLeases(redis)
    leader = Leadership(redis, "a", ttl_s=30)
    epoch = await leader.maintain()
    assert epoch == 1
    assert await leases.acquire(epoch, "j1", "j1-a1", D) == 1
    assert await leases.acquire(epoch, "j1", "j1-a1", D) == 1  # idempotent
    with pytest.raises(LeaseConflictError):
        await leases.acquire(epoch, "j2", "j2-a1", [Device("n1", 1), Device("n1", 2)])
    assert await redis.get(Keys.lease("n1", 2)) is None  # all or nothing
    await redis.delete(LeaderKeys.leader)
    assert await Leadership(redis, "b", ttl_s=30).maintain() == 2
    with pytest.raises(FencingError, match="STALE_LEADER"):
        await leases.acquire(epoch, "j3", "j3-a1", [Device("n2", 0)])
    assert await redis.get(Keys.lease("n2", 0)) is None
    with pytest.raises(FencingError, match="STALE_LEADER"):
        await leases.release("j1-a1", 1, D, leader_epoch=epoch)
    assert await leases.release("j1-a1", 1, D) == 2  # a fact-driven release needs no leadership
    audit = [f for _, f in await redis.xrange(Keys.lease_audit)]
    assert [(f["op"], f["allocation"]) for f in audit] == [("grant", "j1-a1"), ("release", "j1-a1")]
    assert audit[0]["leader"] == "1"


async def test_lease_ttls_are_renewed_and_restored(redis: Any) -> None:
    leases = FencedLeases(redis, ttl_ms=60_000)
    epoch = await Leadership(redis, "a", ttl_s=30).maintain()
    assert epoch is not None
    job_epoch = await leases.acquire(epoch, "j1", "j1-a1", D)
    assert 0 < await redis.pttl(Keys.lease("n1", 0)) <= 60_000
    for _ in range(3):  # each heartbeat puts the full TTL back
        for index in (0, 1):
            await redis.pexpire(Keys.lease("n1", index), 500)
        assert await leases.renew_node("n1", [0, 1, 2]) == 2
        assert await redis.pttl(Keys.lease("n1", 0)) > 500 and await redis.pttl(Keys.lease("n1", 1)) > 500
    assert await redis.get(Keys.lease("n1", 0)) is not None
    await _lapse(redis, Keys.lease("n1", 0), Keys.lease("n1", 1))  # no heartbeat: they expire
    assert await redis.get(Keys.lease("n1", 0)) is None
    assert await leases.restore(epoch, "j1-a1", job_epoch, D) == (2, 0)
    holder = json.loads(await redis.get(Keys.lease("n1", 1)))
    assert holder == {"jobId": "j1", "allocationId": "j1-a1", "epoch": job_epoch}
    assert await leases.restore(epoch, "j1-a1", job_epoch, D) == (0, 0)
    await leases.release("j1-a1", job_epoch, D)
    assert await leases.restore(epoch, "j1-a1", job_epoch, D) == (0, 0)  # released stays released
    ops = [f["op"] for _, f in await redis.xrange(Keys.lease_audit)]
    assert ops == ["grant", "restore", "release"]


async def test_queue_config_comes_from_redis_first_then_the_file(redis: Any, env: dict[str, Any],
                                                                 tmp_path: Any) -> None:
    from types import SimpleNamespace

    from trainyard_runtime.outbox import Outbox
    from trainyard_runtime.store import StateStore
    from trainyard_scheduler import Scheduler, SchedulerSettings

    path = tmp_path / "queue.yaml"
    path.write_text("tenants: {a: {quotas: {cpu: {guaranteed: 4, borrowLimit: 0}}}}\n")
    runtime = SimpleNamespace(redis=redis, store=StateStore(redis), outbox=Outbox(redis, "scheduler"), instance="s")
    scheduler = Scheduler(runtime, SchedulerSettings(redis_url=env["redis_url"], queue_config=path))  # type: ignore[arg-type]  # a SimpleNamespace runtime
    await scheduler.load_queue_config()
    assert scheduler.queue.cap("a", "cpu") == 4
    await redis.delete(Keys.tenant_config)  # the file seeded tenant a's settings: start without them again
    await redis.set(Keys.queue_config, json.dumps({"tenants": {"a": {"quotas": {"cpu": {"guaranteed": 8,
                                                                                         "borrowLimit": 0}}}}}))
    await scheduler.load_queue_config()
    assert scheduler.queue.cap("a", "cpu") == 8  # Redis wins
    await redis.set(Keys.queue_config, "tenants: [broken")
    await scheduler.load_queue_config()
    assert scheduler.queue.cap("a", "cpu") == 8  # a bad document keeps the last good one
    await redis.delete(Keys.queue_config)
    await redis.delete(Keys.tenant_config)
    await scheduler.load_queue_config()
    assert scheduler.queue.cap("a", "cpu") == 4  # back to the file


async def test_a_tenants_settings_set_through_the_api_win_over_the_file_without_a_restart(
        redis: Any, env: dict[str, Any], tmp_path: Any) -> None:
    from types import SimpleNamespace

    from trainyard_runtime.outbox import Outbox
    from trainyard_runtime.store import StateStore
    from trainyard_scheduler import Scheduler, SchedulerSettings

    path = tmp_path / "queue.yaml"
    path.write_text("tenants: {a: {quotas: {cpu: {guaranteed: 4, borrowLimit: 0}}}}\n")
    runtime = SimpleNamespace(redis=redis, store=StateStore(redis), outbox=Outbox(redis, "scheduler"), instance="s")
    scheduler = Scheduler(runtime, SchedulerSettings(redis_url=env["redis_url"], queue_config=path))  # type: ignore[arg-type]  # a SimpleNamespace runtime
    await scheduler.load_queue_config()
    seeded = json.loads(await redis.hget(Keys.tenant_config, "a"))
    assert seeded["quotas"]["cpu"] == {"guaranteed": 4, "borrowLimit": 0}  # the file seeds what is not stored
    # what PATCH /v1/admin/tenants/a and POST /v1/admin/tenants (tenant b) write
    await redis.hset(Keys.tenant_config, mapping={
        "a": json.dumps({"quotas": {"cpu": {"guaranteed": 2, "borrowLimit": 1}}, "maxPriority": 5}),
        "b": json.dumps({"quotas": {"cpu": {"guaranteed": 1, "borrowLimit": 0}}})})
    path.write_text("tenants: {a: {quotas: {cpu: {guaranteed: 40, borrowLimit: 0}}}}\n")  # only a seed now
    await scheduler.load_queue_config()
    assert scheduler.queue.cap("a", "cpu") == 3 and scheduler.queue.priority("a", 100) == 5
    assert scheduler.queue.cap("b", "cpu") == 1
    await redis.hset(Keys.tenant_config, "b", "{broken")
    await scheduler.load_queue_config()
    assert scheduler.queue.cap("b", "cpu") == UNLIMITED  # unreadable: logged, and b gets the defaults


async def test_an_auto_checkpoint_policy_gets_the_advised_interval(redis: Any, env: dict[str, Any]) -> None:
    from types import SimpleNamespace

    from tests.integration.test_scheduler_stack import make_spec
    from trainyard_runtime.outbox import Outbox
    from trainyard_contract.records import JobRecord
    from trainyard_runtime.store import StateStore
    from trainyard_scheduler import Scheduler, SchedulerSettings

    runtime = SimpleNamespace(redis=redis, store=StateStore(redis), outbox=Outbox(redis, "scheduler"), instance="s")
    scheduler = Scheduler(runtime, SchedulerSettings(redis_url=env["redis_url"]))  # type: ignore[arg-type]  # a SimpleNamespace runtime
    wire = make_spec(2).wire()
    wire["checkpointPolicy"] = {"auto": True}
    auto = make_spec(2).model_validate(wire)
    job = JobRecord(job_id="j", tenant="t", spec=auto, spec_hash=auto.spec_hash())
    assert await scheduler.admission.advised_interval(job) is None  # no advice yet: the spec's interval
    await redis.set(Keys.checkpoint_advice("j"), json.dumps({"jobId": "j", "intervalSteps": 37}))
    assert await scheduler.admission.advised_interval(job) == 37
    fixed = job.model_copy(update={"spec": make_spec(2)})
    assert await scheduler.admission.advised_interval(fixed) is None  # only with auto
