"""The scheduler's paths made for cluster scale (bench/cluster_scale), on a real Redis: routine heartbeats are
written together (their leases renewed, their time advanced, a drain or a new node still applied at once), and
why queued jobs wait is written for many records in one round trip — only where the record is still the one
read, and never by a stale leader; the periodic repair beside the passes never takes a grant a pass is still
writing the attempt of for an orphan."""

from __future__ import annotations

from datetime import timedelta

import pytest
from redis.asyncio import Redis

from trainyard_contract.errors import StaleLeaderError
from trainyard_contract.events import DeviceInfo, NodeHeartbeat, utcnow
from trainyard_contract.records import JobRecord, NodeRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import Keys, StateStore
from trainyard_scheduler import SchedulerSettings
from trainyard_scheduler.fencing import FencedLeases
from trainyard_scheduler.jobtx import JobTransactions
from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.node_health import NodeHealth
from trainyard_scheduler.snapshot import SnapshotCache
from tests.support.api import spec_with
from tests.support.scheduler import SchedulerRuntime

pytestmark = pytest.mark.integration
TTL_MS = 60_000


def beat(node: str, *, seconds: float = 0.0, draining: bool = False, boot: str = "b1") -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, host=f"h-{node}", rack="r0", boot_id=boot, draining=draining,
                         devices=[DeviceInfo(index=i, type="cpu", memory_bytes=1) for i in range(2)],
                         occurred_at=utcnow() + timedelta(seconds=seconds))


def health(redis: Redis) -> NodeHealth:
    return NodeHealth(redis, StateStore(redis), Outbox(redis, "scheduler"), FencedLeases(redis, ttl_ms=TTL_MS),
                      SnapshotCache(redis, clock=utcnow), SchedulerSettings(), clock=utcnow, recent_s=3600.0,
                      wake_at=lambda _when: None)


async def stored(redis: Redis, node: str) -> NodeRecord:
    raw = await redis.hget(Keys.nodes, node)
    assert raw is not None
    return NodeRecord.model_validate_json(raw)


async def test_routine_heartbeats_are_written_together_and_renew_the_nodes_leases(redis: Redis) -> None:
    nodes = health(redis)
    first = beat("n1", seconds=-3.0)  # times in the past: the scheduler takes none later than its own clock
    await nodes.on_heartbeat(first)  # a node this instance has not seen: applied at once
    assert (await stored(redis, "n1")).last_seen == first.occurred_at
    await redis.set(Keys.lease("n1", 0), '{"allocationId": "a1", "jobId": "j1", "epoch": 1}', px=1000)

    later = beat("n1", seconds=-1.0)
    await nodes.on_heartbeat(later)
    await nodes.on_heartbeat(beat("n1", seconds=-2.0))  # an older one delivered late changes nothing
    assert (await stored(redis, "n1")).last_seen == first.occurred_at  # kept until the flush
    await nodes.flush_heartbeats()
    assert (await stored(redis, "n1")).last_seen == later.occurred_at
    assert await redis.pttl(Keys.lease("n1", 0)) > 1000  # renewed to the lease TTL


async def test_a_drain_or_a_new_incarnation_is_applied_at_once_and_mirrors_follow_redis(redis: Redis) -> None:
    nodes = health(redis)
    await nodes.on_heartbeat(beat("n2", seconds=-4.0))
    await nodes.on_heartbeat(beat("n2", seconds=-3.0, draining=True))  # not held for the flush
    assert await redis.hget(Keys.node_drain, "n2") is not None
    assert (await stored(redis, "n2")).drained is not None
    await nodes.on_heartbeat(beat("n2", seconds=-2.0, boot="b2"))  # the agent restarted: the drain ends now
    assert await redis.hget(Keys.node_drain, "n2") is None
    # an admin's quarantine written meanwhile shows in the record the flush writes
    await redis.hset(Keys.node_quarantine, "n2", '{"reason": "bad memory", "by": "admin"}')
    await nodes.on_heartbeat(beat("n2", seconds=-1.0, boot="b2"))
    await nodes.flush_heartbeats()
    record = await stored(redis, "n2")
    assert record.quarantined == "bad memory" and record.drained is None


def queued(job_id: str) -> JobRecord:
    spec = TrainingSpec.model_validate(spec_with())
    return JobRecord(job_id=job_id, tenant="t1", spec=spec, spec_hash=spec.spec_hash())


