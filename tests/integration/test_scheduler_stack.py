"""The scheduler and two node agents (4 CPU devices each) in-process, against the real broker
and Redis, with ``rank_command`` pointed at a tiny workload script instead of the trainer.

The test plays the API (it stores the JobRecord and publishes JobSubmitted) and the
checkpoint coordinator (it marks the final checkpoint READY and publishes CheckpointReady).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer

from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_runtime.controlrecords import record_control_request
from trainyard_contract.events import (
    ALL_TOPICS,
    JOBS,
    AllocationRevoked,
    CheckpointReady,
    CheckpointRequested,
    DeadLetter,
    Event,
    GangAllocated,
    JobControlRequested,
    JobStateChanged,
    JobSubmitted,
    StepMetrics,
    WorkerExited,
    WorkerStarted,
    decode_event,
    utcnow,
)
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.records import CheckpointRecord, JobRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_node_agent import AgentKeys, NodeAgent, NodeAgentSettings
from trainyard_scheduler import Scheduler, SchedulerSettings

from tests.integration.scheduler_workload import control_file_for
from tests.support.datasets import verified

WORKLOAD = Path(__file__).with_name("scheduler_workload.py")
WAIT_S = 60.0
pytestmark = pytest.mark.asyncio(loop_scope="module")


# ----------------------------------------------------------------------------- helpers


def make_spec(devices: int, *, max_steps: int = 2, tensor: int = 1) -> TrainingSpec:
    data = devices // tensor
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "test",
        "resources": {"gpuType": "cpu", "gpuCount": devices}, "parallelism": {"data": data, "tensor": tensor},
        "checkpointPolicy": {"everySteps": 1},
        "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": data, "learningRate": 0.001,
                     "maxSteps": max_steps},
    })


@dataclass
class Seen:
    topic: str
    event: Event
    timestamp_ms: int


class EventTap:
    """Reads every event on the namespaced topics (no consumer group) so tests can assert on them."""

    def __init__(self, bootstrap: str, namespace: str) -> None:
        self.namespace = namespace
        self.consumer = AIOKafkaConsumer(
            *(f"{namespace}{t}" for t in ALL_TOPICS), bootstrap_servers=bootstrap, group_id=None,
            auto_offset_reset="earliest", enable_auto_commit=False,
        )
        self.seen: list[Seen] = []
        self.undecodable: list[bytes] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.consumer.start()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for record in self.consumer:
            topic = record.topic.removeprefix(self.namespace)
            try:
                self.seen.append(Seen(topic, decode_event(topic, record.value or b""), record.timestamp))
            except ValueError:
                self.undecodable.append(record.value or b"")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()

    def events(self, cls: type[Event], **match: Any) -> list[Any]:
        return [s.event for s in self.seen if isinstance(s.event, cls)
                and all(getattr(s.event, k) == v for k, v in match.items())]

    def stamped(self, cls: type[Event], **match: Any) -> list[Seen]:
        return [s for s in self.seen if isinstance(s.event, cls)
                and all(getattr(s.event, k) == v for k, v in match.items())]

    async def wait(self, cls: type[Event], count: int = 1, timeout_s: float = WAIT_S, **match: Any) -> list[Any]:
        """At least ``count`` distinct events (by eventId) of ``cls`` matching ``match``."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = list({e.event_id: e for e in self.events(cls, **match)}.values())
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"saw {len(found)} of {count} {cls.__name__} {match} in {timeout_s:.0f}s; "
                                     f"events: {[type(s.event).__name__ for s in self.seen][-40:]}")
            await asyncio.sleep(0.1)


