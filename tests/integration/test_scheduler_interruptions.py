"""A planned stop is not a failure; blame needs evidence; quarantine has a floor — the scheduler in-process
against the real broker and Redis, the test playing the node agents (as in test_scheduler_health.py).

* every node silent at once → the attempt is interrupted (control plane), nobody is blamed, no failure
  budget is spent, and it resumes once the nodes are back;
* a drained node: its attempt checkpoints on request and stops, interrupted by maintenance; the next
  attempt starts from that checkpoint elsewhere; nothing new goes there until it is undrained (or its
  agent restarts);
* a node that keeps failing is quarantined, but not the last node of its type (an alert instead), and a
  job waiting because every node is quarantined says so, naming the nodes and the command to reinstate.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.integration.test_scheduler_health import Rig
from tests.integration.test_scheduler_stack import EventTap, make_spec, poll
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_contract.events import (
    CheckpointReady,
    CheckpointRequested,
    DeviceInfo,
    GangAllocated,
    NodeDrained,
    NodeHeartbeat,
    NodeQuarantined,
    NodeReinstated,
    NodeUndrained,
    WorkerExited,
)
from trainyard_contract.records import CheckpointRecord, JobRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_scheduler import Scheduler, SchedulerSettings
from trainyard_scheduler import transitions as tr

pytestmark = pytest.mark.asyncio(loop_scope="module")
NODES = ("node-a", "node-b")
WAIT_S = 90.0


class Beats:
    """Heartbeats of the two test nodes; the test silences, drains or restarts them."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.silent: set[str] = set()
        self.draining: set[str] = set()
        self.boot = {n: uuid.uuid4().hex for n in NODES}

    async def run(self) -> None:
        while True:
            for node in NODES:
                if node in self.silent:
                    continue
                devices = [DeviceInfo(index=i, type="cpu", memory_bytes=16 << 30) for i in range(4)]
                await self.bus.publish(NodeHeartbeat(node_id=node, host="127.0.0.1", rack="r0", devices=devices,
                                                     draining=node in self.draining, boot_id=self.boot[node]))
            await asyncio.sleep(0.3)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(kafka_bootstrap: str, redis_server_url: str,
              tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Rig, Beats]]:
    import redis as redis_sync

    unique = uuid.uuid4().hex[:10]
    url = f"{redis_server_url.rsplit('/', 1)[0]}/13"
    client = redis_sync.Redis.from_url(url)
    client.flushdb()
    client.close()
    env: dict[str, Any] = {"kafka_bootstrap": kafka_bootstrap, "redis_url": url, "topic_namespace": f"i{unique}.",
                           "group_prefix": f"g{unique}", "topic_partitions": 2,
                           "artifact_root": tmp_path_factory.mktemp("interruptions") / "artifacts"}
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    await tap.start()
    bus = Bus(env["kafka_bootstrap"], service_name="test-agents", topic_namespace=env["topic_namespace"])
    await bus.start()
    settings = SchedulerSettings(
        **env, tick_s=0.3, reconcile_interval_s=0.5, retry_backoff_s=0.2, retry_backoff_max_s=0.5,
        instance_id="scheduler-interruptions", start_timeout_s=600, node_timeout_s=2.0, lease_ttl_s=60,
        quarantine_score=1.9, reinstate_score=0.5, reputation_half_life_s=3600, pause_grace_s=120,
        reputation_per_tenant_cap=None)  # one tenant's jobs on a faulty node: a single-tenant cluster
    runtime = ServiceRuntime("scheduler", settings)
    scheduler = Scheduler(runtime, settings)
    scheduler.install()
    await runtime.start()
    beats = Beats(bus)
    beating = asyncio.create_task(beats.run())
    redis = connect_redis(env["redis_url"])
    rig = Rig(env, tap, bus, StateStore(redis), scheduler)
    try:
        await poll(lambda: _available(rig, 2), "both nodes in the inventory", WAIT_S)
        yield rig, beats
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await scheduler.aclose()
        await runtime.aclose()
        await bus.aclose()
        await tap.stop()
        await redis.aclose()


async def _available(r: Rig, count: int) -> bool:
    from trainyard_contract.events import utcnow

    return len(await r.scheduler.nodes.available_nodes(utcnow())) == count


async def _job(r: Rig, job_id: str) -> JobRecord:
    job = await r.store.get_job(job_id)
    assert job is not None
    return job


async def _live(r: Rig, job_id: str, number: int) -> JobRecord | None:
    job = await r.store.get_job(job_id)
    ok = job is not None and job.current is not None and job.current.attempt == number and tr.is_live(job.current)
    return job if ok else None


async def _gang(r: Rig, job_id: str, number: int) -> GangAllocated:
    await poll(lambda: _live(r, job_id, number), f"{job_id} attempt {number} placed", WAIT_S)
    return (await r.tap.wait(GangAllocated, job_id=job_id, attempt=number, timeout_s=WAIT_S))[0]