async def test_wait_notes_are_written_in_one_round_trip_where_the_record_is_unchanged(redis: Redis) -> None:
    store, jobs = StateStore(redis), JobTransactions(redis, Outbox(redis, "scheduler"))
    await redis.set(SchedulerKeys.leader_epoch, 7)
    read = {}
    for job_id in ("q1", "q2", "q3"):
        await store.create_job(queued(job_id))
        read[job_id] = await redis.get(Keys.job(job_id))
    # q2 changes after it was read: its note is not written over the change
    await store.put_job(queued("q2").model_copy(update={"state": "cancelled"}))
    noted = {j: queued(j).model_copy(update={"queued_reason": f"waiting {j}", "queued_reason_kind": "capacity"})
             for j in read}
    before = await redis.xlen(Keys.changes)
    written = await jobs.write_if_unchanged([(j, read[j], noted[j].dumps()) for j in read], fence=7)
    assert written == {"q1", "q3"}
    assert (await store.get_job("q1")).queued_reason == "waiting q1"
    assert (await store.get_job("q2")).state == "cancelled"
    assert await redis.xlen(Keys.changes) == before + 2  # each written record's change-log entry

    await redis.set(SchedulerKeys.leader_epoch, 8)  # another leader took over
    with pytest.raises(StaleLeaderError):
        await jobs.write_if_unchanged([("q3", noted["q3"].dumps(), queued("q3").dumps())], fence=7)
    assert (await store.get_job("q3")).queued_reason == "waiting q3"


async def test_the_repair_beside_the_passes_never_releases_a_grant_whose_attempt_a_pass_is_writing(
        redis: Redis) -> None:
    """The periodic repair runs beside the passes; a pass's admission grants the leases before it writes the
    attempt. The repair's lease step waits for the pass (the lock it holds), so the grant is not taken for an
    orphan and released under the gang that is about to start."""
    import asyncio
    from trainyard_contract.devices import Device
    from trainyard_scheduler import Scheduler
    from trainyard_scheduler import transitions as tr
    from trainyard_scheduler.gang import GangRequest, Placement
    from trainyard_scheduler.placement import place
    from trainyard_scheduler.topology import ClusterSnapshot, NodeView

    store = StateStore(redis)
    s = Scheduler(SchedulerRuntime(redis, store, Outbox(redis, "scheduler"), "sched-a"),
                  SchedulerSettings(lease_ttl_s=60, reconcile_interval_s=5), clock=utcnow)
    await s.tick()  # the leader, its term's first repair made in the pass
    epoch = s.leader.epoch
    assert epoch is not None
    spec = TrainingSpec.model_validate(spec_with(**{"resources.gpuType": "cpu", "resources.gpuCount": 1,
                                                    "parallelism.data": 1}))
    job = JobRecord(job_id="j-mid", tenant="t1", spec=spec, spec_hash=spec.spec_hash())
    assert await store.create_job(job)
    devices = (DeviceInfo(index=0, type="cpu", memory_bytes=1 << 30),)
    placed = place(ClusterSnapshot((NodeView("n1", "127.0.0.1", devices),)), GangRequest("cpu", 1))
    assert isinstance(placed, Placement)

    async with s.reconciler.snapshot_lock:  # a pass, mid-admission
        lease_epoch = await s.leases.acquire(epoch, "j-mid", "j-mid-a1", [Device("n1", 0)])
        s.reconciler._next = utcnow() - timedelta(seconds=1)  # noqa: SLF001 - the repair is due now
        repair = asyncio.create_task(s.cycle.repair())
        for _ in range(500):  # until the repair waits for the pass (or, were it not to wait, has finished)
            if s.reconciler.snapshot_lock._waiters or repair.done():  # noqa: SLF001 - asyncio.Lock's waiters
                break
            await asyncio.sleep(0.01)
        assert "j-mid-a1" in {a.allocation_id for a in (await s.held_allocations()).values()}
        admitted = tr.admit(job, placement=placed, allocation_id="j-mid-a1", epoch=lease_epoch, master_port=29500,
                            start_checkpoint=None, now=utcnow())
        await redis.set(Keys.job("j-mid"), admitted.job.model_dump_json(by_alias=True))  # the attempt written
    await repair
    assert "j-mid-a1" in {a.allocation_id for a in (await s.held_allocations()).values()}  # not an orphan
    # a grant whose attempt was never written is one, and the next repair releases it
    await s.leases.acquire(epoch, "j-lost", "j-lost-a1", [Device("n1", 1)])
    s.reconciler._next = utcnow() - timedelta(seconds=1)  # noqa: SLF001
    await s.cycle.repair()
    assert {a.allocation_id for a in (await s.held_allocations()).values()} == {"j-mid-a1"}