async def poll(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Await ``check()`` until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


@dataclass
class Stack:
    env: dict[str, Any]
    tap: EventTap
    publisher: Bus
    store: StateStore
    scheduler: Scheduler
    agents: dict[str, NodeAgent]
    runtimes: list[ServiceRuntime] = field(default_factory=list)

    @property
    def redis(self) -> Any:
        return self.store.redis

    def control(self, job_id: str, **behaviour: Any) -> None:
        path = control_file_for(Path(self.env["artifact_root"]))
        table = json.loads(path.read_text()) if path.exists() else {}
        table[job_id] = behaviour
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table))

    async def submit(self, job_id: str, spec: TrainingSpec, *, tenant: str = "t1", max_attempts: int = 3) -> None:
        """What the API does: store the JobRecord (queued), then publish JobSubmitted."""
        record = JobRecord(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash(),
                           priority=spec.priority, max_attempts=max_attempts)
        await verified(self.store, spec.dataset)
        assert await self.store.create_job(record)
        await self.publisher.publish(JobSubmitted(job_id=job_id, tenant=tenant, spec=spec,
                                                  spec_hash=spec.spec_hash()))

    async def request_control(self, job_id: str, action: str, *, tenant: str = "t1",
                              reason: str | None = None) -> JobControlRequested:
        """What the API does: record the control request (Keys.control_requests), then publish its event."""
        event = JobControlRequested(job_id=job_id, tenant=tenant, action=action, reason=reason)  # type: ignore[arg-type]  # a str for a Literal field
        await record_control_request(self.redis, event, requested_by="test", at=utcnow())
        await self.publisher.publish(event)
        return event

    async def job(self, job_id: str) -> JobRecord:
        job = await self.store.get_job(job_id)
        assert job is not None
        return job

    async def wait_job(self, job_id: str, predicate: Callable[[JobRecord], bool], what: str) -> JobRecord:
        async def check() -> JobRecord | None:
            job = await self.job(job_id)
            return job if predicate(job) else None

        return await poll(check, f"job {job_id}: {what}")

    async def finish_checkpoint(self, job_id: str, *, step: int, attempt: int) -> CheckpointReady:
        """What the checkpoint coordinator does for a verified checkpoint; the CheckpointReady it published."""
        job = await self.job(job_id)
        record = CheckpointRecord(job_id=job_id, tenant=job.tenant, attempt=attempt, epoch=attempt,
                                  global_step=step, world_size=job.spec.resources.gpu_count, state="READY",
                                  manifest_uri=f"file:///ckpt/{job_id}/{step}/manifest.json",
                                  content_hash="sha256:" + "0" * 64)
        await self.store.put_checkpoint(record)
        ready = CheckpointReady(
            job_id=job_id, tenant=job.tenant, attempt=attempt, epoch=attempt, global_step=step,
            world_size=record.world_size, manifest_uri=record.manifest_uri or "",
            content_hash=record.content_hash or "",
        )
        await self.publisher.publish(ready)
        return ready

    async def handled(self, event: Event) -> bool:
        """Whether the scheduler has handled ``event`` (its consumer group's record of handled event ids)."""
        group = f"{self.scheduler.settings.group_prefix}.scheduler"
        return await self.scheduler.runtime.deduper(group).seen(str(event.event_id))

    async def held(self) -> dict[str, Any]:
        return await self.scheduler.held_allocations()


