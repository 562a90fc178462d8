"""Node health and lost allocations, with the scheduler in-process against the real broker and Redis.

The test plays the node agents (heartbeats of two 4-device nodes, WorkerStarted / WorkerExited /
StepMetrics of their ranks) so that which rank runs where, and which one fails or is slow, is
decided by the test: one slow rank yields StragglerDetected naming its node; repeated failures on
one node quarantine it (NodeQuarantined) and nothing is placed there any more until an admin
publishes NodeReinstated; a gang whose GangAllocated never reached the broker is published again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from tests.integration.test_scheduler_stack import EventTap, make_spec, poll
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_runtime.controlrecords import record_control_request
from trainyard_contract.events import (
    DeviceInfo,
    GangAllocated,
    JobControlRequested,
    JobSubmitted,
    NodeHeartbeat,
    NodeQuarantined,
    NodeReinstated,
    StepMetrics,
    StragglerDetected,
    WorkerExited,
    WorkerStarted,
    utcnow,
)
from trainyard_runtime.leases import LeaseManager
from trainyard_contract.records import JobRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_scheduler import Scheduler, SchedulerSettings
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.gang import GangRequest, Placement
from trainyard_scheduler.placement import place
from trainyard_scheduler.topology import ClusterSnapshot
from tests.support.datasets import verified

pytestmark = pytest.mark.asyncio(loop_scope="module")
NODES = ("node-a", "node-b")
WAIT_S = 90.0


@dataclass
class Rig:
    env: dict[str, Any]
    tap: EventTap
    bus: Bus
    store: StateStore
    scheduler: Scheduler

    @property
    def redis(self) -> Any:
        return self.store.redis

    async def cancel(self, job_id: str) -> None:
        """What the API does: record the control request, then its JobControlRequested reaches the broker."""
        event = JobControlRequested(job_id=job_id, tenant="t1", action="cancel")
        await record_control_request(self.redis, event, requested_by="test", at=utcnow())
        await self.bus.publish(event)

    async def submit(self, job_id: str, spec: TrainingSpec, *, max_attempts: int = 3) -> None:
        record = JobRecord(job_id=job_id, tenant="t1", spec=spec, spec_hash=spec.spec_hash(),
                           max_attempts=max_attempts)
        await verified(self.store, spec.dataset)
        assert await self.store.create_job(record)
        await self.bus.publish(JobSubmitted(job_id=job_id, tenant="t1", spec=spec, spec_hash=spec.spec_hash()))

    async def start_ranks(self, gang: GangAllocated) -> None:
        for node in gang.nodes:
            for r in node.ranks:
                await self.bus.publish(WorkerStarted(
                    job_id=gang.job_id, attempt=gang.attempt, allocation_id=gang.allocation_id, epoch=gang.epoch,
                    node_id=node.node_id, rank=r.rank, pid=1000 + r.rank, log_uri="file:///dev/null"))

    async def fail_rank(self, gang: GangAllocated, node_id: str, reason: str) -> None:
        rank = next(r.rank for n in gang.nodes if n.node_id == node_id for r in n.ranks)
        await self.bus.publish(WorkerExited(
            job_id=gang.job_id, attempt=gang.attempt, allocation_id=gang.allocation_id, epoch=gang.epoch,
            node_id=node_id, rank=rank, exit_code=1, reason=reason, detail="NCCL watchdog timeout"))


async def heartbeats(bus: Bus) -> None:
    while True:
        for node in NODES:
            devices = [DeviceInfo(index=i, type="cpu", memory_bytes=16 << 30) for i in range(4)]
            await bus.publish(NodeHeartbeat(node_id=node, host="127.0.0.1", rack="r0", devices=devices))
        await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
def rig_env(kafka_bootstrap: str, redis_server_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import redis as redis_sync

    unique = uuid.uuid4().hex[:10]
    url = f"{redis_server_url.rsplit('/', 1)[0]}/14"
    client = redis_sync.Redis.from_url(url)
    client.flushdb()
    client.close()
    return {"kafka_bootstrap": kafka_bootstrap, "redis_url": url, "topic_namespace": f"t{unique}.",
            "group_prefix": f"g{unique}", "artifact_root": tmp_path_factory.mktemp("health") / "artifacts",
            "topic_partitions": 2}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(rig_env: dict[str, Any]) -> AsyncIterator[Rig]:
    env = rig_env
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    await tap.start()
    bus = Bus(env["kafka_bootstrap"], service_name="test-agents", topic_namespace=env["topic_namespace"])
    await bus.start()
    settings = SchedulerSettings(
        **env, tick_s=0.3, reconcile_interval_s=0.5, retry_backoff_s=0.2, retry_backoff_max_s=0.5,
        instance_id="scheduler-health", republish_after_s=1.0, republish_max=2, start_timeout_s=600,
        straggler_window_steps=5, straggler_windows=2, quarantine_score=1.9, reinstate_score=0.5,
        reputation_half_life_s=3600,
        reputation_per_tenant_cap=None)  # one tenant's jobs on a faulty node: a single-tenant cluster
    runtime = ServiceRuntime("scheduler", settings)
    scheduler = Scheduler(runtime, settings)
    scheduler.install()
    await runtime.start()
    beating = asyncio.create_task(heartbeats(bus))
    redis = connect_redis(env["redis_url"])
    rig = Rig(env, tap, bus, StateStore(redis), scheduler)
    try:
        await poll(lambda: _nodes_ready(rig), "both nodes in the inventory", WAIT_S)
        yield rig
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await scheduler.aclose()
        await runtime.aclose()
        await bus.aclose()
        await tap.stop()
        await redis.aclose()


async def _nodes_ready(rig: Rig) -> bool:
    return len(await rig.scheduler.nodes.available_nodes(utcnow())) == 2


async def test_a_slow_rank_is_reported_and_repeated_failures_quarantine_its_node(rig: Rig) -> None:
    r = rig
    await r.submit("wide", make_spec(8), max_attempts=10)
    (gang,) = await r.tap.wait(GangAllocated, job_id="wide", attempt=1, timeout_s=WAIT_S)
    await r.start_ranks(gang)
    node_of = {rank.rank: n.node_id for n in gang.nodes for rank in n.ranks}

    # Every rank reports each step; rank 6 computes 1.6x longer than the others, for 2 windows of 5 steps.
    for step in range(1, 13):
        for rank in range(8):
            await r.bus.publish(StepMetrics(job_id="wide", attempt=1, rank=rank, step=step, loss=2.0,
                                            consumed_tokens=step * 64, compute_seconds=1.6 if rank == 6 else 1.0,
                                            step_seconds=1.7))
    (slow,) = await r.tap.wait(StragglerDetected, job_id="wide", timeout_s=WAIT_S)
    assert (slow.rank, slow.node_id, slow.attempt) == (6, node_of[6], 1)
    assert slow.slowdown == pytest.approx(1.6) and slow.median_compute_seconds == pytest.approx(1.0)
    assert (slow.window_steps, slow.from_step, slow.to_step) == (10, 0, 9)
    penalties = await r.scheduler.nodes.node_penalties([])
    assert penalties[node_of[6]] == pytest.approx(1.0, abs=0.01)  # a straggler report counts against its node

    # NCCL failures of a rank on node-a, attempt after attempt, until its score reaches 1.9 (two at most).
    victim = "node-a"
    failures = 0
    while True:
        # the durable state decides, not what the tap has seen yet: quarantined, or the next attempt placed
        job = await poll(lambda n=failures + 1: _quarantined_or_live(r, victim, "wide", n),
                         f"attempt {failures + 1} or {victim} quarantined", WAIT_S)
        if job == "quarantined":
            break
        assert failures < 3, f"{victim} not quarantined after {failures} failures"
        copies = await r.tap.wait(GangAllocated, job_id="wide", attempt=job.current.attempt, timeout_s=WAIT_S)
        assert len({c.allocation_id for c in copies}) == 1  # re-published copies name the same allocation
        gang = copies[0]
        await r.start_ranks(gang)
        await r.fail_rank(gang, victim, "nccl")
        failures += 1
        await poll(lambda n=failures: _failed_attempts(r, "wide", n), f"{failures} failed attempt(s)", WAIT_S)
    (quarantined,) = await r.tap.wait(NodeQuarantined, node_id=victim, timeout_s=WAIT_S)
    assert quarantined.by == "reputation" and quarantined.score is not None and quarantined.score >= 1.9
    assert quarantined.until is not None and quarantined.until > utcnow()
    assert "nccl" in quarantined.reason
    assert victim not in {n.node_id for n in await r.scheduler.nodes.available_nodes(utcnow())}

    # The 8-device job needs both nodes: it waits (with a reason) instead of landing on the quarantined one.
    job = await poll(lambda: _queued_with_reason(r, "wide"), "wide waiting for capacity", WAIT_S)
    attempts_then = len(job.attempts)
    assert "8 cpu devices" in (job.queued_reason or ""), job.queued_reason
    await asyncio.sleep(2.0)  # several ticks: still nothing placed
    assert len((await r.store.get_job("wide")).attempts) == attempts_then  # type: ignore[union-attr]  # present here (the test asserts it)
    record = next(n for n in await r.store.list_nodes() if n.node_id == victim)
    assert record.quarantined == quarantined.reason  # shown on the node record too

    # An admin clears it: the job is placed again, on both nodes; the node's score starts from zero.
    await r.bus.publish(NodeReinstated(node_id=victim, reason="NIC replaced", by="admin-alice"))
    again = (await r.tap.wait(GangAllocated, job_id="wide", attempt=attempts_then + 1, timeout_s=WAIT_S))[0]
    assert {n.node_id for n in again.nodes} == set(NODES)
    assert await r.redis.hget(Keys.node_quarantine, victim) is None
    assert await r.redis.hget(Keys.node_reputation, victim) is None


async def _live_attempt(r: Rig, job_id: str, number: int) -> JobRecord | None:
    job = await r.store.get_job(job_id)
    ok = job is not None and tr.is_live(job.current) and job.current is not None and job.current.attempt == number
    return job if ok else None


async def _quarantined_or_live(r: Rig, node_id: str, job_id: str, number: int) -> JobRecord | str | None:
    if await r.redis.hget(Keys.node_quarantine, node_id):
        return "quarantined"
    return await _live_attempt(r, job_id, number)


async def _failed_attempts(r: Rig, job_id: str, count: int) -> bool:
    job = await r.store.get_job(job_id)
    return job is not None and tr.failures(job) >= count


async def _queued_with_reason(r: Rig, job_id: str) -> JobRecord | None:
    job = await r.store.get_job(job_id)
    return job if job is not None and tr.is_pending(job) and job.queued_reason_kind == "capacity" else None


async def test_a_gang_whose_allocation_never_reached_the_broker_is_published_again(rig: Rig) -> None:
    r = rig
    await r.cancel("wide")
    await poll(lambda: _no_leases(r), "the devices of the first test released", WAIT_S)
    spec = make_spec(2)
    # What a scheduler that crashed (or a broker that lost the message) leaves: leases and an attempt
    # recorded, and no GangAllocated on the topic.
    job = JobRecord(job_id="lost-gang", tenant="t1", spec=spec, spec_hash=spec.spec_hash())
    nodes = await r.scheduler.nodes.available_nodes(utcnow())
    held = await r.scheduler.held_allocations()
    leased: dict[str, set[int]] = {}
    for allocation in held.values():
        for d in allocation.devices:
            leased.setdefault(d.node_id, set()).add(d.index)
    placement = place(ClusterSnapshot.build(nodes, leased), GangRequest("cpu", 2))
    assert isinstance(placement, Placement)
    epoch = await LeaseManager(r.redis).acquire("lost-gang", "lost-gang-a1", placement.devices())
    outcome = tr.admit(job, placement=placement, allocation_id="lost-gang-a1", epoch=epoch, master_port=29555,
                       start_checkpoint=None, now=utcnow())
    assert await r.store.create_job(outcome.job)

    again = (await r.tap.wait(GangAllocated, job_id="lost-gang", timeout_s=WAIT_S))[0]
    assert (again.allocation_id, again.epoch, again.attempt) == ("lost-gang-a1", epoch, 1)
    assert again.nodes == placement.assignments() and again.master_port == 29555
    recorded = await r.store.get_job("lost-gang")
    assert recorded is not None and recorded.current is not None and recorded.current.republished >= 1
    await r.start_ranks(again)
    running = await poll(lambda: _running(r, "lost-gang"), "lost-gang running", WAIT_S)
    republished = running.current.republished
    async def all_copies_seen() -> bool:  # every copy it recorded has reached the broker
        return len(r.tap.events(GangAllocated, job_id="lost-gang")) >= republished

    await poll(all_copies_seen, f"{republished} copies of the GangAllocated", WAIT_S)
    await asyncio.sleep(2.5)  # past republish_after_s again: started ranks need no more copies
    after = await r.store.get_job("lost-gang")
    assert after is not None and after.current is not None and after.current.republished == republished
    assert len(r.tap.events(GangAllocated, job_id="lost-gang")) == republished
    assert len({e.allocation_id for e in r.tap.events(GangAllocated, job_id="lost-gang")}) == 1


async def _no_leases(r: Rig) -> bool:
    return not await r.scheduler.held_allocations()


async def _running(r: Rig, job_id: str) -> JobRecord | None:
    job = await r.store.get_job(job_id)
    return job if job is not None and job.state == "running" else None


async def test_auto_checkpoint_policy_hands_the_advised_interval_to_the_next_attempt(rig: Rig) -> None:
    """checkpointPolicy.auto: no advice yet → the spec's starting interval (None on the wire); once
    the coordinator has stored its Young/Daly advice, the next attempt's GangAllocated carries it."""
    r = rig
    for job_id in ("wide", "lost-gang"):
        await r.cancel(job_id)
    await poll(lambda: _no_leases(r), "the devices of earlier tests released", WAIT_S)
    base = make_spec(2, max_steps=100)
    policy = base.checkpoint_policy.model_copy(update={"auto": True, "every_steps": 50})
    spec = base.model_copy(update={"checkpoint_policy": policy})
    await r.submit("auto", spec, max_attempts=5)
    (first,) = await r.tap.wait(GangAllocated, job_id="auto", attempt=1, timeout_s=WAIT_S)
    assert first.checkpoint_every_steps is None  # nothing measured yet: the trainer uses everySteps 50

    await r.redis.set(Keys.checkpoint_advice("auto"), '{"intervalSteps": 7, "intervalSeconds": 12.5}')
    await r.start_ranks(first)
    await r.fail_rank(first, first.nodes[0].node_id, "error")
    (second,) = await r.tap.wait(GangAllocated, job_id="auto", attempt=2, timeout_s=WAIT_S)
    assert second.checkpoint_every_steps == 7
    await r.cancel("auto")


