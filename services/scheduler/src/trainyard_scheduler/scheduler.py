"""The scheduler service, composed: its parts wired onto a :class:`ServiceRuntime`; state lives in Redis.

Each part holds one concern (kueue's ``pkg/scheduler`` shape), around pure decisions:

========================  ==========================================================  ==============================
part                      does                                                        decided by (pure)
========================  ==========================================================  ==============================
:mod:`node_health`        NodeHeartbeat, drains, quarantine, reputation, stragglers   :mod:`health`, :mod:`blame`
:mod:`handlers`           JobSubmitted (wake-up, audit), control, workers, checkpoints :mod:`transitions`
:mod:`cycle`              the tick and the leader's pass, in numbered phases          :mod:`planner` (:mod:`quota`,
                                                                                      :mod:`backfill`,
                                                                                      :mod:`preemption`) over
                                                                                      :mod:`placement` /
                                                                                      :mod:`topology`
:mod:`intake`             the one door: jobs the change log shows first, taken in     ``transitions.dataset_refusal``
:mod:`admission`          reserve, persist, undo                                      ``transitions.admit``
:mod:`stops`              drains, pauses and preemptions applied                      ``transitions.request_*``
:mod:`reconcile`          repair from durable state; :mod:`discovery` of jobs         ``transitions.check_attempt``
:mod:`leader`             this instance's term of the fenced lease (:mod:`fencing`)   —
:mod:`queueconfig`        the queue policy loaded                                     :mod:`policy`
:mod:`writer`             one job transaction (:mod:`jobtx`) and what follows it      —
========================  ==========================================================  ==============================

Two instances may run: both consume the events (one consumer group; handlers apply facts and are safe from any
instance), only the leader runs the pass. Everything the pass writes is fenced by the leader epoch — device grants
inside the Lua script, job records by WATCHing the epoch key — so a paused or partitioned former leader cannot
double-book a device or overwrite a decision of its successor (design.md §3.7, §5.2).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime

from trainyard_contract.events import (
    CHECKPOINTS,
    JOBS,
    METRICS,
    NODES,
    WORKERS,
    CheckpointFailed,
    CheckpointReady,
    JobControlRequested,
    JobSubmitted,
    NodeDrained,
    NodeHeartbeat,
    NodeQuarantined,
    NodeReinstated,
    NodeUndrained,
    SecurityViolation,
    StepMetrics,
    WorkerExited,
    WorkerStarted,
    EnvironmentPreparing,
    utcnow,
)
from trainyard_runtime.service import ServiceRuntime

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.admission import Admission
from trainyard_scheduler.blame import SilencePolicy
from trainyard_scheduler.cycle import SchedulingCycle
from trainyard_scheduler.discovery import JobDiscovery
from trainyard_scheduler.faults import with_faults
from trainyard_scheduler.fencing import FencedLeases, Leadership
from trainyard_scheduler.handlers import JobHandlers
from trainyard_scheduler.intake import Intake
from trainyard_scheduler.jobtx import JobTransactions
from trainyard_scheduler.leader import LeaderRole
from trainyard_scheduler.node_health import NodeHealth
from trainyard_scheduler.policy import QueueConfig
from trainyard_scheduler.queueconfig import QueueConfigSource
from trainyard_scheduler.queueview import QueueView
from trainyard_scheduler.reconcile import Reconciler
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.snapshot import HeldAllocation, SnapshotCache, read_held_allocations
from trainyard_scheduler.stops import Stops
from trainyard_scheduler.writer import JobWriter

Clock = Callable[[], datetime]

_RECENT_NODE_S = 3600.0  # nodes seen within this long make up the cluster (silence, quarantine floor)


class Scheduler:
    """The scheduler's parts, built from one settings object and wired onto the runtime by :meth:`install`."""

    def __init__(self, runtime: ServiceRuntime, settings: SchedulerSettings, *, clock: Clock = utcnow,
                 leases: FencedLeases | None = None) -> None:
        self.runtime, self.settings, self.clock = runtime, settings, clock
        self.redis, self.store = runtime.redis, runtime.store
        self.leases = leases or FencedLeases(runtime.redis, ttl_ms=int(settings.lease_ttl_s * 1000))
        self.policy = tr.RetryPolicy(initial_interval_s=settings.retry_backoff_s,
                                     maximum_interval_s=settings.retry_backoff_max_s,
                                     maximum_attempts=settings.max_total_failures)
        self.silence = SilencePolicy(node_timeout_s=settings.node_timeout_s,
                                     cluster_share=settings.silent_cluster_share,
                                     recent_s=max(_RECENT_NODE_S, settings.node_timeout_s))
        self._wake = asyncio.Event()  # set: run the tick now, not at the next tick_s
        # the leader's picture of jobs, nodes and leases, kept current from Keys.changes (snapshot.py)
        self.cache = SnapshotCache(runtime.redis, clock=clock, node_refresh_s=settings.node_refresh_s)
        self.jobs = JobTransactions(runtime.redis, runtime.outbox)
        self.nodes = NodeHealth(runtime.redis, runtime.store, runtime.outbox, self.leases, self.cache, settings,
                                clock=clock, recent_s=self.silence.recent_s, wake_at=self.wake_at)
        self.writer = JobWriter(self.jobs, self.leases, self.nodes, self.policy, wake_at=self.wake_at)
        self.queue_config = QueueConfigSource(runtime.redis, settings.queue_config)
        self.leader = LeaderRole(Leadership(runtime.redis, runtime.instance,
                                            ttl_s=max(settings.leader_ttl_s, 2 * settings.tick_s)),
                                 runtime.instance, clock=clock, on_new_term=self._new_term)
        self.handlers = JobHandlers(redis=self.redis, store=self.store, writer=self.writer, queue=self.queue_config,
                                    pause_grace_s=settings.pause_grace_s, clock=clock, wake_at=self.wake_at)
        self.discovery = JobDiscovery(self.redis, self.store)
        self.reconciler = Reconciler(
            redis=self.redis, store=self.store, queue=self.queue_config, discovery=self.discovery, nodes=self.nodes,
            leases=self.leases, writer=self.writer, cache=self.cache, leader=self.leader, silence=self.silence,
            deadlines=tr.Deadlines(settings.start_timeout_s, settings.final_checkpoint_timeout_s,
                                   republish_after_s=settings.republish_after_s,
                                   republish_max=settings.republish_max),
            clock=clock, interval_s=settings.reconcile_interval_s,
            verify_every=max(1, round(settings.snapshot_verify_s / settings.reconcile_interval_s)))
        self.admission = Admission(redis=self.redis, store=self.store, leases=self.leases, jobs=self.jobs,
                                   writer=self.writer, cache=self.cache, settings=settings, clock=clock)
        self.stops = Stops(store=self.store, writer=self.writer, queue=self.queue_config,
                           pause_grace_s=settings.pause_grace_s, clock=clock)
        self.cycle = SchedulingCycle(
            redis=self.redis, settings=settings, clock=clock, leader=self.leader, queue=self.queue_config,
            cache=self.cache, reconciler=self.reconciler,
            intake=Intake(self.redis, self.cache, self.writer, clock=clock), stops=self.stops,
            view=QueueView(self.policy, self.nodes.reputation), admission=self.admission, writer=self.writer,
            wake_at=self.wake_at)

    def install(self) -> None:
        """Subscribe to the topics and register the loops; call before ``runtime.start()``."""
        bus, dedupe = self.runtime.bus, self.runtime.deduper
        # One consumer group for the job, worker and checkpoint topics (the bus reads them with one consumer).
        group = f"{self.settings.group_prefix}.scheduler"
        nodes, jobs = self.nodes, self.handlers
        # The nodes' heartbeats in a group of their own, a fetched batch at a time and at the background pace:
        # they come every few seconds from every node (thousands a second at 4,096 nodes), so a group reading them
        # is never idle (trainyard_runtime.idlefetch); a heartbeat a few hundred ms later changes nothing, one
        # handled late by an overloaded instance would make its node look silent. The admins' node events (rare)
        # in another group.
        bus.subscribe_batch(NODES, NodeHeartbeat, nodes.on_heartbeats, group=f"{group}-nodes", background=True)
        bus.subscribe(NODES, {NodeQuarantined: nodes.on_quarantined, NodeReinstated: nodes.on_reinstated,
                              NodeDrained: nodes.on_drained, NodeUndrained: nodes.on_undrained},
                      group=f"{group}-node-admin", background=True)
        bus.subscribe(JOBS, {JobSubmitted: jobs.on_job_submitted, JobControlRequested: jobs.on_control},
                      group=group, deduper_factory=dedupe)
        # The ranks' news a fetched batch at a time in a group of its own (a gang's WorkerStarted are one write
        # of the job, not one per rank); handled ids are remembered under the main group's name, as before.
        jobs.seen = dedupe(group)
        bus.subscribe_batch(WORKERS, (WorkerStarted, WorkerExited, EnvironmentPreparing, SecurityViolation),
                            jobs.on_worker_batch, group=f"{group}-workers")
        bus.subscribe(CHECKPOINTS, {CheckpointReady: jobs.on_checkpoint_ready,
                                    CheckpointFailed: jobs.on_checkpoint_failed},
                      group=group, deduper_factory=dedupe)
        if self.settings.straggler_detection:
            # Its own group: the per-step firehose never delays job events, and costs one dict update each.
            bus.subscribe_batch(METRICS, StepMetrics, nodes.on_step_metrics_batch, group=f"{group}-metrics",
                                background=True)
        self.runtime.add_loop("heartbeats", self.nodes.flush_heartbeats, self.settings.heartbeat_flush_s)
        self.runtime.add_loop("tick", self.cycle.tick, self.settings.tick_s, wake=self._wake)
        # the periodic repair beside the passes (a term's first is its first pass's own)
        self.runtime.add_loop("reconcile", self.cycle.repair,
                              max(0.05, min(self.settings.tick_s, self.settings.reconcile_interval_s / 5)))
        # a job submitted through the API (or changed by either instance) wakes the pass without a broker hop
        self.runtime.add_loop("changes", self.cycle.watch_changes, 0.0)
        # Renewed on its own cadence too, so that a long pass (or an await inside it) never lets it lapse.
        self.runtime.add_loop("leader", self.leader.renew, self.leader.leadership.ttl_ms / 3000)

    async def aclose(self) -> None:
        """Give up the leader lease so a standby does not wait for it to expire."""
        with contextlib.suppress(Exception):
            await self.leader.resign()

    def _new_term(self) -> None:
        """This instance just took the lead: repair first (its predecessor's orphans), from a snapshot rebuilt."""
        self.reconciler.due_now()
        self.cache.reset()
        self.cycle.new_term()

    def wake_at(self, when: datetime | None) -> None:
        """Run the next scheduling pass at ``when`` (None: now) instead of waiting for ``tick_s``:
        a requeued attempt is placed as soon as its back-off ends, a new job as soon as it arrives."""
        delay = 0.0 if when is None else (when - self.clock()).total_seconds()
        if delay <= 0:
            self._wake.set()
        else:
            asyncio.get_running_loop().call_later(min(delay, 3600.0), self._wake.set)

    # ------------------------------------------------------------------ what callers and tests drive directly
    @property
    def leader_epoch(self) -> int | None:
        """The leader epoch while this instance leads."""
        return self.leader.epoch

    @property
    def queue(self) -> QueueConfig:
        """The queue policy in force."""
        return self.queue_config.config

    async def tick(self) -> None:
        """One pass, then the repair when due: what the "tick" and "reconcile" loops do, one after the other."""
        await self.cycle.tick()
        await self.cycle.repair()

    async def load_queue_config(self) -> None:
        await self.queue_config.load()

    async def held_allocations(self) -> dict[str, HeldAllocation]:
        """Every allocation holding a device lease, from the lease keys themselves."""
        return await read_held_allocations(self.redis)


__all__ = ["Scheduler"]


def build_service(settings: SchedulerSettings) -> ServiceRuntime:
    """The scheduler wired into a :class:`ServiceRuntime` (not started); closing gives up the leader lease first."""
    runtime = ServiceRuntime("scheduler", settings)
    leases = FencedLeases(runtime.redis, ttl_ms=int(settings.lease_ttl_s * 1000))
    scheduler = Scheduler(runtime, settings, leases=with_faults(leases, admit_pause_s=settings.admit_pause_s))
    scheduler.install()
    runtime.add_closer(scheduler.aclose)
    return runtime