@pytest.fixture(scope="module")
def stack_env(kafka_bootstrap: str, redis_server_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Like the ``env`` fixture, for the whole module: one stack serves every test here.

    Each consumer group costs ~5 s to join the embedded broker, so the stack is shared;
    tests use distinct job ids and assert per job.
    """
    import redis as redis_sync

    unique = uuid.uuid4().hex[:10]
    url = f"{redis_server_url.rsplit('/', 1)[0]}/15"
    client = redis_sync.Redis.from_url(url)
    client.flushdb()
    client.close()
    return {
        "kafka_bootstrap": kafka_bootstrap, "redis_url": url, "topic_namespace": f"t{unique}.",
        "group_prefix": f"g{unique}", "artifact_root": tmp_path_factory.mktemp("stack") / "artifacts",
        "topic_partitions": 2,
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(stack_env: dict[str, Any]) -> AsyncIterator[Stack]:
    env = stack_env
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    await tap.start()
    publisher = Bus(env["kafka_bootstrap"], service_name="test-publisher", topic_namespace=env["topic_namespace"])
    await publisher.start()
    redis = connect_redis(env["redis_url"])
    sched_settings = SchedulerSettings(**env, tick_s=0.3, reconcile_interval_s=1.0, retry_backoff_s=0.3,
                                       instance_id="scheduler-test")
    sched_runtime = ServiceRuntime("scheduler", sched_settings)
    scheduler = Scheduler(sched_runtime, sched_settings)
    scheduler.install()
    runtimes = [sched_runtime]
    agents: dict[str, NodeAgent] = {}
    for node in ("node-a", "node-b"):
        settings = NodeAgentSettings(**env, node_id=node, device_count=4, heartbeat_s=0.5, kill_grace_s=3.0,
                                     rack="rack-1", network_tier="pod-1", nvlink_domain=f"{node}-nvl",
                                     rank_command=[sys.executable, str(WORKLOAD)], instance_id=f"agent-{node}",
                                     spool_poll_s=0.1)
        runtime = ServiceRuntime("node-agent", settings)
        agent = NodeAgent(runtime, settings, base_env={"PATH": "/usr/bin:/bin"})
        agent.install()
        agents[node] = agent
        runtimes.append(runtime)
    for agent in agents.values():
        await agent.prepare()
    await asyncio.gather(*(runtime.start() for runtime in runtimes))
    for agent in agents.values():
        await agent.start()
    s = Stack(env, tap, publisher, StateStore(redis), scheduler, agents, runtimes)
    try:
        await cluster_ready(s)
        yield s
    finally:
        for agent in agents.values():
            await agent.aclose()
        await scheduler.aclose()
        for runtime in runtimes:
            await runtime.aclose()
        await publisher.aclose()
        await tap.stop()
        await redis.aclose()


async def cluster_ready(s: Stack) -> None:
    async def both_nodes() -> bool:
        nodes = await s.scheduler.nodes.available_nodes(utcnow())
        return len(nodes) == 2

    await poll(both_nodes, "both node agents in the inventory")
    # The topology the agents report is what the scheduler places by.
    for record in await s.scheduler.nodes.available_nodes(utcnow()):
        assert (record.rack, record.network_tier, record.nvlink_domain) == ("rack-1", "pod-1", f"{record.node_id}-nvl")
        assert len(record.devices) == 4 and record.devices[0].memory_bytes > 0


# ----------------------------------------------------------------------------- tests


async def test_gang_runs_to_success_while_bad_input_is_contained(stack: Stack) -> None:
    s = stack
    # A malformed message on trainyard.jobs goes to the dead-letter topic; scheduling goes on.
    await s.publisher.publish_raw(JOBS, b'{"eventType": "JobSubmitted", "jobId": ', key="garbage")
    # More devices than exist: accepted, stays queued, and says why.
    await s.submit("too-big", make_spec(16))
    await s.submit("gang", make_spec(6, max_steps=3))

    (gang,) = await s.tap.wait(GangAllocated, job_id="gang")
    assert gang.world_size == 6 and gang.epoch >= 1 and gang.master_addr == "127.0.0.1"
    assert [(n.node_id, [r.rank for r in n.ranks]) for n in gang.nodes] == [("node-a", [0, 1, 2, 3]),
                                                                            ("node-b", [4, 5])]
    assert 29400 <= gang.master_port <= 29999 and gang.start_checkpoint is None
    started = await s.tap.wait(WorkerStarted, 6, job_id="gang")
    assert sorted(e.rank for e in started) == list(range(6))
    exited = await s.tap.wait(WorkerExited, 6, job_id="gang")
    assert {(e.rank, e.exit_code, e.reason) for e in exited} == {(r, 0, "ok") for r in range(6)}
    metrics = await s.tap.wait(StepMetrics, 6, job_id="gang")
    assert sorted(m.rank for m in metrics) == list(range(6))
    for rank in range(6):  # each rank's spool was drained before its exit was published
        (metric,) = s.tap.stamped(StepMetrics, job_id="gang", rank=rank)
        exit_seen = s.tap.stamped(WorkerExited, job_id="gang", rank=rank)[0]
        assert metric.timestamp_ms <= exit_seen.timestamp_ms

    # Every rank exited 0 but no final checkpoint yet: devices are free, the job is not done.
    job = await s.wait_job("gang", lambda j: j.current is not None and j.current.state == "succeeded",
                           "attempt completed")
    assert job.state == "running"
    assert await poll(lambda: _no_leases(s), "leases released")
    await s.finish_checkpoint("gang", step=3, attempt=1)
    job = await s.wait_job("gang", lambda j: j.state == "succeeded", "succeeded")
    await s.tap.wait(JobStateChanged, job_id="gang", state="succeeded")
    assert [e.state for e in s.tap.events(JobStateChanged, job_id="gang")] == ["running", "succeeded"]
    assert job.current is not None and sorted(job.current.started_ranks) == list(range(6))

    # The rank environment is the trainer contract.
    layout = ArtifactLayout(s.env["artifact_root"])
    log_text = layout.rank_log("t1", "gang", 1, 5).read_text()
    contract = json.loads(log_text.split("ENV ", 1)[1].splitlines()[0])
    expected = {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(gang.master_port), "TRAINYARD_BACKEND": "gloo", "TRAINYARD_DEVICE_INDEX": "1",
        "TRAINYARD_JOB_ID": "gang", "TRAINYARD_TENANT": "t1", "TRAINYARD_ATTEMPT": "1",
        "TRAINYARD_EPOCH": str(gang.epoch), "TRAINYARD_ALLOCATION_ID": gang.allocation_id,
    }
    assert {k: contract[k] for k in expected} == expected
    assert contract["TRACEPARENT"].startswith("00-")
    allocation = json.loads(Path(contract["TRAINYARD_ALLOCATION_FILE"]).read_text())
    assert allocation["allocationId"] == gang.allocation_id and allocation["spec"]["training"]["maxSteps"] == 3

    letters = await s.tap.wait(DeadLetter, source_topic=JOBS)
    assert letters[0].consumer_group.endswith(".scheduler") and "invalid event" in letters[0].error
    big = await s.wait_job("too-big", lambda j: bool(j.queued_reason), "a queued reason")
    assert big.state == "queued" and not big.attempts
    assert big.queued_reason == "capacity: needs 16 cpu devices; the cluster has 8 healthy cpu devices on 2 nodes"
    assert big.queued_reason_kind == "capacity"
    assert not s.tap.events(GangAllocated, job_id="too-big")


async def test_failed_rank_retries_with_a_higher_epoch_and_stale_epochs_are_refused(stack: Stack) -> None:
    s = stack
    # attempt 1: rank 1 fails after a second while rank 0 would run on; attempt 2 succeeds.
    s.control("flaky", sleep={"1": {"0": 60, "1": 1.0}}, exit={"1": {"1": 1}})
    await s.submit("flaky", make_spec(2, max_steps=4))
    (first,) = await s.tap.wait(GangAllocated, job_id="flaky", attempt=1)
    await s.finish_checkpoint("flaky", step=2, attempt=1)  # a READY checkpoint mid-run

    revoked = await s.tap.wait(AllocationRevoked, job_id="flaky", attempt=1)
    assert revoked[0].epoch == first.epoch and revoked[0].allocation_id == first.allocation_id
    exits = {e.rank: e for e in await s.tap.wait(WorkerExited, 2, job_id="flaky", attempt=1)}
    assert (exits[1].exit_code, exits[1].reason) == (1, "error")
    assert exits[0].reason == "revoked" and exits[0].exit_code != 0  # killed by the revocation

    (second,) = await s.tap.wait(GangAllocated, job_id="flaky", attempt=2)
    assert second.epoch > first.epoch and second.allocation_id != first.allocation_id
    assert second.start_checkpoint is not None and second.start_checkpoint.global_step == 2
    await s.tap.wait(WorkerExited, 2, job_id="flaky", attempt=2, exit_code=0)
    await s.finish_checkpoint("flaky", step=4, attempt=2)
    job = await s.wait_job("flaky", lambda j: j.state == "succeeded", "succeeded")
    await s.tap.wait(JobStateChanged, job_id="flaky", state="succeeded")
    assert [a.state for a in job.attempts] == ["failed", "succeeded"]
    assert "rank 1 on" in (job.attempts[0].failure_reason or "")
    assert [e.state for e in s.tap.events(JobStateChanged, job_id="flaky")] == \
        ["running", "queued", "running", "succeeded"]
    assert await poll(lambda: _no_leases(s), "leases released")

    # A GangAllocated from a zombie scheduler with the old epoch is refused by the agent: by epoch on a node
    # that ran attempt 2 (it saw the newer epoch; a node of attempt 1 only refuses it for its released leases)
    node = next(n.node_id for n in first.nodes if n.node_id in {m.node_id for m in second.nodes})
    forged = first.model_copy(update={"event_id": uuid.uuid4(), "allocation_id": "forged"})
    await s.publisher.publish(forged)

    async def refused() -> list[dict[str, Any]]:
        entries = [json.loads(e) for e in await s.redis.lrange(AgentKeys(node).refused, 0, -1)]
        return [e for e in entries if e["allocationId"] == "forged"]

    (entry,) = await poll(refused, "the forged allocation to be refused")
    assert entry["reason"] == f"stale epoch {first.epoch}: epoch {second.epoch} was already seen for job flaky"
    assert not s.tap.events(WorkerStarted, allocation_id="forged")
    assert not await s.redis.sismember(AgentKeys(node).launched, "forged")


async def test_pause_resume_and_cancel_stop_running_ranks(stack: Stack) -> None:
    s = stack
    release = control_file_for(Path(s.env["artifact_root"])).parent / "long-release"
    s.control("long", sleep={"1": {"0": 120, "1": 120}, "2": {"0": 120, "1": 120}},
              onRequest={"1": {"step": 5, "release": release.name}})
    await s.submit("long", make_spec(2, max_steps=10))
    (first,) = await s.tap.wait(GangAllocated, job_id="long", attempt=1)
    await s.tap.wait(WorkerStarted, 2, job_id="long", attempt=1)
    await s.wait_job("long", lambda j: j.state == "running", "running")
    # A redelivered GangAllocated (new event id, same allocation) never launches twice.
    await s.publisher.publish(first.model_copy(update={"event_id": uuid.uuid4()}))

    # Pause asks the ranks for a checkpoint first; the attempt keeps its devices until theirs is READY.
    await s.request_control("long", "pause")
    (asked,) = await s.tap.wait(CheckpointRequested, job_id="long", attempt=1)
    assert asked.reason == "pause requested" and asked.allocation_id == first.allocation_id
    job = await s.wait_job("long", lambda j: j.control == "pause", "pausing")
    assert job.state == "running" and job.attempts[0].state == "running" and await s.held()
    assert not s.tap.events(WorkerExited, job_id="long", attempt=1)
    # A scheduled save of step 1, in flight when the pause came, turns READY before the ranks answer: the ranks
    # trained past it, so it is not the pause checkpoint — nothing stops, nothing is revoked.
    in_flight = await s.finish_checkpoint("long", step=1, attempt=1)
    await poll(lambda: s.handled(in_flight), "the scheduler to handle the in-flight checkpoint's READY")
    job = await s.job("long")
    assert (job.state, job.control, job.attempts[0].state) == ("running", "pause", "running")
    assert not s.tap.events(AllocationRevoked, job_id="long", attempt=1) and await s.held()
    # The ranks answer: they save the step they agree on (5) and exit 7 by themselves.
    release.write_text("go")
    exits = await s.tap.wait(WorkerExited, 2, job_id="long", attempt=1)
    assert {(e.exit_code, e.reason, e.global_step) for e in exits} == {(7, "preempted", 5)}
    job = await s.wait_job("long", lambda j: len(j.attempts[0].exited_ranks) == 2, "both exits recorded")
    assert job.state == "running" and job.attempts[0].state == "running"  # waiting for step 5 to be READY
    await s.finish_checkpoint("long", step=5, attempt=1)  # what the coordinator makes of their shards
    # launched once per rank: copies the agent re-publishes until applied carry the same event id
    assert len({e.event_id for e in s.tap.events(WorkerStarted, job_id="long", attempt=1)}) == 2
    job = await s.wait_job("long", lambda j: j.state == "paused", "paused")
    assert job.attempts[0].state == "revoked" and job.control is None
    assert job.attempts[0].exited_ranks == {"0": 7, "1": 7}  # nobody SIGTERMed them
    assert await poll(lambda: _no_leases(s), "leases released on pause")

    await s.request_control("long", "resume")
    (second,) = await s.tap.wait(GangAllocated, job_id="long", attempt=2)
    assert second.epoch > first.epoch
    assert second.start_checkpoint is not None and second.start_checkpoint.global_step == 5  # from the pause
    await s.tap.wait(WorkerStarted, 2, job_id="long", attempt=2)
    # another tenant's cancel, straight onto the bus: the API recorded none, so it is dead-lettered, not applied
    await s.publisher.publish(JobControlRequested(job_id="long", tenant="other", action="cancel"))
    await s.request_control("long", "cancel", reason="enough")
    exits = await s.tap.wait(WorkerExited, 2, job_id="long", attempt=2)
    assert {e.reason for e in exits} == {"revoked"}
    job = await s.wait_job("long", lambda j: j.state == "cancelled", "cancelled")
    await s.tap.wait(JobStateChanged, job_id="long", state="cancelled")
    assert job.reason == "enough" and [a.state for a in job.attempts] == ["revoked", "revoked"]
    assert await poll(lambda: _no_leases(s), "leases released on cancel")
    assert [e.state for e in s.tap.events(JobStateChanged, job_id="long")] == \
        ["running", "paused", "queued", "running", "cancelled"]


async def _no_leases(s: Stack) -> bool:
    return not await s.held()


async def test_reconcile_schedules_unannounced_jobs_and_releases_orphan_leases(stack: Stack) -> None:
    s = stack
    # A lease left behind by a crash between acquiring it and recording the attempt.
    orphan = await LeaseManager(s.redis).acquire("ghost", "ghost-a1", [Device("node-b", 3)])
    assert orphan >= 1 and "ghost-a1" in await s.held()
    # A job the API stored whose JobSubmitted never made it to the broker.
    spec = make_spec(2)
    assert await s.store.create_job(JobRecord(job_id="silent", tenant="t1", spec=spec, spec_hash=spec.spec_hash()))
    (gang,) = await s.tap.wait(GangAllocated, job_id="silent")
    assert gang.attempt == 1
    await s.tap.wait(WorkerExited, 2, job_id="silent", exit_code=0)
    await s.finish_checkpoint("silent", step=spec.training.max_steps, attempt=1)
    await s.wait_job("silent", lambda j: j.state == "succeeded", "succeeded")
    assert await poll(lambda: _no_leases(s), "orphan and job leases released")
    audit = await s.redis.xrange(Keys.lease_audit)
    assert any(f["op"] == "release" and f["allocation"] == "ghost-a1" for _, f in audit)