async def test_init_from_starts_the_first_attempt_from_the_parent_jobs_ready_checkpoint(rig: Rig) -> None:
    """A new configuration is a new job linked to the old one: before the child has a READY
    checkpoint of its own, its attempts start from the parent's (the trainer takes the weights);
    a parent checkpoint that is gone fails the child with the reason instead of silently starting
    from scratch."""
    from trainyard_contract.records import CheckpointRecord
    from trainyard_contract.spec import InitFrom

    r = rig
    await poll(lambda: _no_leases(r), "the devices of earlier tests released", WAIT_S)
    parent_spec = make_spec(2)
    parent = JobRecord(job_id="parent", tenant="t1", spec=parent_spec, spec_hash=parent_spec.spec_hash(),
                       state="succeeded")
    assert await r.store.create_job(parent)
    for step, state in ((10, "READY"), (20, "READY"), (30, "FAILED")):
        await r.store.put_checkpoint(CheckpointRecord(
            job_id="parent", tenant="t1", attempt=1, epoch=1, global_step=step, world_size=2, state=state,
            manifest_uri=f"file:///ckpt/parent/step-{step}/manifest.json", content_hash=f"sha256:{step}"))

    child = make_spec(2).model_copy(update={"init_from": InitFrom(job_id="parent")})
    await r.submit("child", child)
    (gang,) = await r.tap.wait(GangAllocated, job_id="child", attempt=1, timeout_s=WAIT_S)
    assert gang.start_checkpoint is not None and gang.start_checkpoint.global_step == 20  # latest READY
    assert gang.start_checkpoint.manifest_uri == "file:///ckpt/parent/step-20/manifest.json"
    await r.cancel("child")
    await poll(lambda: _no_leases(r), "child's devices released", WAIT_S)

    gone = make_spec(2).model_copy(update={"init_from": InitFrom(job_id="parent", global_step=30)})
    await r.submit("orphan", gone)
    failed = await poll(lambda: _in_state(r, "orphan", "failed"), "orphan failed", WAIT_S)
    assert "initFrom: job parent has no READY checkpoint at step 30" in (failed.reason or ""), failed.reason
    assert failed.attempts == []


async def _in_state(r: Rig, job_id: str, state: str) -> JobRecord | None:
    job = await r.store.get_job(job_id)
    return job if job is not None and job.state == state else None
