"""The scheduler's I/O shell: events in, a Redis snapshot, a pure decision, the result applied.

* NODES    NodeHeartbeat → NodeRecord upsert (inventory); NodeQuarantined → node excluded.
* JOBS     JobSubmitted → JobRecord created if absent; JobControlRequested → cancel/pause/resume.
* WORKERS  WorkerStarted / WorkerExited → attempt and job transitions.
* CHECKPOINTS CheckpointReady → success once the attempt completed and maxSteps is READY.
* tick     1. leader lock  2. reconcile (when due)  3. snapshot  4. plan  5. admit / note waits.

Every change to a job goes through :meth:`Scheduler._mutate`: WATCH the job key, decide with
a pure function from :mod:`trainyard_scheduler.transitions`, write the record and stage its
events in one MULTI (outbox), then release leases. A concurrent writer makes the MULTI fail
and the decision is taken again on fresh state, so handlers, the tick and a second
scheduler instance never lose each other's updates.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from opentelemetry import trace
from redis.exceptions import WatchError

from trainyard_common.errors import ConflictError, FencingError, LeaseConflictError
from trainyard_common.events import (
    CHECKPOINTS,
    JOBS,
    NODES,
    TERMINAL_STATES,
    WORKERS,
    CheckpointFailed,
    CheckpointReady,
    CheckpointRef,
    JobControlRequested,
    JobSubmitted,
    NodeHeartbeat,
    NodeQuarantined,
    WorkerExited,
    WorkerStarted,
    utcnow,
)
from trainyard_common.leases import Device, LeaseManager
from trainyard_common.records import CheckpointRecord, JobRecord, NodeRecord
from trainyard_common.service import ServiceRuntime
from trainyard_common.store import Keys
from trainyard_common.tracing import current_traceparent, job_context

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.placement import ClusterSnapshot, GangRequest, Placement
from trainyard_scheduler.planner import Admit, PendingJob, Wait, plan
from trainyard_scheduler.settings import SchedulerSettings

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("trainyard.scheduler")

Clock = Callable[[], datetime]
Decide = Callable[[JobRecord, bool], tr.Outcome]

_LEAD = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_DISCOVERY_WINDOW_S = 3600.0
_MGET_CHUNK = 500


class SchedulerKeys:
    """Redis keys the scheduler owns (besides the shared ones in ``trainyard_common.store.Keys``)."""

    active = "ty:sched:active"  # ids of jobs not yet terminal
    port = "ty:sched:rdzv-port"  # rendezvous port counter
    leader = "ty:sched:leader"  # instance id of the scheduler that runs the tick


@dataclass
class HeldAllocation:
    """An allocation that still holds at least one device lease."""

    job_id: str
    allocation_id: str
    epoch: int
    devices: list[Device] = field(default_factory=list)


def _trace_id(traceparent: str | None) -> str | None:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) >= 3 else None


def final_checkpoint_ready(job: JobRecord, raw_records: list[str]) -> bool:
    """Whether a READY checkpoint at (or past) ``maxSteps`` is among the raw CheckpointRecords."""
    for raw in raw_records:
        record = CheckpointRecord.model_validate_json(raw)
        if record.state == "READY" and tr.is_final_step(job, record.global_step):
            return True
    return False


class Scheduler:
    """Wires the handlers and the tick onto a :class:`ServiceRuntime`; state lives in Redis."""

    def __init__(self, runtime: ServiceRuntime, settings: SchedulerSettings, *, clock: Clock = utcnow) -> None:
        self.runtime = runtime
        self.settings = settings
        self.redis = runtime.redis
        self.store = runtime.store
        self.clock = clock
        self.leases = LeaseManager(runtime.redis)
        self.policy = tr.RetryPolicy(settings.retry_backoff_s, settings.retry_backoff_max_s)
        self.deadlines = tr.Deadlines(settings.start_timeout_s, settings.final_checkpoint_timeout_s)
        self._lead = runtime.redis.register_script(_LEAD)
        self._next_reconcile: datetime | None = None
        self._discovered_all = False

    def install(self) -> None:
        """Subscribe to the topics and register the tick; call before ``runtime.start()``."""
        bus, dedupe = self.runtime.bus, self.runtime.deduper
        # One consumer group for every topic (the bus reads them with one consumer).
        group = f"{self.settings.group_prefix}.scheduler"
        bus.subscribe(NODES, {NodeHeartbeat: self.on_heartbeat, NodeQuarantined: self.on_quarantined}, group=group)
        bus.subscribe(JOBS, {JobSubmitted: self.on_job_submitted, JobControlRequested: self.on_control},
                      group=group, deduper_factory=dedupe)
        bus.subscribe(WORKERS, {WorkerStarted: self.on_worker_started, WorkerExited: self.on_worker_exited},
                      group=group, deduper_factory=dedupe)
        bus.subscribe(CHECKPOINTS, {CheckpointReady: self.on_checkpoint_ready,
                                    CheckpointFailed: self.on_checkpoint_failed},
                      group=group, deduper_factory=dedupe)
        self.runtime.add_loop("tick", self.tick, self.settings.tick_s)

    async def aclose(self) -> None:
        """Give up the leader lock so a successor does not wait for it to expire."""
        with contextlib.suppress(Exception):
            if await self.redis.get(SchedulerKeys.leader) == self.runtime.instance:
                await self.redis.delete(SchedulerKeys.leader)

    # ------------------------------------------------------------------ inventory
    async def on_heartbeat(self, event: NodeHeartbeat) -> None:
        seen = min(event.occurred_at, self.clock())
        raw = await self.redis.hget(Keys.nodes, event.node_id)
        previous = NodeRecord.model_validate_json(raw) if raw else None
        if previous and previous.last_seen > seen:
            return  # an older heartbeat delivered late
        record = NodeRecord(
            node_id=event.node_id, host=event.host, rack=event.rack, nvlink_domain=event.nvlink_domain,
            devices=event.devices, healthy=event.healthy, last_seen=seen,
            quarantined=previous.quarantined if previous else None,
        )
        await self.store.put_node(record)

    async def on_quarantined(self, event: NodeQuarantined) -> None:
        raw = await self.redis.hget(Keys.nodes, event.node_id)
        if raw:
            record = NodeRecord.model_validate_json(raw)
            record.quarantined = event.reason
            await self.store.put_node(record)
        log.warning("node %s quarantined: %s", event.node_id, event.reason)

    async def available_nodes(self, now: datetime) -> list[NodeRecord]:
        """Nodes that heart-beat within ``node_timeout_s``, are healthy and not quarantined."""
        horizon = now - timedelta(seconds=self.settings.node_timeout_s)
        return [n for n in await self.store.list_nodes()
                if n.healthy and not n.quarantined and n.last_seen >= horizon]

    # ------------------------------------------------------------------ jobs
    async def on_job_submitted(self, event: JobSubmitted) -> None:
        job = JobRecord(
            job_id=event.job_id, tenant=event.tenant, spec=event.spec, spec_hash=event.spec_hash,
            priority=event.spec.priority, submitted_by=event.submitted_by,
            max_attempts=self.settings.max_attempts, traceparent=current_traceparent(),
        )
        created = await self.store.create_job(job)
        existing = job if created else await self.store.get_job(event.job_id)
        if existing and existing.spec_hash != event.spec_hash:
            log.warning("JobSubmitted for %s carries spec %s but the job has %s; keeping the stored job",
                        event.job_id, event.spec_hash, existing.spec_hash)
        if existing and existing.state not in TERMINAL_STATES:
            await self.redis.sadd(SchedulerKeys.active, event.job_id)
        log.info("job %s %s (tenant %s, %d %s devices)", event.job_id,
                 "created from JobSubmitted" if created else "already known",
                 event.tenant, event.spec.resources.gpu_count, event.spec.resources.gpu_type)

    async def on_control(self, event: JobControlRequested) -> None:
        def decide(job: JobRecord, _: bool) -> tr.Outcome:
            if job.tenant != event.tenant:
                return tr.unchanged(job, f"{event.action} from tenant {event.tenant!r} ignored: not the owner")
            return tr.request_control(job, event.action, event.reason, self.clock())

        outcome = await self._mutate(event.job_id, decide, label=f"control {event.action}")
        if outcome is None:
            log.warning("%s for unknown job %s ignored", event.action, event.job_id)

    # ------------------------------------------------------------------ workers and checkpoints
    async def on_worker_started(self, event: WorkerStarted) -> None:
        await self._mutate(event.job_id, lambda job, _: tr.worker_started(job, event, self.clock()),
                           label="worker started")

    async def on_worker_exited(self, event: WorkerExited) -> None:
        def decide(job: JobRecord, final_ready: bool) -> tr.Outcome:
            return tr.worker_exited(job, event, final_ready=final_ready, policy=self.policy, now=self.clock())

        await self._mutate(event.job_id, decide, need_checkpoints=True, label="worker exited")

    async def on_checkpoint_ready(self, event: CheckpointReady) -> None:
        await self._mutate(
            event.job_id, lambda job, _: tr.checkpoint_ready(job, global_step=event.global_step, now=self.clock()),
            label="checkpoint ready",
        )

    async def on_checkpoint_failed(self, event: CheckpointFailed) -> None:
        def decide(job: JobRecord, _: bool) -> tr.Outcome:
            return tr.checkpoint_failed(job, global_step=event.global_step, reason=event.reason,
                                        policy=self.policy, now=self.clock())

        await self._mutate(event.job_id, decide, label="checkpoint failed")

    # ------------------------------------------------------------------ the tick
    async def tick(self) -> None:
        """One scheduling pass; only the leader schedules."""
        ttl_ms = int(max(self.settings.leader_ttl_s, 3 * self.settings.tick_s) * 1000)
        if not int(await self._lead(keys=[SchedulerKeys.leader], args=[self.runtime.instance, ttl_ms])):
            return
        now = self.clock()
        if self._next_reconcile is None or now >= self._next_reconcile:
            await self.reconcile(now)
            self._next_reconcile = now + timedelta(seconds=self.settings.reconcile_interval_s)
        # 1. snapshot: available nodes, held leases, active jobs
        nodes = await self.available_nodes(now)
        held = await self.held_allocations()
        jobs = {j.job_id: j for j in await self.active_jobs()}
        leased: dict[str, list[int]] = {}
        for allocation in held.values():
            for device in allocation.devices:
                leased.setdefault(device.node_id, []).append(device.index)
        snapshot = ClusterSnapshot.build(nodes, leased)
        # 2. pending jobs, 3. decisions
        pending = [self._pending(j) for j in jobs.values() if tr.is_pending(j)]
        decisions = plan(snapshot, pending, now)
        # 4. apply
        for decision in decisions:
            try:
                if isinstance(decision, Admit):
                    await self._admit(decision.job_id, decision.placement)
                elif isinstance(decision, Wait) and decision.reason is not None:
                    if jobs[decision.job_id].queued_reason != decision.reason:
                        reason = decision.reason
                        await self._mutate(decision.job_id, lambda j, _: tr.note_waiting(j, reason),
                                           label="waiting")
            except LeaseConflictError as exc:
                log.info("placement of %s raced another allocation, retrying next tick: %s", decision.job_id, exc)

    def _pending(self, job: JobRecord) -> PendingJob:
        return PendingJob(
            job_id=job.job_id, request=GangRequest.from_spec(job.spec), submitted_at=job.created_at,
            priority=job.priority, not_before=tr.retry_not_before(job, self.policy),
        )

    async def _admit(self, job_id: str, placement: Placement) -> None:
        """Reserve (leases, Lua), persist (attempt + GangAllocated in one MULTI), undo on conflict."""
        devices = placement.devices()
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.watch(Keys.job(job_id))
            raw = await pipe.get(Keys.job(job_id))
            job = JobRecord.model_validate_json(raw) if raw else None
            if job is None or not tr.is_pending(job):
                return
            number = len(job.attempts) + 1
            allocation_id = f"{job_id}-a{number}-{uuid.uuid4().hex[:8]}"
            start = await self._start_checkpoint(job_id)
            epoch = await self.leases.acquire(job_id, allocation_id, devices)
            try:
                port = await self._next_port()
                with self._job_span(job, "scheduler.place"):
                    outcome = tr.admit(job, placement=placement, allocation_id=allocation_id, epoch=epoch,
                                       master_port=port, start_checkpoint=start, now=self.clock())
                    if not outcome.changed:
                        raise WatchError(outcome.note or "job changed")
                    self._stage(pipe, job_id, outcome)
                    await pipe.execute()
            except WatchError:
                await self._release(allocation_id, epoch, devices)
                log.info("job %s changed while being placed; placement undone", job_id)
                return
            except BaseException:
                await self._release(allocation_id, epoch, devices)
                raise
        log.info("job %s: %s (allocation %s, epoch %d, world %d, score %.2f)", job_id, outcome.note,
                 allocation_id, epoch, placement.world_size, placement.score)

    async def _start_checkpoint(self, job_id: str) -> CheckpointRef | None:
        latest = await self.store.latest_ready_checkpoint(job_id)
        if latest is None or not latest.manifest_uri:
            return None
        return CheckpointRef(manifest_uri=latest.manifest_uri, global_step=latest.global_step,
                             attempt=latest.attempt, content_hash=latest.content_hash)

    async def _next_port(self) -> int:
        low, high = self.settings.rendezvous_port_min, self.settings.rendezvous_port_max
        n = int(await self.redis.incr(SchedulerKeys.port))
        return low + (n - 1) % (high - low + 1)

    # ------------------------------------------------------------------ reconcile
    async def reconcile(self, now: datetime) -> None:
        """Repair from durable state: discover jobs, check live attempts, release orphan leases."""
        await self._discover_jobs(now)
        available = frozenset(n.node_id for n in await self.available_nodes(now))
        for job in await self.active_jobs():
            current = job.current
            if current is None or not (tr.is_live(current) or current.state == "succeeded"):
                continue

            def decide(j: JobRecord, final_ready: bool) -> tr.Outcome:
                return tr.check_attempt(j, available_nodes=available, final_ready=final_ready,
                                        deadlines=self.deadlines, policy=self.policy, now=self.clock())

            await self._mutate(job.job_id, decide, need_checkpoints=True, label="reconcile")
        for allocation in (await self.held_allocations()).values():
            job = await self.store.get_job(allocation.job_id)
            current = job.current if job else None
            if current is None or current.allocation_id != allocation.allocation_id or not tr.is_live(current):
                await self._release(allocation.allocation_id, allocation.epoch, allocation.devices)
                log.warning("released orphan allocation %s of job %s", allocation.allocation_id, allocation.job_id)

    async def _discover_jobs(self, now: datetime) -> None:
        """Jobs the API stored whose JobSubmitted never reached us still get scheduled."""
        if self._discovered_all:
            since = (now - timedelta(seconds=_DISCOVERY_WINDOW_S)).timestamp()
            ids = await self.redis.zrangebyscore(Keys.jobs, since, "+inf")
        else:
            ids = await self.redis.zrange(Keys.jobs, 0, -1)
        known = await self.redis.smembers(SchedulerKeys.active)
        missing = [i for i in ids if i not in known]
        for start in range(0, len(missing), _MGET_CHUNK):
            jobs = await self.store.get_jobs(missing[start:start + _MGET_CHUNK])
            live = [j.job_id for j in jobs if j.state not in TERMINAL_STATES]
            if live:
                await self.redis.sadd(SchedulerKeys.active, *live)
                log.info("discovered %d job(s) from the store: %s", len(live), ", ".join(live[:10]))
        self._discovered_all = True

    async def active_jobs(self) -> list[JobRecord]:
        """Non-terminal jobs (terminal or vanished ids are pruned from the active set)."""
        ids = sorted(await self.redis.smembers(SchedulerKeys.active))
        jobs: list[JobRecord] = []
        for start in range(0, len(ids), _MGET_CHUNK):
            jobs += await self.store.get_jobs(ids[start:start + _MGET_CHUNK])
        live = [j for j in jobs if j.state not in TERMINAL_STATES]
        gone = set(ids) - {j.job_id for j in live}
        if gone:
            await self.redis.srem(SchedulerKeys.active, *gone)
        return live

    async def held_allocations(self) -> dict[str, HeldAllocation]:
        """Every allocation holding a device lease, from the lease keys themselves."""
        keys = [k async for k in self.redis.scan_iter(match=Keys.lease("*", "*"), count=500)]  # type: ignore[arg-type]
        held: dict[str, HeldAllocation] = {}
        for start in range(0, len(keys), _MGET_CHUNK):
            chunk = keys[start:start + _MGET_CHUNK]
            for key, raw in zip(chunk, await self.redis.mget(chunk), strict=True):
                if not raw:
                    continue
                node_id, index = key.removeprefix("ty:lease:").rsplit(":", 1)
                holder = json.loads(raw)
                entry = held.setdefault(holder["allocationId"], HeldAllocation(
                    holder["jobId"], holder["allocationId"], int(holder["epoch"])))
                entry.devices.append(Device(node_id, int(index)))
        return held

    # ------------------------------------------------------------------ applying a transition
    async def _mutate(self, job_id: str, decide: Decide, *, need_checkpoints: bool = False,
                      label: str = "update") -> tr.Outcome | None:
        """Optimistic read-decide-write of one job (see the module docstring); None if unknown."""
        key, ckpt_key = Keys.job(job_id), Keys.checkpoints(job_id)
        for _ in range(100):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(*((key, ckpt_key) if need_checkpoints else (key,)))
                raw = await pipe.get(key)
                if raw is None:
                    return None
                job = JobRecord.model_validate_json(raw)
                final_ready = need_checkpoints and final_checkpoint_ready(job, await pipe.hvals(ckpt_key))
                outcome = decide(job, final_ready)
                if not outcome.changed:
                    if outcome.note:
                        log.debug("job %s (%s): %s", job_id, label, outcome.note)
                    return outcome
                with self._job_span(job, f"scheduler.{label.replace(' ', '_')}"):
                    self._stage(pipe, job_id, outcome)
                    try:
                        await pipe.execute()
                    except WatchError:
                        continue
            if outcome.note:
                log.info("job %s (%s): %s", job_id, label, outcome.note)
            if outcome.release is not None:
                a = outcome.release
                await self._release(a.allocation_id, a.epoch, [Device(*d.rsplit(":", 1)) for d in a.devices])
            return outcome
        raise ConflictError(f"job {job_id}: too many concurrent updates", retryable=True)

    def _stage(self, pipe: object, job_id: str, outcome: tr.Outcome) -> None:
        """Inside the caller's span: the record, its events (outbox) and the active-set entry."""
        pipe.multi()  # type: ignore[attr-defined]
        pipe.set(Keys.job(job_id), outcome.job.dumps())  # type: ignore[attr-defined]
        parent = current_traceparent() or outcome.job.traceparent
        for event in outcome.events:
            self.runtime.outbox.stage(pipe, event, traceparent=parent)  # type: ignore[arg-type]
        if outcome.job.state in TERMINAL_STATES:
            pipe.srem(SchedulerKeys.active, job_id)  # type: ignore[attr-defined]
        else:
            pipe.sadd(SchedulerKeys.active, job_id)  # type: ignore[attr-defined]

    async def _release(self, allocation_id: str, epoch: int, devices: list[Device]) -> None:
        devices = [Device(d.node_id, int(d.index)) for d in devices]
        try:
            await self.leases.release(allocation_id, epoch, devices)
        except FencingError as exc:
            log.warning("release of %s refused: %s", allocation_id, exc)

    @contextlib.contextmanager
    def _job_span(self, job: JobRecord, name: str) -> Iterator[None]:
        """A span in the job's trace: under the current span when it already belongs to it."""
        same = _trace_id(current_traceparent()) == _trace_id(job.traceparent)
        ctx = contextlib.nullcontext() if same or not job.traceparent else job_context(job.traceparent)
        with ctx, _tracer.start_as_current_span(name, attributes={"trainyard.job_id": job.job_id}):
            yield
