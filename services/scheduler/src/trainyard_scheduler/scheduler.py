"""The scheduler's I/O shell: events in, a Redis snapshot, a pure decision, the result applied.

* NODES    NodeHeartbeat → NodeRecord upsert (inventory) + renewal of the node's lease TTLs; one saying
           ``draining`` drains the node, one from a new agent incarnation (``bootId``) ends a drain;
           NodeQuarantined / NodeReinstated from an admin → node excluded / placeable again;
           NodeDrained / NodeUndrained → node drained (no new work, its attempts checkpoint and stop) / back.
* JOBS     JobSubmitted → the job the API stored taken in; JobControlRequested → cancel/pause/resume. Both are
           wake-ups, not facts (anyone on the broker can publish them): a JobSubmitted without the API's record
           creates nothing, one that differs from it loses to it; a control request is acted on only when the
           API recorded it (``Keys.control_requests``) as the event says. A refused event is dead-lettered
           ``security: …``, logged, counted (``trainyard_scheduler_unauthorised_events_total``) and alerted on
           (deploy/prometheus).
* WORKERS  WorkerStarted / WorkerExited → attempt and job transitions; a failure blames its node.
* CHECKPOINTS CheckpointReady → success once the attempt completed and maxSteps is READY; ends a
           pause, drain or preemption once it is the ranks' own stop checkpoint and every rank has exited
           (transitions.stop_checkpoint).
* METRICS  StepMetrics (own consumer group) → straggler detection → StragglerDetected + blame.
* tick     1. leader lease (fenced, epoch)  2. reconcile (when due: attempts — silent nodes judged by
           :mod:`trainyard_scheduler.blame` —, leases, node reinstatement)  3. drains, pauses and
           preemptions in progress  4. snapshot  5. plan  6. admit / preempt / note waits (naming
           quarantined or drained nodes when they are why a job waits).

Node reputation (:mod:`trainyard_scheduler.health`): ``Keys.node_reputation`` holds each node's
decaying failure score; failures attributed to a node (Outcome.blame) and straggler reports add
to it; at ``quarantine_score`` the node gets an entry in ``Keys.node_quarantine`` (no more
placements) and NodeQuarantined(by="reputation") goes out; the leader reinstates it
(NodeReinstated) once the score decays under ``reinstate_score``. An admin quarantines or clears
a node by publishing NodeQuarantined / NodeReinstated with ``by`` = their name. Automatic quarantine
has a floor (``quarantine_max_share`` of a device type, never its last node): beyond it the
scheduler alerts instead (ERROR log + ``trainyard_scheduler_quarantine_withheld_total``).

Every change to a job goes through :meth:`Scheduler._mutate`: WATCH the job key, decide with a
pure function from :mod:`trainyard_scheduler.transitions`, write the record and stage its events
in one MULTI (outbox), then release leases. A concurrent writer makes the MULTI fail and the
decision is taken again on fresh state.

Two instances may run: both consume the events (one consumer group; handlers apply facts and
are safe from any instance), only the leader runs the tick. Everything the tick writes is
fenced by the leader epoch — device grants inside the Lua script, job records by WATCHing the
epoch key — so a paused or partitioned former leader cannot double-book a device or overwrite
a decision of its successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from opentelemetry import trace
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from trainyard_runtime.controlrecords import Refusal, UnauthorisedEventError, control_refusal, parse_control_request
from trainyard_contract.devices import Device
from trainyard_contract.errors import ConfigError, FencingError, LeaseConflictError, StaleLeaderError
from trainyard_contract.events import (
    CHECKPOINTS,
    JOBS,
    METRICS,
    NODES,
    TERMINAL_STATES,
    WORKERS,
    CheckpointFailed,
    CheckpointReady,
    CheckpointRef,
    JobControlRequested,
    JobSubmitted,
    NodeDrained,
    NodeHeartbeat,
    NodeQuarantined,
    NodeReinstated,
    NodeUndrained,
    StepMetrics,
    SecurityViolation,
    WorkerExited,
    WorkerStarted,
    utcnow,
)
from trainyard_contract.records import CheckpointRecord, DatasetRecord, JobRecord, NodeRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import Keys

from trainyard_scheduler import health
from trainyard_scheduler.blame import Silence, SilencePolicy, judge_silence
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.fencing import FencedLeases, Leadership
from trainyard_scheduler.jobtx import Decide, Facts, JobTransactions, job_span
from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.metrics import UNAUTHORISED_EVENTS, ClusterGauges, cluster_view
from trainyard_scheduler.node_health import NodeHealth
from trainyard_scheduler.placement import ClusterSnapshot, GangRequest, Placement
from trainyard_scheduler.planner import Admit, PendingJob, Preempt, RunningJob, Wait, expected_duration_s, plan
from trainyard_scheduler.policy import QueueConfig, parse_queue_config, tenant_seeds, with_tenant_settings
from trainyard_scheduler.ports import SYSTEM_RANDOM, choose_port, live_ports
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.sizing import min_device_memory
from trainyard_scheduler.snapshot import HeldAllocation, Snapshot, SnapshotCache, read_held_allocations

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("trainyard.scheduler")

Clock = Callable[[], datetime]

_DISCOVERY_WINDOW_S = 3600.0
_RECENT_NODE_S = 3600.0  # nodes seen within this long make up the cluster (silence, quarantine floor)
_MGET_CHUNK = 500


def attempt_devices(job: JobRecord) -> list[Device]:
    current = job.current
    if current is None:
        return []
    return [Device(n, int(i)) for n, i in (d.rsplit(":", 1) for d in current.devices)]


def _log_placed(job_id: str, outcome: tr.Outcome, allocation_id: str, lease_epoch: int, placement: Placement) -> None:
    detail = placement.detail
    log.info("job %s: %s (allocation %s, epoch %d, world %d, score %.2f, %s)", job_id, outcome.note,
             allocation_id, lease_epoch, placement.world_size, placement.score,
             f"{detail.nodes} nodes / {detail.racks} racks / {detail.cross_rack_links} cross-rack links"
             if detail else "")


def submission_refusal(event: JobSubmitted, stored: JobRecord | None) -> Refusal | None:
    """Why a JobSubmitted is not the job as the API stored it (None: it is): no record at all (``unrecorded``:
    the event is ignored), or a record with another tenant or spec (``mismatch``: the record wins)."""
    if stored is None:
        return Refusal("unrecorded", f"job {event.job_id} (tenant {event.tenant!r}): no job record written by the API")
    differs = [f"{name} {got!r} (stored {want!r})" for name, got, want in (
        ("tenant", event.tenant, stored.tenant), ("spec", event.spec_hash, stored.spec_hash)) if got != want]
    if differs:
        return Refusal("mismatch", f"job {event.job_id}: the event carries {', '.join(differs)}")
    return None


def _refuse(event_type: str, event: JobSubmitted | JobControlRequested, refusal: Refusal, *, fatal: bool) -> None:
    """Count and log an event the API's record does not back; ``fatal``: refuse it (UnauthorisedEventError, so the
    bus dead-letters it ``security: …`` without marking its id handled), else the record wins and handling goes on."""
    UNAUTHORISED_EVENTS.labels(event_type, refusal.kind).inc()
    if not fatal:
        log.warning("%s %s: %s; keeping the stored job", event_type, event.event_id, refusal.text)
        return
    log.warning("forged/%s %s %s ignored: %s", "unknown" if event_type == "JobSubmitted" else "unrecorded",
                event_type, event.event_id, refusal.text)
    raise UnauthorisedEventError(event_type, refusal)


def _remaining_seconds(job: JobRecord) -> float | None:
    """The spec's ``expectedDurationMinutes`` scaled to what is left after the last attempt's start
    checkpoint (backfill only; None: unknown, so never backfilled past a reservation)."""
    total = expected_duration_s(job.spec.resources.expected_duration_minutes)
    if total is None:
        return None
    current, max_steps = job.current, job.spec.training.max_steps
    done = current.start_checkpoint.global_step if current and current.start_checkpoint else 0
    return total * max(0.0, 1.0 - done / max_steps) if max_steps else total


class Scheduler:
    """Wires the handlers and the tick onto a :class:`ServiceRuntime`; state lives in Redis."""

    def __init__(self, runtime: ServiceRuntime, settings: SchedulerSettings, *, clock: Clock = utcnow,
                 leases: FencedLeases | None = None) -> None:
        self.runtime = runtime
        self.settings = settings
        self.redis = runtime.redis
        self.store = runtime.store
        self.clock = clock
        self.leadership = Leadership(runtime.redis, runtime.instance,
                                     ttl_s=max(settings.leader_ttl_s, 2 * settings.tick_s))
        self.leases = leases or FencedLeases(runtime.redis, ttl_ms=int(settings.lease_ttl_s * 1000))
        self.policy = tr.RetryPolicy(settings.retry_backoff_s, settings.retry_backoff_max_s,
                                     settings.max_total_failures)
        self.deadlines = tr.Deadlines(settings.start_timeout_s, settings.final_checkpoint_timeout_s,
                                      republish_after_s=settings.republish_after_s,
                                      republish_max=settings.republish_max)
        self.silence = SilencePolicy(node_timeout_s=settings.node_timeout_s,
                                     cluster_share=settings.silent_cluster_share,
                                     recent_s=max(_RECENT_NODE_S, settings.node_timeout_s))
        self._leading_since: datetime | None = None
        self.queue = QueueConfig()
        self._queue_base = QueueConfig()  # the last good queue-config document, before tenants' own settings
        self._queue_source: str | None = None
        self._leading: int | None = None
        self._next_reconcile: datetime | None = None
        self._next_config: datetime | None = None
        self._discovered_all = False
        self._jobs_cache: dict[str, tuple[str, JobRecord]] = {}
        # the leader's picture of jobs, nodes and leases, kept current from Keys.changes (snapshot.py)
        self.cache = SnapshotCache(runtime.redis, clock=clock, node_refresh_s=settings.node_refresh_s)
        self._changes_cursor: str | None = None  # the watcher's place in Keys.changes
        self._wake = asyncio.Event()  # set: run the tick now, not at the next tick_s
        self.jobs = JobTransactions(runtime.redis, runtime.outbox)
        self.nodes = NodeHealth(runtime.redis, runtime.store, runtime.outbox, self.leases, self.cache, settings,
                                clock=clock, recent_s=self.silence.recent_s, wake_at=self.wake_at)
        self._memory: dict[str, int] = {}
        self._requests: dict[str, tuple[JobRecord, GangRequest]] = {}  # job id → (record, its gang request)
        self.gauges = ClusterGauges()  # the leader's queue and node numbers (Prometheus)

    def install(self) -> None:
        """Subscribe to the topics and register the tick; call before ``runtime.start()``."""
        bus, dedupe = self.runtime.bus, self.runtime.deduper
        # One consumer group for the job, worker and checkpoint topics (the bus reads them with one consumer).
        group = f"{self.settings.group_prefix}.scheduler"
        nodes = self.nodes
        # The nodes' topic in a group of its own, fetched at the background pace: heartbeats come every few
        # seconds from every node, so a group reading them is never idle (trainyard_runtime.idlefetch) and on
        # the embedded broker fetched 50 times a second; a heartbeat a few hundred ms later changes nothing.
        bus.subscribe(NODES, {NodeHeartbeat: nodes.on_heartbeat, NodeQuarantined: nodes.on_quarantined,
                              NodeReinstated: nodes.on_reinstated, NodeDrained: nodes.on_drained,
                              NodeUndrained: nodes.on_undrained}, group=f"{group}-nodes", background=True)
        bus.subscribe(JOBS, {JobSubmitted: self.on_job_submitted, JobControlRequested: self.on_control},
                      group=group, deduper_factory=dedupe)
        bus.subscribe(WORKERS, {WorkerStarted: self.on_worker_started, WorkerExited: self.on_worker_exited,
                                SecurityViolation: self.on_security_violation},
                      group=group, deduper_factory=dedupe)
        bus.subscribe(CHECKPOINTS, {CheckpointReady: self.on_checkpoint_ready,
                                    CheckpointFailed: self.on_checkpoint_failed},
                      group=group, deduper_factory=dedupe)
        if self.settings.straggler_detection:
            # Its own group: the per-step firehose never delays job events, and costs one dict update each.
            bus.subscribe(METRICS, {StepMetrics: nodes.on_step_metrics}, group=f"{group}-metrics", background=True)
        self.runtime.add_loop("tick", self.tick, self.settings.tick_s, wake=self._wake)
        # a job submitted through the API (or changed by either instance) wakes the pass without a broker hop
        self.runtime.add_loop("changes", self.watch_changes, 0.0)
        # Renewed on its own cadence too, so that a long pass (or an await inside it) never lets it lapse.
        self.runtime.add_loop("leader", self.lead, self.leadership.ttl_ms / 3000)

    async def aclose(self) -> None:
        """Give up the leader lease so a standby does not wait for it to expire."""
        with contextlib.suppress(Exception):
            await self.leadership.resign()

    def wake_at(self, when: datetime | None) -> None:
        """Run the next scheduling pass at ``when`` (None: now) instead of waiting for ``tick_s``:
        a requeued attempt is placed as soon as its back-off ends, a new job as soon as it arrives."""
        delay = 0.0 if when is None else (when - self.clock()).total_seconds()
        if delay <= 0:
            self._wake.set()
        else:
            asyncio.get_running_loop().call_later(min(delay, 3600.0), self._wake.set)

    @property
    def leader_epoch(self) -> int | None:
        """The leader epoch while this instance leads."""
        return self._leading

    # ------------------------------------------------------------------ jobs
    async def on_job_submitted(self, event: JobSubmitted) -> None:
        """A wake-up: the job is the record the API wrote (with its indexes and audit entry), never the event.
        No record: a forged (or unknown) submission, refused (UnauthorisedEventError: dead-lettered) and counted,
        nothing created; a record that differs: the record wins, counted."""
        job = await self.store.get_job(event.job_id)
        if (refusal := submission_refusal(event, job)) is not None:
            _refuse("JobSubmitted", event, refusal, fatal=job is None)
        if job is None:  # refused above
            return
        if job.state not in TERMINAL_STATES and await self._take_in(job) and tr.is_pending(job):
            self.wake_at(None)  # the API stored it: it waits for a pass
        log.info("job %s known (tenant %s, %d %s devices)", job.job_id, job.tenant,
                 job.spec.resources.gpu_count, job.spec.resources.gpu_type)

    async def _take_in(self, job: JobRecord) -> bool:
        """A job new to the scheduler (its JobSubmitted, or the change log): refused if its tenant may not read
        its dataset, else added to the active set. Idempotent; False when refused."""
        refused = await self._refuse_dataset(job)
        async with self.redis.pipeline(transaction=True) as pipe:
            if not refused:
                pipe.sadd(SchedulerKeys.active, job.job_id)
            pipe.srem(Keys.incoming_jobs, job.job_id)
            await pipe.execute()
        if refused:
            return False
        self.cache.accepted.add(job.job_id)
        return True

    async def _refuse_dataset(self, job: JobRecord) -> bool:
        """Fail (never place) a job whose dataset its tenant may not read; True when it was refused."""
        record = await self.store.get_dataset(job.spec.dataset)
        if (reason := tr.dataset_refusal(job.spec.dataset, job.tenant, record)) is None:
            return False
        log.warning("job %s of tenant %s refused: %s", job.job_id, job.tenant, reason)
        await self._mutate(job.job_id, lambda current, _: tr.fail_unstartable(current, reason, self.clock()),
                           label="dataset refused")
        return True

    async def on_control(self, event: JobControlRequested) -> None:
        """A wake-up: acted on only when the API recorded this very request (Keys.control_requests, by the event's
        id, matching job, tenant and action); the recorded request is what is applied. Anything else is refused
        (UnauthorisedEventError: dead-lettered, counted) and changes nothing."""
        raw = await self.redis.hget(Keys.control_requests(event.job_id), str(event.event_id))
        recorded = parse_control_request(raw)
        if (refusal := control_refusal(event, recorded, now=self.clock())) is not None:
            _refuse("JobControlRequested", event, refusal, fatal=True)
        if recorded is None:  # refused above
            return

        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            if job.tenant != recorded.tenant:  # the API records only the job's own tenant: never in practice
                return tr.unchanged(job, f"{recorded.action} from tenant {recorded.tenant!r} ignored: not the owner")
            return tr.request_control(job, recorded.action, recorded.reason, self.clock(),
                                      latest_ready_step=facts.latest_ready_step, grace_s=self.settings.pause_grace_s,
                                      final_ready=facts.final_ready)

        outcome = await self._mutate(event.job_id, decide, need_checkpoints=True, label=f"control {recorded.action}")
        if outcome is None:
            log.warning("%s for unknown job %s ignored", recorded.action, event.job_id)

    # ------------------------------------------------------------------ workers and checkpoints
    async def on_worker_started(self, event: WorkerStarted) -> None:
        await self._mutate(event.job_id, lambda job, _: tr.worker_started(job, event, self.clock()),
                           label="worker started")

    async def on_worker_exited(self, event: WorkerExited) -> None:
        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            return tr.worker_exited(job, event, final_ready=facts.final_ready, policy=self.policy, now=self.clock(),
                                    latest_ready_step=facts.latest_ready_step)

        await self._mutate(event.job_id, decide, need_checkpoints=True, label="worker exited")

    async def on_security_violation(self, event: SecurityViolation) -> None:
        outcome = await self._mutate(event.job_id, lambda job, _: tr.security_violation(job, event, self.clock()),
                                     label="security violation")
        if outcome is None:
            log.warning("security violation for unknown job %s ignored: %s", event.job_id, event.detail)

    async def on_checkpoint_ready(self, event: CheckpointReady) -> None:
        preemptor_waiting = await self._preemptor_waiting(event.job_id)

        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            outcome = tr.checkpoint_ready(job, global_step=event.global_step, now=self.clock())
            current = job.current
            if outcome.changed or current is None or not tr.is_stopping(job):
                return outcome
            latest = facts.latest_ready_step
            if event.attempt == current.attempt:
                latest = max(latest or 0, event.global_step)
            return tr.check_preemption(job, latest_ready_step=latest, preemptor_waiting=preemptor_waiting,
                                       grace_s=self.queue.preemption.checkpoint_grace_seconds, now=self.clock(),
                                       pause_grace_s=self.settings.pause_grace_s)

        await self._mutate(event.job_id, decide, need_checkpoints=True, label="checkpoint ready")

    async def on_checkpoint_failed(self, event: CheckpointFailed) -> None:
        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            return tr.checkpoint_failed(job, global_step=event.global_step, reason=event.reason, attempt=event.attempt,
                                        policy=self.policy, now=self.clock(), latest_ready_step=facts.latest_ready_step)

        await self._mutate(event.job_id, decide, need_checkpoints=True, label="checkpoint failed")

    async def _preemptor_waiting(self, job_id: str) -> bool:
        job = await self.store.get_job(job_id)
        by = job.current.preempted_by if job and job.current else None
        if by is None:
            return False
        preemptor = await self.store.get_job(by)
        return preemptor is not None and tr.is_pending(preemptor)

    # ------------------------------------------------------------------ the tick
    async def lead(self) -> int | None:
        """Take or renew the fenced leader lease; returns the leader epoch while this instance leads."""
        epoch = await self.leadership.maintain()
        if epoch is None:
            if self._leading is not None:
                log.warning("no longer the scheduling leader (epoch %d); standing by", self._leading)
            self._leading = None
        elif epoch != self._leading:
            log.info("scheduling leader now (leader epoch %d, instance %s)", epoch, self.runtime.instance)
            self._leading = epoch
            self._leading_since = self.clock()  # heartbeats before this were not watched: blame waits a timeout
            self._next_reconcile = None  # a new leader repairs first (orphans of its predecessor)
            self.cache.reset()  # and builds its snapshot from Redis
        return self._leading

    async def tick(self) -> None:
        """One scheduling pass; only the leader schedules, and every write it makes is fenced."""
        epoch = await self.lead()
        if epoch is None:
            now = self.clock()
            if self._next_config is None or now >= self._next_config:  # standbys apply the policy too
                await self.load_queue_config()
                self._next_config = now + timedelta(seconds=self.settings.reconcile_interval_s)
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.schedule(epoch)
        except StaleLeaderError as exc:
            log.warning("a newer scheduler leads (%s); standing by", exc)
            self._stand_by()
        except FencingError as exc:  # a fenced write refused for another reason: lead again from scratch
            log.warning("a fenced write was refused (%s); the pass ends, leadership is taken again", exc)
            self._stand_by()
        took = loop.time() - started
        if took > 0.01:  # a long pass (a deep queue): rest before the next one, whatever wakes it meanwhile
            await asyncio.sleep(took * self.settings.pass_rest_ratio)

    def _stand_by(self) -> None:
        self._leading = None
        self.gauges.clear()
        self.leadership.epoch = None

    async def schedule(self, epoch: int) -> None:
        """One pass as leader ``epoch``: 1. repair when due  2. snapshot (only what changed is re-read)
        3. take in new jobs  4. drains and preemptions in progress  5. plan (pure)  6. apply."""
        now = self.clock()
        await self._maybe_reconcile(now, epoch)
        view = await self.cache.refresh()
        jobs = dict(view.jobs)
        await self._take_in_new(view.new_jobs, jobs)
        await self._advance_drains(jobs, epoch, view.drains)
        await self._advance_preemptions(jobs, epoch)
        live = health.live_nodes(view.nodes, now, self.settings.node_timeout_s)
        nodes = health.placeable_nodes(live, quarantined=view.quarantine.keys(), drained=view.drains.keys())
        decisions = self._plan(jobs, nodes, view, now)
        out = health.out_of_service(live, {n.node_id for n in nodes}, quarantine=view.quarantine, drains=view.drains)
        await self._apply(decisions, jobs, epoch, nodes=nodes, out=out)
        self.gauges.publish(cluster_view(
            [j for j in jobs.values() if tr.is_pending(j)], view.nodes, now=now,
            node_timeout_s=self.settings.node_timeout_s, live=[n.node_id for n in live],
            placeable=[n.node_id for n in nodes]))

    async def _maybe_reconcile(self, now: datetime, epoch: int) -> None:
        if self._next_reconcile is None or now >= self._next_reconcile:
            await self.reconcile(now, epoch)
            self._next_reconcile = now + timedelta(seconds=self.settings.reconcile_interval_s)

    async def _take_in_new(self, new: tuple[str, ...], jobs: dict[str, JobRecord]) -> None:
        """Jobs the change log showed first (a submission through the API, before its JobSubmitted arrives):
        what :meth:`_take_in` does, their datasets read in one round trip and the accepted ones added in one."""
        if not new:
            return
        refs = sorted({jobs[i].spec.dataset for i in new})
        found = dict(zip(refs, await self.redis.hmget(Keys.datasets, refs), strict=True))
        accepted = []
        for job_id in new:
            job = jobs[job_id]
            raw = found[job.spec.dataset]
            if tr.dataset_refusal(job.spec.dataset, job.tenant,
                                  DatasetRecord.model_validate_json(raw) if raw else None) is None:
                accepted.append(job_id)
            elif not await self._take_in(job):  # refused: fails it (read again, as the handler does)
                jobs.pop(job_id, None)
        if accepted:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.sadd(SchedulerKeys.active, *accepted)
                pipe.srem(Keys.incoming_jobs, *accepted)
                await pipe.execute()
            self.cache.accepted.update(accepted)

    def _plan(self, jobs: dict[str, JobRecord], nodes: list[NodeRecord], view: Snapshot,
              now: datetime) -> list:
        """The decisions of this pass over the snapshot (pure but for the spec-memory cache)."""
        leased: dict[str, set[int]] = {}
        for allocation in view.held.values():
            for device in allocation.devices:
                leased.setdefault(device.node_id, set()).add(device.index)
        running = [r for j in jobs.values() if (r := self._running(j)) is not None]
        for r in running:  # a live attempt's devices stay taken even if a lease key expired
            for device in r.devices:
                leased.setdefault(device.node_id, set()).add(device.index)
        cluster = ClusterSnapshot.build(nodes, leased, penalties=health.penalties(view.reputation, now,
                                                                                   self.nodes.reputation))
        preempting: dict[str, list[str]] = {}
        for r in running:
            if r.preempted_by is not None:
                preempting.setdefault(r.preempted_by, []).append(r.job_id)
        pending = [self._pending(j, tuple(preempting.get(j.job_id, ()))) for j in jobs.values() if tr.is_pending(j)]
        if len(self._requests) > 2 * len(pending) + 100:
            self._requests = {k: v for k, v in self._requests.items() if k in jobs}
        return plan(cluster, pending, now, running=running, policy=self.queue)

    async def watch_changes(self) -> None:
        """Wake the pass as soon as Keys.changes has something new (while leading; a standby sleeps)."""
        if self._leading is None:
            self._changes_cursor = None
            await asyncio.sleep(min(self.settings.tick_s, 0.5))
            return
        if self._changes_cursor is None:
            last = await self.redis.xrevrange(Keys.changes, count=1)
            self._changes_cursor = last[0][0] if last else "0-0"
        got = await self.redis.xread({Keys.changes: self._changes_cursor}, count=1000, block=1000)
        if got:
            self._changes_cursor = got[0][1][-1][0]
            self.wake_at(None)

    async def _apply(self, decisions: list, jobs: dict[str, JobRecord], epoch: int, *,
                     nodes: list[NodeRecord] | None = None, out: list[health.OutOfService] | None = None) -> None:
        notes = 0
        have: dict[str, int] | None = None  # healthy devices per type on placeable nodes
        for decision in decisions:
            try:
                if isinstance(decision, Admit):
                    await self._admit(decision.job_id, decision.placement, epoch)
                elif isinstance(decision, Preempt):
                    for victim in decision.victims:
                        await self._ask_to_checkpoint(victim, decision, epoch)
                elif isinstance(decision, Wait) and decision.reason is not None:
                    job = jobs[decision.job_id]
                    reason, kind = decision.reason, decision.kind
                    if have is None:
                        have = {}
                        for n in nodes or ():
                            for dev in n.devices:
                                if dev.healthy:
                                    have[dev.type] = have.get(dev.type, 0) + 1
                    if out:  # name quarantined or drained nodes when they are why it waits
                        gpu_type = job.spec.resources.gpu_type
                        reason, kind = health.explain_wait(reason, kind, gpu_type=gpu_type,
                                                           available_devices=have.get(gpu_type, 0), out=out)
                    if (job.queued_reason, job.queued_reason_kind) == (reason, kind):
                        continue
                    if notes >= self.settings.max_wait_notes:
                        continue
                    notes += 1
                    await self._mutate(decision.job_id, lambda j, _, r=reason, k=kind: tr.note_waiting(j, r, k),
                                       label="waiting", fence=epoch)
            except LeaseConflictError as exc:
                log.info("placement of %s raced another allocation, retrying next tick: %s", decision.job_id, exc)
                self.cache.leases_changed()
                self.wake_at(None)

    def _priority(self, job: JobRecord) -> int:
        return self.queue.priority(job.tenant, job.priority)

    def _running(self, job: JobRecord) -> RunningJob | None:
        current = job.current
        if not tr.is_live(current):
            return None
        assert current is not None
        priority = self._priority(job)
        aged = priority + self.queue.boost((current.started_at - job.created_at).total_seconds())
        remaining = _remaining_seconds(job)
        return RunningJob(job_id=job.job_id, tenant=job.tenant, priority=priority,
                          gpu_type=job.spec.resources.gpu_type, devices=tuple(attempt_devices(job)),
                          started_at=current.started_at, preempted_by=current.preempted_by, admitted_priority=aged,
                          expected_end=current.started_at + timedelta(seconds=remaining) if remaining else None)

    def _pending(self, job: JobRecord, preempting: tuple[str, ...]) -> PendingJob:
        """The planner's view of a queued job; its gang request is kept while the record is the same object
        (the snapshot hands out the same record until it changes)."""
        cached = self._requests.get(job.job_id)
        if cached is None or cached[0] is not job:
            if job.spec_hash not in self._memory:
                if len(self._memory) > 10_000:
                    self._memory.clear()
                self._memory[job.spec_hash] = min_device_memory(job.spec)
            cached = self._requests[job.job_id] = (
                job, GangRequest.from_spec(job.spec, min_memory_bytes=self._memory[job.spec_hash]))
        return PendingJob(
            job_id=job.job_id, request=cached[1], submitted_at=job.created_at, priority=self._priority(job),
            not_before=tr.retry_not_before(job, self.policy), tenant=job.tenant, preempting=preempting,
            expected_duration_s=_remaining_seconds(job),
        )

    async def _admit(self, job_id: str, placement: Placement, epoch: int) -> None:
        """Reserve (leases, fenced Lua), persist (attempt + GangAllocated in one fenced MULTI), undo on conflict.

        Four round trips for a new job: WATCH, GET, the lease grant (its Lua refuses a stale leader) with the
        port counter beside it, and the MULTI (WATCHing the leader epoch: a takeover after the grant fails it).
        """
        devices = placement.devices()
        async with self.redis.pipeline(transaction=True) as pipe:
            # 1. the job, WATCHed with the leader epoch, still pending
            await pipe.watch(Keys.job(job_id), SchedulerKeys.leader_epoch)
            raw = await pipe.get(Keys.job(job_id))
            job = JobRecord.model_validate_json(raw) if raw else None
            if job is None or not tr.is_pending(job):
                return
            # 2. what the attempt starts from: not before a settling checkpoint is READY; unstartable fails it
            settling = await self._settling_checkpoint(job)
            if settling is not None:  # placing now would fence it out; decided again next tick
                await self._wait_for_settling(job, settling, epoch)
                return
            number = len(job.attempts) + 1
            allocation_id = f"{job_id}-a{number}-{uuid.uuid4().hex[:8]}"
            try:
                start = await self._start_checkpoint(job)
            except ConfigError as exc:
                await self._fail_unstartable(pipe, job, exc, epoch)
                return
            every = await self._advised_interval(job)
            # 3. reserve: the leases (the grant refuses a stale leader) and the rendezvous port
            granted, port = await asyncio.gather(self.leases.acquire(epoch, job_id, allocation_id, devices),
                                                 self._next_port(), return_exceptions=True)
            if isinstance(granted, BaseException):
                raise granted
            lease_epoch = granted
            # 4. persist the attempt and its GangAllocated; undo the reservation when that fails or is declined
            try:
                if isinstance(port, BaseException):
                    raise port
                with job_span(job, "scheduler.place"):
                    outcome = tr.admit(job, placement=placement, allocation_id=allocation_id, epoch=lease_epoch,
                                       master_port=port, start_checkpoint=start, now=self.clock(),
                                       checkpoint_every_steps=every)
                    written = outcome.changed and await self.jobs.try_execute(pipe, job_id, outcome)
            except BaseException:
                await self._release(allocation_id, lease_epoch, devices)
                raise
            if not written:  # the transition declined, or the job or the leader epoch changed under WATCH
                await self._release(allocation_id, lease_epoch, devices)
                if outcome.changed:
                    log.info("job %s or the leader changed while it was being placed; placement undone", job_id)
                else:
                    log.info("job %s: placement undone (%s)", job_id, outcome.note or "no longer placeable")
                return
        _log_placed(job_id, outcome, allocation_id, lease_epoch, placement)

    async def _wait_for_settling(self, job: JobRecord, settling: CheckpointRecord, epoch: int) -> None:
        """Note on the job that its next attempt waits for ``settling`` to become READY (to resume from it)."""
        reason = (f"checkpoint: waiting up to {self.settings.checkpoint_settle_s:.0f}s for "
                  f"{settling.checkpoint_id} (every shard written) to become READY, so that attempt "
                  f"{len(job.attempts) + 1} resumes from it")
        await self._mutate(job.job_id, lambda j, _: tr.note_waiting(j, reason, "checkpoint"),
                           label="waiting", fence=epoch)

    async def _fail_unstartable(self, pipe: Pipeline, job: JobRecord, exc: ConfigError, epoch: int) -> None:
        """Fail a job whose start cannot be resolved, in ``pipe``'s MULTI (still WATCHing the job)."""
        await self.jobs.check_epoch(pipe, epoch)  # no lease grant fences this write
        outcome = tr.fail_unstartable(job, str(exc), self.clock())
        self.jobs.stage(pipe, job.job_id, outcome)
        with contextlib.suppress(WatchError):  # changed meanwhile: decided again next tick
            await pipe.execute()
            log.warning("job %s cannot start: %s", job.job_id, exc)

    async def _ask_to_checkpoint(self, victim: str, decision: Preempt, epoch: int) -> None:
        latest = await self.store.latest_ready_checkpoint(victim)
        grace = self.queue.preemption.checkpoint_grace_seconds

        def decide(job: JobRecord, _: Facts) -> tr.Outcome:
            return tr.request_preemption(job, by=decision.job_id, reason=decision.reason,
                                         latest_ready_step=latest.global_step if latest else None,
                                         grace_s=grace, now=self.clock())

        await self._mutate(victim, decide, label="preempt", fence=epoch)

    async def _advance_drains(self, jobs: dict[str, JobRecord], epoch: int, drains: dict[str, dict]) -> None:
        """Ask the live attempts on drained nodes to checkpoint and stop (once; the pause protocol)."""
        if not drains:
            return
        for job in list(jobs.values()):
            current = job.current
            if not tr.is_live(current) or current is None or current.interruption is not None:
                continue
            hit = [n for n in current.nodes if n in drains]
            if not hit:
                continue
            entry = drains[hit[0]]
            reason = f"node {', '.join(hit)} drained by {entry.get('by') or 'admin'} ({entry.get('reason')})"

            def decide(j: JobRecord, facts: Facts, r: str = reason) -> tr.Outcome:
                return tr.request_drain(j, reason=r, latest_ready_step=facts.latest_ready_step,
                                        grace_s=self.settings.pause_grace_s, now=self.clock())

            outcome = await self._mutate(job.job_id, decide, need_checkpoints=True, label="drain", fence=epoch)
            if outcome is not None and outcome.changed:
                jobs[job.job_id] = outcome.job

    async def _advance_preemptions(self, jobs: dict[str, JobRecord], epoch: int) -> None:
        """Revoke pausing or preempted attempts whose checkpoint is READY or whose grace ran out;
        withdraw needless preemptions."""
        grace = self.queue.preemption.checkpoint_grace_seconds
        for job in list(jobs.values()):
            current = job.current
            if current is None or not tr.is_stopping(job):
                continue
            preemptor = jobs.get(current.preempted_by) if current.preempted_by else None
            waiting = preemptor is not None and tr.is_pending(preemptor)

            def decide(j: JobRecord, facts: Facts, w: bool = waiting) -> tr.Outcome:
                return tr.check_preemption(j, latest_ready_step=facts.latest_ready_step, preemptor_waiting=w,
                                           grace_s=grace, now=self.clock(), pause_grace_s=self.settings.pause_grace_s)

            outcome = await self._mutate(job.job_id, decide, need_checkpoints=True, label="preemption",
                                         fence=epoch)
            if outcome is not None and outcome.changed:
                jobs[job.job_id] = outcome.job

    async def _advised_interval(self, job: JobRecord) -> int | None:
        """With ``checkpointPolicy.auto``: the coordinator's Young/Daly interval in steps, once it has one."""
        if not getattr(job.spec.checkpoint_policy, "auto", False):
            return None
        raw = await self.redis.get(Keys.checkpoint_advice(job.job_id))
        try:
            steps = json.loads(raw).get("intervalSteps") if raw else None
        except (ValueError, AttributeError):
            return None
        return int(steps) if isinstance(steps, int | float) and steps >= 1 else None

    async def _settling_checkpoint(self, job: JobRecord) -> CheckpointRecord | None:
        """A complete, not yet READY checkpoint of the attempt that just ended (tr.checkpoint_settling)."""
        current, settle_s = job.current, self.settings.checkpoint_settle_s
        if current is None or current.ended_at is None \
                or self.clock() >= current.ended_at + timedelta(seconds=settle_s):
            return None
        records = await self.store.list_checkpoints(job.job_id)
        recorded = {c.checkpoint_id: await self.redis.hlen(Keys.shards(job.job_id, c.attempt, c.global_step))
                    for c in records if c.state == "PENDING" and c.attempt == current.attempt}
        return tr.checkpoint_settling(job, records, recorded, now=self.clock(), settle_s=settle_s)

    async def _start_checkpoint(self, job: JobRecord) -> CheckpointRef | None:
        """The job's latest READY checkpoint; before it has one, the ``initFrom`` job's checkpoint
        (the trainer then takes only its weights). ConfigError: ``initFrom`` names none READY.
        ``initFrom.huggingFace`` is no checkpoint: the trainer reads that directory (named in the spec)
        when it has none of its own."""
        latest = await self.store.latest_ready_checkpoint(job.job_id) if job.attempts else None  # none before
        if latest is not None and latest.manifest_uri:
            return CheckpointRef(manifest_uri=latest.manifest_uri, global_step=latest.global_step,
                                 attempt=latest.attempt, content_hash=latest.content_hash)
        init = job.spec.init_from
        if init is None or init.job_id is None:
            return None
        parent = await self.store.get_job(init.job_id)
        ready = [c for c in await self.store.list_checkpoints(init.job_id)
                 if c.state == "READY" and c.manifest_uri and (init.global_step is None
                                                              or c.global_step == init.global_step)]
        if parent is None or parent.tenant != job.tenant or not ready:
            at = "" if init.global_step is None else f" at step {init.global_step}"
            raise ConfigError(f"initFrom: job {init.job_id} has no READY checkpoint{at} (any more)")
        chosen = ready[-1]
        return CheckpointRef(manifest_uri=chosen.manifest_uri or "", global_step=chosen.global_step,
                             attempt=chosen.attempt, content_hash=chosen.content_hash)

    async def _next_port(self) -> int:
        """A random rendezvous port, none that a live attempt holds (:mod:`ports`; the snapshot brought up to date
        first, so attempts placed earlier in this pass count)."""
        view = await self.cache.refresh()
        return choose_port(SYSTEM_RANDOM, self.settings.rendezvous_port_min, self.settings.rendezvous_port_max,
                           live_ports(view.jobs.values()))

    # ------------------------------------------------------------------ reconcile
    async def reconcile(self, now: datetime, epoch: int) -> None:
        """Repair from durable state: config, job discovery, live attempts, orphan and expired leases."""
        await self.load_queue_config()
        await self._discover_jobs(now)
        await self.nodes.reinstate_recovered(now)
        # Liveness, not placeability: a quarantined node's running attempts run on.
        available = frozenset(n.node_id for n in await self.nodes.available_nodes(now, include_quarantined=True))
        last_seen = {n.node_id: n.last_seen for n in await self.store.list_nodes()}
        draining = frozenset(await self.redis.hkeys(Keys.node_drain))

        def judge(nodes: list[str]) -> Silence:
            return judge_silence(nodes, available=available, last_seen=last_seen, draining=draining,
                                 watching_since=self._leading_since, now=self.clock(), policy=self.silence)

        watched = (now - self._leading_since).total_seconds() if self._leading_since else 0.0
        jobs = await self.active_jobs()
        for job in jobs:
            current = job.current
            if current is None or not (tr.is_live(current) or current.state == "succeeded"):
                continue

            def decide(j: JobRecord, facts: Facts) -> tr.Outcome:
                return tr.check_attempt(j, available_nodes=available, final_ready=facts.final_ready,
                                        deadlines=self.deadlines, policy=self.policy, now=self.clock(),
                                        latest_ready_step=facts.latest_ready_step, judge=judge,
                                        watched_s=watched)

            await self._mutate(job.job_id, decide, need_checkpoints=True, label="reconcile", fence=epoch)
        held = await self.held_allocations()
        for allocation in held.values():
            job = await self.store.get_job(allocation.job_id)
            current = job.current if job else None
            if current is None or current.allocation_id != allocation.allocation_id or not tr.is_live(current):
                await self._release(allocation.allocation_id, allocation.epoch, allocation.devices, fence=epoch)
                log.warning("released orphan allocation %s of job %s", allocation.allocation_id, allocation.job_id)
        for job in await self.active_jobs():
            current = job.current
            if not tr.is_live(current) or current is None:
                continue
            have = len(held[current.allocation_id].devices) if current.allocation_id in held else 0
            if have < len(current.devices):
                restored, conflicts = await self.leases.restore(epoch, current.allocation_id, current.epoch,
                                                                attempt_devices(job))
                log.warning("job %s: restored %d expired lease(s) of allocation %s%s", job.job_id, restored,
                            current.allocation_id, f" ({conflicts} held by others!)" if conflicts else "")
        await self.cache.verify()  # the snapshot, reloaded whole: what the change log missed is counted

    async def load_queue_config(self) -> None:
        """The queue policy: the document from Redis (wins) or the file (a bad one is logged and the last good
        kept), then each tenant's own settings from ``ty:sched:tenant-config`` over it — the document's
        tenants seed that hash for tenants without an entry (see policy.py)."""
        base, source = await self._queue_document()
        stored = await self.redis.hgetall(SchedulerKeys.tenant_config)
        seeds = tenant_seeds(base, stored)
        for tenant, doc in seeds.items():
            await self.redis.hsetnx(SchedulerKeys.tenant_config, tenant, doc)
        if seeds:
            log.info("seeded the settings of tenant(s) %s from %s", ", ".join(sorted(seeds)), source)
            stored = await self.redis.hgetall(SchedulerKeys.tenant_config)
        config, problems = with_tenant_settings(base, stored)
        for problem in problems:
            log.error("ignoring unreadable stored settings of %s", problem)
        if config != self.queue or source != self._queue_source:
            log.info("queue config from %s and %d stored tenant setting(s): %d tenant(s), %d priority class(es)",
                     source, len(stored), len(config.tenants), len(config.priority_classes))
        self.queue, self._queue_source = config, source

    async def _queue_document(self) -> tuple[QueueConfig, str | None]:
        """The queue-config document (Redis key, else the file, else the defaults); the last good one when the
        current one cannot be read or parsed."""
        text, source = await self.redis.get(SchedulerKeys.queue_config), f"redis {SchedulerKeys.queue_config}"
        if text is None and self.settings.queue_config is not None:
            path = Path(self.settings.queue_config)
            try:
                text, source = path.read_text(), str(path)
            except OSError as exc:
                log.error("cannot read the queue config %s: %r", path, exc)
                return self._queue_base, self._queue_source
        if text is None:
            self._queue_base = QueueConfig()
            return self._queue_base, None
        try:
            self._queue_base = parse_queue_config(text, source=source)
        except ConfigError as exc:
            log.error("keeping the previous queue config: %s", exc)
            return self._queue_base, self._queue_source
        return self._queue_base, source

    async def _discover_jobs(self, now: datetime) -> None:
        """Jobs stored without a trace the scheduler follows (no JobSubmitted, no incoming entry: a record
        written by an older API) become incoming, so the pass takes them in; incoming entries of jobs that
        ended before they were taken in are dropped."""
        if self._discovered_all:
            since = (now - timedelta(seconds=_DISCOVERY_WINDOW_S)).timestamp()
            ids = await self.redis.zrangebyscore(Keys.jobs, since, "+inf")
        else:
            ids = await self.redis.zrange(Keys.jobs, 0, -1)
        active, incoming = await self.redis.smembers(SchedulerKeys.active), await self.redis.smembers(Keys.incoming_jobs)
        missing = [i for i in ids if i not in active and i not in incoming]
        for start in range(0, len(missing), _MGET_CHUNK):
            jobs = await self.store.get_jobs(missing[start:start + _MGET_CHUNK])
            live = [j.job_id for j in jobs if j.state not in TERMINAL_STATES]
            if live:
                await self.redis.sadd(Keys.incoming_jobs, *live)
                log.info("discovered %d job(s) from the store: %s", len(live), ", ".join(live[:10]))
        waiting = sorted(incoming)
        for start in range(0, len(waiting), _MGET_CHUNK):
            chunk = waiting[start:start + _MGET_CHUNK]
            got = {j.job_id: j for j in await self.store.get_jobs(chunk)}
            gone = [i for i in chunk if i not in got or got[i].state in TERMINAL_STATES or i in active]
            if gone:
                await self.redis.srem(Keys.incoming_jobs, *gone)
        self._discovered_all = True

    async def active_jobs(self) -> list[JobRecord]:
        """Non-terminal jobs (terminal or vanished ids are pruned from the active set).

        Records are parsed again only when their JSON changed since the last call.
        """
        ids = sorted(await self.redis.smembers(SchedulerKeys.active))
        jobs: list[JobRecord] = []
        cache: dict[str, tuple[str, JobRecord]] = {}
        for start in range(0, len(ids), _MGET_CHUNK):
            chunk = ids[start:start + _MGET_CHUNK]
            for job_id, raw in zip(chunk, await self.redis.mget([Keys.job(i) for i in chunk]), strict=True):
                if not raw:
                    continue
                hit = self._jobs_cache.get(job_id)
                record = hit[1] if hit and hit[0] == raw else JobRecord.model_validate_json(raw)
                cache[job_id] = (raw, record)
                jobs.append(record)
        self._jobs_cache = cache
        live = [j for j in jobs if j.state not in TERMINAL_STATES]  # transitions never mutate their input
        gone = set(ids) - {j.job_id for j in live}
        if gone:
            await self.redis.srem(SchedulerKeys.active, *gone)
        return live

    async def held_allocations(self) -> dict[str, HeldAllocation]:
        """Every allocation holding a device lease, from the lease keys themselves."""
        return await read_held_allocations(self.redis)

    # ------------------------------------------------------------------ applying a transition
    async def _mutate(self, job_id: str, decide: Decide, *, need_checkpoints: bool = False,
                      label: str = "update", fence: int | None = None) -> tr.Outcome | None:
        """One job transaction (:meth:`JobTransactions.apply`), then what follows a written change: leases
        released, the pass woken, nodes blamed. None if the job is unknown.

        ``fence``: the leader epoch this write is made under; StaleLeaderError once another scheduler has taken over.
        """
        applied = await self.jobs.apply(job_id, decide, need_checkpoints=need_checkpoints, label=label, fence=fence)
        if applied is None:
            return None
        before, outcome = applied
        if not outcome.changed:
            return outcome
        if outcome.release is not None:
            a = outcome.release
            await self._release(a.allocation_id, a.epoch, [Device(*d.rsplit(":", 1)) for d in a.devices])
        if tr.is_pending(outcome.job) and not tr.is_pending(before):  # requeued or resumed: place it ASAP
            self.wake_at(tr.retry_not_before(outcome.job, self.policy))
        elif outcome.release is not None:  # devices came free for whoever waits
            self.wake_at(None)
        for node_id, reason in outcome.blame:
            weight = self.nodes.reputation.weight(reason)
            if weight > 0:  # what the job's ranks said of themselves counts against the tenant's cap; silence does not
                await self.nodes.blame_node(node_id, reason, weight,
                                            tenant=None if reason == "lost" else outcome.job.tenant)
        return outcome

    async def _release(self, allocation_id: str, epoch: int, devices: list[Device], *,
                       fence: int | None = None) -> None:
        devices = [Device(d.node_id, int(d.index)) for d in devices]
        try:
            await self.leases.release(allocation_id, epoch, devices, leader_epoch=fence)
        except StaleLeaderError:
            if fence is not None:  # this instance no longer leads: the pass ends (tick stands by)
                raise
            log.warning("release of %s refused: a newer leader took over", allocation_id)
        except FencingError as exc:
            log.warning("release of %s refused: %s", allocation_id, exc)