async def _cancel(r: Rig, job_id: str) -> None:
    await r.cancel(job_id)

    async def released() -> bool:
        return not await r.scheduler.held_allocations()

    await poll(released, f"{job_id}'s devices released", WAIT_S)


async def test_every_node_going_silent_at_once_blames_nobody(rig: tuple[Rig, Beats]) -> None:
    r, beats = rig
    await r.submit("wide", make_spec(8), max_attempts=1)  # a single failure would fail it
    gang = await _gang(r, "wide", 1)
    await r.start_ranks(gang)
    await poll(lambda: _ranks_started(r, "wide", 8), "its 8 ranks recorded as started", WAIT_S)
    beats.silent = set(NODES)  # the broker, the network or the whole control plane: not the nodes

    async def interrupted() -> JobRecord | None:
        job = await _job(r, "wide")
        return job if job.attempts[0].state == "revoked" else None

    job = await poll(interrupted, "attempt 1 interrupted", WAIT_S)
    first = job.attempts[0]
    assert first.interruption is not None and first.interruption.startswith("control-plane: 2 of 2 nodes"), first
    assert tr.failures(job) == 0 and job.state == "queued"  # its queued reason then says what it waits for
    assert await r.redis.hgetall(Keys.node_reputation) == {}
    assert await r.redis.hgetall(Keys.node_quarantine) == {}

    beats.silent = set()  # back: it resumes by itself, its budget of one failure untouched
    await _gang(r, "wide", 2)
    assert (await _job(r, "wide")).state != "failed"
    await _cancel(r, "wide")


async def test_a_drained_node_stops_its_attempts_at_a_checkpoint_and_takes_no_new_work(
        rig: tuple[Rig, Beats]) -> None:
    r, beats = rig
    await r.submit("drained", make_spec(4, max_steps=100), max_attempts=1)
    gang = await _gang(r, "drained", 1)
    (node,) = [n.node_id for n in gang.nodes]
    other = next(n for n in NODES if n != node)
    await r.start_ranks(gang)
    await poll(lambda: _ranks_started(r, "drained", 4), "its 4 ranks recorded as started", WAIT_S)
    await r.bus.publish(NodeDrained(node_id=node, reason="kernel upgrade", by="admin-alice"))

    (asked,) = await r.tap.wait(CheckpointRequested, job_id="drained", attempt=1, timeout_s=WAIT_S)
    assert asked.reason.startswith(f"drain: node {node} drained by admin-alice (kernel upgrade)")
    # the ranks agree on step 7, save it and exit 7 (preempted); the coordinator makes it READY
    for n in gang.nodes:
        for rank in n.ranks:
            await r.bus.publish(WorkerExited(
                job_id="drained", attempt=1, allocation_id=gang.allocation_id, epoch=gang.epoch, node_id=n.node_id,
                rank=rank.rank, exit_code=7, reason="preempted", global_step=7))
    uri = "file:///ckpt/drained/step-7/manifest.json"
    await r.store.put_checkpoint(CheckpointRecord(
        job_id="drained", tenant="t1", attempt=1, epoch=gang.epoch, global_step=7, world_size=4, state="READY",
        manifest_uri=uri, content_hash="sha256:7"))
    await r.bus.publish(CheckpointReady(job_id="drained", tenant="t1", attempt=1, epoch=gang.epoch, global_step=7,
                                        world_size=4, manifest_uri=uri, content_hash="sha256:7"))

    second = await _gang(r, "drained", 2)
    job = await _job(r, "drained")
    first = job.attempts[0]
    assert first.state == "revoked" and (first.interruption or "").startswith("maintenance: node")
    assert tr.failures(job) == 0 and await r.redis.hgetall(Keys.node_reputation) == {}
    assert [n.node_id for n in second.nodes] == [other]  # nothing new on the drained node
    assert second.start_checkpoint is not None and second.start_checkpoint.global_step == 7
    record = next(n for n in await r.store.list_nodes() if n.node_id == node)
    assert record.drained == "kernel upgrade"
    await _cancel(r, "drained")

    # while drained, a job that needs both nodes says why it waits
    await r.submit("both", make_spec(8))

    async def waiting() -> JobRecord | None:
        job = await _job(r, "both")
        return job if node in (job.queued_reason or "") else None

    job = await poll(waiting, "'both' naming the drained node", WAIT_S)
    assert f"trainyard admin nodes undrain {node}" in (job.queued_reason or ""), job.queued_reason
    await r.bus.publish(NodeUndrained(node_id=node, reason="done", by="admin-alice"))
    both = await _gang(r, "both", 1)
    assert {n.node_id for n in both.nodes} == set(NODES)
    await _cancel(r, "both")

    # a node agent that stops drains its node; its restart (a new incarnation) ends the drain
    beats.draining = {other}
    await poll(lambda: _drained(r, other), f"{other} drained by its agent", WAIT_S)
    assert not await _available(r, 2)
    beats.draining = set()
    beats.boot[other] = uuid.uuid4().hex
    await poll(lambda: _available(r, 2), f"{other} back after its agent restarted", WAIT_S)


