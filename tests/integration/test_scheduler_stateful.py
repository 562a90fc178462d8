"""A hypothesis state machine over the real scheduler shell (two instances) and the real Redis.

Rules: submit, tick (either instance), time passing, heartbeats, a node going silent and coming
back, event delivery through simulated node agents (which apply the agent's own fencing rules),
jobs finishing, ranks failing, checkpoints (which end preemptions), a leader crashing between the
lease grant and the record (an orphan), failover, a stale leader's delayed write, and replayed
events. Preemption happens on its own: low-priority work fills the cluster, urgent work arrives.

Invariants after every step: no device in two live allocations (job records, lease keys and the
lease audit stream agree); no tenant above guaranteed + borrowable; no job lost (every job is in
Redis, and every unfinished one is known to the scheduler); attempt epochs only grow.

``make test`` runs a short version; ``TRAINYARD_LONG_TESTS=1`` (``make test-long``) runs ≥ 10k steps.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_sync
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from trainyard_contract.errors import FencingError
from trainyard_contract.events import (
    AllocationRevoked,
    CheckpointReady,
    DeviceInfo,
    Event,
    GangAllocated,
    JobSubmitted,
    NodeHeartbeat,
    WorkerExited,
    WorkerStarted,
    decode_event,
    utcnow,
)
from trainyard_runtime.bus import Deduper
from trainyard_runtime.outbox import Outbox
from tests.support.scheduler import SchedulerRuntime
from trainyard_contract.records import CheckpointRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_node_agent.admission import Launch, judge
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.gang import GangRequest, Placement
from trainyard_scheduler.placement import place
from trainyard_scheduler.topology import ClusterSnapshot
from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.queueview import attempt_devices
from trainyard_scheduler.scheduler import Scheduler
from trainyard_scheduler.settings import SchedulerSettings
from tests.support.datasets import verified

LONG = os.environ.get("TRAINYARD_LONG_TESTS") == "1"
SEEN: Counter[str] = Counter()  # what the runs exercised (printed with -s)


def event(what: str) -> None:
    SEEN[what] += 1
NODES = {"n0": "r0", "n1": "r0", "n2": "r1", "n3": "r1"}
DEVICES = 4
MAX_STEPS = 10
QUEUE = {
    "tenants": {"a": {"quotas": {"cpu": {"guaranteed": 8, "borrowLimit": 4}}},
                "b": {"quotas": {"cpu": {"guaranteed": 4, "borrowLimit": 8}}}},
    "preemption": {"checkpointGraceSeconds": 60, "minRuntimeSeconds": 0},
}
CAPS = {"a": 12, "b": 12}


def make_spec(devices: int, tensor: int, priority: int) -> TrainingSpec:
    data = devices // tensor
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "test",
        "resources": {"gpuType": "cpu", "gpuCount": devices}, "parallelism": {"data": data, "tensor": tensor},
        "checkpointPolicy": {"everySteps": 5}, "priority": priority,
        "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": data, "learningRate": 0.001,
                     "maxSteps": MAX_STEPS},
    })


@dataclass
class Agents:
    """The node agents' view: highest epoch seen per (node, job), launched allocations."""

    epochs: dict[tuple[str, str], int] = field(default_factory=dict)
    launched: set[str] = field(default_factory=set)