async def test_the_next_attempt_waits_for_a_checkpoint_whose_shards_are_all_written(rig: tuple[Rig, Beats]) -> None:
    """Placing it would grant a new fencing epoch, and the coordinator never makes a fenced set READY:
    without the wait, the job would resume an interval earlier than the ranks had saved."""
    r, _ = rig
    await r.submit("settling", make_spec(4, max_steps=100))
    gang = await _gang(r, "settling", 1)
    await r.start_ranks(gang)
    await poll(lambda: _ranks_started(r, "settling", 4), "its 4 ranks recorded as started", WAIT_S)
    # every rank wrote and reported its shard of step 20; the coordinator has not verified them yet
    await r.store.put_checkpoint(CheckpointRecord(
        job_id="settling", tenant="t1", attempt=1, epoch=gang.epoch, global_step=20, world_size=4))
    await r.redis.hset(Keys.shards("settling", 1, 20), mapping={str(rank): "{}" for rank in range(4)})
    (node,) = [n.node_id for n in gang.nodes]
    await r.fail_rank(gang, node, "error")

    async def waits_for_it() -> JobRecord | None:
        job = await _job(r, "settling")
        return job if job.queued_reason_kind == "checkpoint" else None

    job = await poll(waits_for_it, "the job waiting for the checkpoint", WAIT_S)
    assert "step-000000020-a1" in (job.queued_reason or "") and job.current is not None and job.current.attempt == 1
    uri = "file:///ckpt/settling/step-20/manifest.json"
    await r.store.put_checkpoint(CheckpointRecord(
        job_id="settling", tenant="t1", attempt=1, epoch=gang.epoch, global_step=20, world_size=4, state="READY",
        manifest_uri=uri, content_hash="sha256:20"))
    second = await _gang(r, "settling", 2)
    assert second.start_checkpoint is not None and second.start_checkpoint.global_step == 20
    assert second.start_checkpoint.manifest_uri == uri
    await _cancel(r, "settling")


async def _ranks_started(r: Rig, job_id: str, count: int) -> bool:
    """Ranks the scheduler has applied as started (a drain before that revokes at once, without a checkpoint)."""
    job = await _job(r, job_id)
    return job.current is not None and len(job.current.started_ranks) >= count


async def _drained(r: Rig, node: str) -> bool:
    return bool(await r.redis.hget(Keys.node_drain, node))


async def test_a_failing_node_is_quarantined_but_never_the_last_of_its_type(rig: tuple[Rig, Beats]) -> None:
    r, _ = rig
    await r.submit("flaky", make_spec(4), max_attempts=50)
    bad: list[str] = []
    attempt = 1
    # NCCL errors on whichever node it runs on: the first node to reach the score (1.9) is quarantined,
    # the other one — the last cpu node — is not, however often it fails.
    while attempt <= 8:
        gang = await _gang(r, "flaky", attempt)
        (node,) = [n.node_id for n in gang.nodes]
        await r.start_ranks(gang)
        await r.fail_rank(gang, node, "nccl")
        await poll(lambda n=attempt: _failures(r, "flaky", n), f"{attempt} failure(s)", WAIT_S)
        bad.append(node)
        attempt += 1
    quarantined = set(await r.redis.hkeys(Keys.node_quarantine))
    assert len(quarantined) == 1, quarantined
    (first,) = quarantined
    last = next(n for n in NODES if n != first)
    assert bad.count(last) >= 3  # it kept failing: its score is over the threshold, and it stays in service
    score = await r.scheduler.nodes.node_penalties([])
    assert score[last] >= 1.9
    (event,) = await r.tap.wait(NodeQuarantined, node_id=first, timeout_s=WAIT_S)
    assert event.by == "reputation"
    await _cancel(r, "flaky")

    # An admin may take the last one out too; a job waiting for cpu devices then says why, and how to undo it.
    await r.bus.publish(NodeQuarantined(node_id=last, reason="bad DIMM", by="admin-bob"))

    async def both_out() -> bool:
        return set(await r.redis.hkeys(Keys.node_quarantine)) == set(NODES)

    await poll(both_out, "both nodes quarantined", WAIT_S)
    await r.submit("waits", make_spec(4))

    async def says_quarantine() -> JobRecord | None:
        job = await _job(r, "waits")
        return job if job.queued_reason_kind == "quarantine" else None

    job = await poll(says_quarantine, "'waits' naming the quarantine", WAIT_S)
    reason = job.queued_reason or ""
    assert reason.startswith("quarantine: every cpu node is out of service"), reason
    assert "no healthy" not in reason
    for node in NODES:
        assert f"trainyard admin nodes reinstate {node}" in reason, reason
    assert "bad DIMM" in reason and "until" in reason
    for node in NODES:
        await r.bus.publish(NodeReinstated(node_id=node, reason="fixed", by="admin-bob"))
    await _gang(r, "waits", 1)
    await _cancel(r, "waits")


async def _failures(r: Rig, job_id: str, count: int) -> bool:
    return tr.failures(await _job(r, job_id)) >= count