class SchedulerMachine(RuleBasedStateMachine):
    redis_url = ""
    jobs = Bundle("jobs")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = utcnow()
        self.rng = random.Random(0)
        self.history: list[Event] = []
        self.agents = Agents()
        self.up = set(NODES)
        self.submitted: list[str] = []
        self.count = 0
        client = redis_sync.Redis.from_url(self.redis_url)
        client.flushdb()
        client.close()
        self.run(self._setup())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _setup(self) -> None:
        self.redis = connect_redis(self.redis_url)
        self.store = StateStore(self.redis)
        await self.redis.set(Keys.queue_config, json.dumps(QUEUE))
        settings = SchedulerSettings(redis_url=self.redis_url, node_timeout_s=15, lease_ttl_s=0, leader_ttl_s=3600,
                                     retry_backoff_s=0, start_timeout_s=120, reconcile_interval_s=5)
        self.schedulers = [
            Scheduler(SchedulerRuntime(self.redis, self.store, Outbox(self.redis, "scheduler"), name), settings,
                      clock=lambda: self.now)
            for name in ("sched-a", "sched-b")
        ]
        for s in self.schedulers:  # what Scheduler.install gives the worker batches: the handled ids
            s.handlers.seen = Deduper(self.redis, "scheduler", "stateful.scheduler")
        for node in NODES:
            await self._heartbeat(node)

    def teardown(self) -> None:
        self.run(self.redis.aclose())
        self.loop.close()

    # ------------------------------------------------------------------ helpers
    async def _deliver(self, event: Event, to: int | None = None) -> None:
        """What the bus does: hand the event to the handler of one scheduler instance."""
        self.history.append(event)
        s = self.schedulers[self.rng.randrange(2) if to is None else to]
        if isinstance(event, WorkerStarted | WorkerExited):  # the workers group reads a batch at a time
            await s.handlers.on_worker_batch([event])
            return
        handler = {JobSubmitted: s.handlers.on_job_submitted, NodeHeartbeat: s.nodes.on_heartbeat,
                   CheckpointReady: s.handlers.on_checkpoint_ready}[type(event)]
        await handler(event)  # type: ignore[operator]  # a handler

    async def _deliver_batch(self, events: list[Event]) -> None:
        """A fetched batch of worker news, to one scheduler instance."""
        self.history.extend(events)
        await self.schedulers[self.rng.randrange(2)].handlers.on_worker_batch(events)

    async def _heartbeat(self, node: str) -> None:
        devices = [DeviceInfo(index=i, type="cpu", memory_bytes=16 << 30) for i in range(DEVICES)]
        await self._deliver(NodeHeartbeat(node_id=node, host=f"{node}.local", rack=NODES[node], devices=devices,
                                          occurred_at=self.now))

    async def _job(self, job_id: str) -> JobRecord:
        job = await self.store.get_job(job_id)
        assert job is not None, f"job {job_id} vanished"
        return job

    async def _outbox(self) -> list[Event]:
        entries = await self.redis.xrange(Keys.outbox("scheduler"))
        if entries:
            await self.redis.xdel(Keys.outbox("scheduler"), *[i for i, _ in entries])
        events = [decode_event(f["topic"], f["payload"].encode()) for _, f in entries]
        for e in events:
            event(f"published {e.event_type}")
        return events

    async def _agents_handle(self, event: Event) -> None:
        """Node agents: launch (after the agent's own epoch and lease checks) or stop ranks."""
        if isinstance(event, GangAllocated):
            if event.allocation_id in self.agents.launched:
                return
            holders: dict[str, dict[int, Any]] = {}
            for share in event.nodes:
                raws = await self.redis.mget([Keys.lease(share.node_id, r.device_index) for r in share.ranks])
                holders[share.node_id] = {r.device_index: json.loads(raw) if raw else None
                                          for r, raw in zip(share.ranks, raws, strict=True)}
            for share in event.nodes:
                if share.node_id not in self.up:
                    continue
                decision = judge(event, share.node_id, highest_epoch=self.agents.epochs.get((share.node_id,
                                                                                           event.job_id)),
                                 lease_holders=holders[share.node_id])
                if not isinstance(decision, Launch):
                    continue
                self.agents.epochs[(share.node_id, event.job_id)] = max(
                    event.epoch, self.agents.epochs.get((share.node_id, event.job_id), 0))
                await self._deliver_batch([WorkerStarted(job_id=event.job_id, attempt=event.attempt,
                                                         allocation_id=event.allocation_id, epoch=event.epoch,
                                                         node_id=share.node_id, rank=r.rank, pid=1,
                                                         log_uri="file:///l") for r in share.ranks])
            self.agents.launched.add(event.allocation_id)
        elif isinstance(event, AllocationRevoked):
            job = await self._job(event.job_id)
            attempt = next((a for a in job.attempts if a.allocation_id == event.allocation_id), None)
            if attempt is None:
                return
            for rank in attempt.started_ranks:
                await self._deliver(self._exit(job.job_id, attempt, rank, -15, "revoked"))

    def _exit(self, job_id: str, attempt: Any, rank: int, code: int, reason: str) -> WorkerExited:
        return WorkerExited(job_id=job_id, attempt=attempt.attempt, allocation_id=attempt.allocation_id,
                            epoch=attempt.epoch, node_id=attempt.nodes[0], rank=rank, exit_code=code, reason=reason)

    async def _ready(self, job: JobRecord, step: int) -> None:
        attempt = job.current
        assert attempt is not None
        record = CheckpointRecord(job_id=job.job_id, tenant=job.tenant, attempt=attempt.attempt, epoch=attempt.epoch,
                                  global_step=step, world_size=attempt.world_size, state="READY",
                                  manifest_uri=f"file:///{job.job_id}/{step}", content_hash="sha256:" + "0" * 64)
        await self.store.put_checkpoint(record)
        await self._deliver(CheckpointReady(job_id=job.job_id, tenant=job.tenant, attempt=attempt.attempt,
                                            epoch=attempt.epoch, global_step=step, world_size=attempt.world_size,
                                            manifest_uri=record.manifest_uri or "", content_hash="x"))

    async def _running(self, job_id: str) -> JobRecord | None:
        job = await self._job(job_id)
        return job if job.current is not None and job.current.state == "running" else None

    # ------------------------------------------------------------------ rules
    @initialize(target=jobs, sizes=st.lists(st.sampled_from([2, 4, 8]), min_size=3, max_size=3),
                tenants=st.lists(st.sampled_from(["a", "b"]), min_size=3, max_size=3))
    def low_priority_work(self, sizes: list[int], tenants: list[str]) -> Any:
        """Background work that fills the cluster, so that later jobs queue, borrow and preempt."""
        return multiple(*(self.submit(size, 1, tenant, -100) for size, tenant in zip(sizes, tenants, strict=True)))

    @precondition(lambda self: self.count < 14)
    @rule(target=jobs, size=st.sampled_from([2, 4, 8]), tenant=st.sampled_from(["a", "b"]))
    def urgent_work(self, size: int, tenant: str) -> str:
        return self.submit(size, 2, tenant, 100)

    @precondition(lambda self: self.count < 14)
    @rule(target=jobs, size=st.sampled_from([1, 2, 4, 8]), tensor=st.sampled_from([1, 2]),
          tenant=st.sampled_from(["a", "b"]), priority=st.sampled_from([-100, 0, 100]))
    def submit(self, size: int, tensor: int, tenant: str, priority: int) -> str:
        tensor = min(tensor, size)
        self.count += 1
        job_id = f"j{self.count}"
        spec = make_spec(size, tensor, priority)

        async def go() -> None:
            record = JobRecord(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash(),
                               priority=priority, max_attempts=50, created_at=self.now)
            await verified(self.store, spec.dataset)
            assert await self.store.create_job(record)  # what the API does, then JobSubmitted
            await self._deliver(JobSubmitted(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash()))

        self.run(go())
        self.submitted.append(job_id)
        return job_id

    @rule(which=st.integers(0, 1), relay=st.booleans())
    def tick(self, which: int, relay: bool) -> None:
        """A scheduling pass of one instance; the outbox relay then runs, or is late."""
        async def go() -> None:
            before = await self.redis.get(SchedulerKeys.leader_epoch)
            await self.schedulers[which].tick()
            if await self.redis.get(SchedulerKeys.leader_epoch) != before:
                event("leader epoch changed")
            if relay:
                for e in await self._outbox():
                    await self._agents_handle(e)

        self.run(go())

    @rule(seconds=st.sampled_from([1, 5, 20, 70]), which=st.integers(0, 1))
    def time_passes(self, seconds: int, which: int) -> None:
        """Time passes: live nodes heart-beat, an instance ticks and the relay runs (the usual case)."""
        self.now += timedelta(seconds=seconds)

        async def go() -> None:
            for node in sorted(self.up):
                await self._heartbeat(node)

        self.run(go())
        self.tick(which, True)

    @rule(node=st.sampled_from(sorted(NODES)))
    def node_goes_silent(self, node: str) -> None:
        self.up.discard(node)

    @rule(node=st.sampled_from(sorted(NODES)))
    def node_returns(self, node: str) -> None:
        self.up.add(node)
        self.run(self._heartbeat(node))

    @rule()
    def deliver(self) -> None:
        async def go() -> None:
            for event in await self._outbox():
                await self._agents_handle(event)

        self.run(go())

    @rule(job_id=jobs)
    def finish(self, job_id: str) -> None:
        async def go() -> None:
            job = await self._running(job_id)
            if job is None or job.current is None:
                return
            attempt = job.current
            await self._ready(job, MAX_STEPS)
            for rank in range(attempt.world_size):
                await self._deliver(self._exit(job_id, attempt, rank, 0, "ok"))

        self.run(go())

    @rule(job_id=jobs)
    def rank_fails(self, job_id: str) -> None:
        async def go() -> None:
            job = await self._running(job_id)
            if job is not None and job.current is not None:
                await self._deliver(self._exit(job_id, job.current, 0, 1, "error"))

        self.run(go())

    @rule(job_id=jobs, step=st.sampled_from([5, 6]))
    def checkpoint(self, job_id: str, step: int) -> None:
        async def go() -> None:
            job = await self._running(job_id)
            if job is not None:
                await self._ready(job, step)

        self.run(go())

    @rule(job_id=jobs, action=st.sampled_from(["pause", "resume", "cancel"]))
    def control(self, job_id: str, action: str) -> None:
        async def go() -> None:
            job = await self._job(job_id)
            outcome = await self.schedulers[0].writer.mutate(
                job_id, lambda j, _: tr.request_control(j, action, None, self.now), label=action)
            assert outcome is not None and outcome.job.tenant == job.tenant

        self.run(go())

    @rule()
    def leader_crashes_mid_allocation(self) -> None:
        """The leader took a gang's leases and died before recording the attempt: an orphan."""
        async def go() -> None:
            leader = next((s for s in self.schedulers if s.leader_epoch is not None), None)
            if leader is None:
                return
            for job_id in self.submitted:
                job = await self._job(job_id)
                if tr.is_pending(job):
                    placement = await self._placement(leader, job)
                    if placement is not None:
                        try:
                            await leader.leases.acquire(leader.leader_epoch, job_id, f"{job_id}-orphan-{self.count}",
                                                        placement.devices())
                            event("orphan leases left by a crashed leader")
                        except Exception:  # noqa: BLE001 - fenced or raced: nothing was granted
                            pass
                    return

        self.run(go())

    @rule(stale_write=st.booleans())
    def failover(self, stale_write: bool) -> None:
        """The leader stops renewing (paused / partitioned / killed): its lease runs out and the other
        instance takes over with a higher epoch. Maybe the old one wakes up and finishes an admission
        (or a note) it had planned: refused, nothing granted, nothing written."""
        async def go() -> None:
            old = next((s for s in self.schedulers if s.leader_epoch is not None), None)
            await self.redis.delete(SchedulerKeys.leader)
            if old is None:
                return
            new = self.schedulers[1 - self.schedulers.index(old)]
            await new.tick()
            assert new.leader_epoch is not None and new.leader_epoch > (old.leader_epoch or 0)
            event("failover")
            await self._no_orphans()  # the new leader reconciled before it scheduled
            if stale_write:
                await self._stale_writes(old)
            await old.tick()
            assert old.leader_epoch is None  # it stands by

        self.run(go())

    async def _no_orphans(self) -> None:
        """Every lease belongs to the live attempt of its job."""
        live = set()
        for job_id in self.submitted:
            job = await self._job(job_id)
            if tr.is_live(job.current) and job.current is not None:
                live.add(job.current.allocation_id)
        for key in [k async for k in self.redis.scan_iter(match="ty:lease:*")]:
            holder = json.loads(await self.redis.get(key) or "{}")
            assert not holder or holder["allocationId"] in live, f"{key} still held by {holder}"

    async def _stale_writes(self, stale: Scheduler) -> None:
        """The old leader's delayed writes for a job it saw pending: a note and an admission."""
        epoch = stale.leader_epoch
        assert epoch is not None
        self.count += 1
        job_id = f"j{self.count}"
        spec = make_spec(1, 1, 0)
        job = JobRecord(job_id=job_id, tenant="b", spec=spec, spec_hash=spec.spec_hash(), max_attempts=50,
                        created_at=self.now)
        await verified(self.store, spec.dataset)
        assert await self.store.create_job(job)
        await self._deliver(JobSubmitted(job_id=job_id, tenant="b", spec=spec, spec_hash=spec.spec_hash()))
        self.submitted.append(job_id)
        with pytest.raises(FencingError):
            await stale.writer.mutate(job_id, lambda j, _: tr.note_waiting(j, "stale", "capacity"), fence=epoch)
        assert (await self._job(job_id)).queued_reason != "stale"
        event("a stale leader's job write was refused")
        placement = await self._placement(stale, job)
        if placement is None:
            return
        grants = len(await self.redis.xrange(Keys.lease_audit))
        with pytest.raises(FencingError):
            await stale.admission.admit(job_id, placement, epoch)
        assert len(await self.redis.xrange(Keys.lease_audit)) == grants
        assert not (await self._job(job_id)).attempts
        event("a stale leader's admission was refused")

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """At-least-once delivery: an old event again, to either instance."""
        again = data.draw(st.sampled_from(self.history[-50:]))
        self.run(self._deliver(again, to=data.draw(st.integers(0, 1))))

    async def _placement(self, s: Scheduler, job: JobRecord) -> Placement | None:
        nodes = await s.nodes.available_nodes(self.now)
        leased: dict[str, set[int]] = {}
        for allocation in (await s.held_allocations()).values():
            for d in allocation.devices:
                leased.setdefault(d.node_id, set()).add(d.index)
        result = place(ClusterSnapshot.build(nodes, leased), GangRequest.from_spec(job.spec))
        return result if isinstance(result, Placement) else None

    # ------------------------------------------------------------------ invariants
    @invariant()
    def count_steps(self) -> None:
        SEEN["steps"] += 1

    @invariant()
    def no_device_in_two_live_allocations(self) -> None:
        async def go() -> None:
            owners: dict[str, str] = {}
            for job_id in self.submitted:
                job = await self._job(job_id)
                if not tr.is_live(job.current):
                    continue
                assert job.current is not None
                for d in attempt_devices(job):
                    key = str(d)
                    assert key not in owners, f"{key} held by {owners.get(key)} and {job_id}"
                    owners[key] = job_id
                    holder = await self.redis.get(Keys.lease(d.node_id, d.index))
                    assert holder and json.loads(holder)["allocationId"] == job.current.allocation_id
            held: dict[str, str] = {}
            for _, f in await self.redis.xrange(Keys.lease_audit):
                for d in json.loads(f["devices"]):
                    if f["op"] == "grant":
                        assert d not in held, f"{d} granted to {f['allocation']} while held by {held[d]}"
                        held[d] = f["allocation"]
                    elif f["op"] == "release" and held.get(d) == f["allocation"]:
                        del held[d]

        self.run(go())

    @invariant()
    def quotas_hold_and_no_job_is_lost(self) -> None:
        async def go() -> None:
            usage: dict[str, int] = {}
            active = await self.redis.smembers(SchedulerKeys.active)
            incoming = await self.redis.smembers(Keys.incoming_jobs)  # stored, taken in by the leader's next pass
            for job_id in self.submitted:
                job = await self._job(job_id)
                if job.state not in ("succeeded", "failed", "cancelled"):
                    assert job_id in active or job_id in incoming, f"{job_id} ({job.state}) unknown to the scheduler"
                    assert job_id in active or tr.is_pending(job), f"{job_id} ({job.state}) runs untaken"
                epochs = [a.epoch for a in job.attempts]
                assert epochs == sorted(set(epochs)), f"{job_id} epochs {epochs}"
                if tr.is_live(job.current) and job.current is not None:
                    usage[job.tenant] = usage.get(job.tenant, 0) + job.current.world_size
            for tenant, used in usage.items():
                assert used <= CAPS[tenant], f"tenant {tenant} holds {used} > {CAPS[tenant]}"

        self.run(go())


@pytest.mark.timeout(300)
def test_scheduler_state_machine(env: dict[str, Any]) -> None:
    SchedulerMachine.redis_url = env["redis_url"]
    SEEN.clear()
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=15, stateful_step_count=50, deadline=None, derandomize=False,
        suppress_health_check=list(HealthCheck)))
    print(f"exercised: {dict(SEEN)}")
    assert SEEN["published GangAllocated"] and SEEN["failover"]  # the runs did schedule and fail over


@pytest.mark.long
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not LONG, reason="long stateful run (>= 10k steps); set TRAINYARD_LONG_TESTS=1 (make test-long)")
def test_scheduler_state_machine_long(env: dict[str, Any]) -> None:
    SchedulerMachine.redis_url = env["redis_url"]
    SEEN.clear()
    while SEEN["steps"] < 10_000:  # hypothesis may stop an example early: count the steps really run
        run_state_machine_as_test(SchedulerMachine, settings=settings(
            max_examples=50, stateful_step_count=120, deadline=None, suppress_health_check=list(HealthCheck)))
    print(f"exercised: {dict(SEEN)}")


