"""The scheduling cycle: the tick, and one pass of the leader in numbered phases (kueue's ``schedule()``).

tick  1. leader lease (fenced, epoch); a standby only keeps the queue policy current
pass  1. a term's first repair (:mod:`reconcile`; later ones run beside the passes: :meth:`SchedulingCycle.repair`)
      2. the snapshot brought up to date from the change log
      (:mod:`snapshot`)  3. new jobs taken in (:mod:`intake`, the one door)  4. drains, pauses and preemptions in
      progress (:mod:`stops`)  5. plan — pure (:mod:`queueview` → :func:`planner.plan`)  6. apply: admit
      (:mod:`admission`) / preempt (:mod:`stops`) / note waits, naming quarantined or drained nodes when they are
      why a job waits.

The pass runs when the tick comes (``tick_s``), when :meth:`SchedulingCycle.watch_changes` sees the change log move
(a submission is placed without a broker hop, design.md §3.9), and when anything calls the scheduler's ``wake_at``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from redis.asyncio import Redis

from trainyard_contract.errors import FencingError, LeaseConflictError, StaleLeaderError
from trainyard_contract.records import JobRecord, NodeRecord
from trainyard_runtime.store import Keys

from trainyard_scheduler import health
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.admission import Admission
from trainyard_scheduler.intake import Intake
from trainyard_scheduler.leader import LeaderRole
from trainyard_scheduler.metrics import PASS_DECISIONS, PASS_SECONDS, TAKEOVER_SECONDS, ClusterGauges, cluster_view
from trainyard_scheduler.planner import Admit, Decision, Preempt, Wait
from trainyard_scheduler.queueconfig import QueueConfigSource
from trainyard_scheduler.queueview import QueueView
from trainyard_scheduler.reconcile import Reconciler
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.snapshot import SnapshotCache
from trainyard_scheduler.stops import Stops
from trainyard_scheduler.writer import JobWriter, WakeAt

log = logging.getLogger(__name__)


def healthy_devices(nodes: Sequence[NodeRecord]) -> dict[str, int]:
    """Healthy devices per device type on ``nodes``."""
    have: dict[str, int] = {}
    for n in nodes:
        for dev in n.devices:
            if dev.healthy:
                have[dev.type] = have.get(dev.type, 0) + 1
    return have


class SchedulingCycle:
    """The tick and the leader's pass (see the module docstring); the parts it runs are passed in."""

    def __init__(self, *, redis: Redis, settings: SchedulerSettings, clock: Callable[[], datetime],
                 leader: LeaderRole, queue: QueueConfigSource, cache: SnapshotCache, reconciler: Reconciler,
                 intake: Intake, stops: Stops, view: QueueView, admission: Admission, writer: JobWriter,
                 wake_at: WakeAt) -> None:
        self.redis, self.settings, self.clock, self.leader, self.queue = redis, settings, clock, leader, queue
        self.cache, self.reconciler, self.intake, self.stops, self.view = cache, reconciler, intake, stops, view
        self.admission, self.writer, self._wake_at = admission, writer, wake_at
        self.gauges = ClusterGauges()  # the leader's queue and node numbers (Prometheus)
        self._next_config: datetime | None = None
        self._changes_cursor: str | None = None  # the watcher's place in Keys.changes
        self._noted_at: dict[str, float] = {}  # job id -> when this leader last wrote why it waits (loop time)
        self._term_started: float | None = None  # when this instance took the lead (monotonic), to its first pass's end

    async def tick(self) -> None:
        """One scheduling pass; only the leader schedules, and every write it makes is fenced."""
        epoch = await self.leader.lead()
        if epoch is None:
            now = self.clock()
            if self._next_config is None or now >= self._next_config:  # standbys apply the policy too
                await self.queue.load()
                self._next_config = now + timedelta(seconds=self.settings.reconcile_interval_s)
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self.reconciler.snapshot_lock:
                await self.schedule(epoch)
        except StaleLeaderError as exc:
            log.warning("a newer scheduler leads (%s); standing by", exc)
            self.stand_by()
        except FencingError as exc:  # a fenced write refused for another reason: lead again from scratch
            log.warning("a fenced write was refused (%s); the pass ends, leadership is taken again", exc)
            self.stand_by()
        took = loop.time() - started
        PASS_SECONDS.labels("total").observe(took)
        if self._term_started is not None and self.leader.epoch is not None:
            since = time.monotonic() - self._term_started
            TAKEOVER_SECONDS.observe(since)
            log.info("first pass as leader (epoch %d) done %.0f ms after taking the lead", self.leader.epoch,
                     since * 1000)
            self._term_started = None
        if took > 0.01:  # a long pass (a deep queue): rest before the next one, whatever wakes it meanwhile
            await asyncio.sleep(took * self.settings.pass_rest_ratio)

    async def repair(self) -> None:
        """The periodic repair when due, beside the passes rather than inside them (at 1,024 simulated nodes it
        took seconds, and every pass it fell into waited for it). Only the leader repairs; every write is fenced."""
        epoch = self.leader.epoch
        if epoch is None:
            return
        timer = asyncio.get_running_loop().time
        started = timer()
        try:
            if await self.reconciler.maybe_reconcile(self.clock(), epoch, in_pass=False):
                PASS_SECONDS.labels("reconcile").observe(timer() - started)
        except StaleLeaderError as exc:
            log.warning("a newer scheduler leads (%s); the repair stops, standing by", exc)
            self.stand_by()
        except FencingError as exc:
            log.warning("a fenced write was refused (%s); the repair stops, leadership is taken again", exc)
            self.stand_by()

    def new_term(self) -> None:
        """This instance just took the lead: its first pass is timed from now (TAKEOVER_SECONDS)."""
        self._term_started = time.monotonic()

    def stand_by(self) -> None:
        self.leader.stand_by()
        self._noted_at.clear()
        self.gauges.clear()

    async def schedule(self, epoch: int) -> None:
        """One pass as leader ``epoch``: 1. the term's first repair  2. snapshot (only what changed is re-read)
        3. take in new jobs  4. drains and preemptions in progress  5. plan (pure)  6. apply."""
        now = self.clock()
        timer = asyncio.get_running_loop().time
        started = timer()
        if await self.reconciler.maybe_reconcile(now, epoch):
            PASS_SECONDS.labels("reconcile").observe(timer() - started)
        t0 = timer()
        view = await self.cache.refresh()
        jobs = dict(view.jobs)
        await self.intake.take_in(view.new_jobs, jobs, epoch)
        await self.stops.advance_drains(jobs, epoch, view.drains)
        await self.stops.advance_preemptions(jobs, epoch)
        timeout = self.settings.node_timeout_s
        live = health.live_nodes(view.nodes, now, timeout)
        nodes = health.placeable_nodes(live, quarantined=view.quarantine.keys(), drained=view.drains.keys())
        t1 = timer()
        decisions = self.view.plan(jobs, nodes, view, now, self.queue.config)
        t2 = timer()
        out = health.out_of_service(live, {n.node_id for n in nodes}, quarantine=view.quarantine, drains=view.drains)
        await self.apply(decisions, jobs, epoch, nodes=nodes, out=out)
        PASS_SECONDS.labels("snapshot").observe(t1 - t0)
        PASS_SECONDS.labels("plan").observe(t2 - t1)
        PASS_SECONDS.labels("apply").observe(timer() - t2)
        for decision in decisions:
            PASS_DECISIONS.labels(type(decision).__name__.lower()).inc()
        self.gauges.publish(cluster_view(
            [j for j in jobs.values() if tr.is_pending(j)], view.nodes, now=now, node_timeout_s=timeout,
            live=[n.node_id for n in live], placeable=[n.node_id for n in nodes]))

    async def watch_changes(self) -> None:
        """Wake the pass as soon as Keys.changes has something new (while leading; a standby sleeps)."""
        if self.leader.epoch is None:
            self._changes_cursor = None
            await asyncio.sleep(min(self.settings.tick_s, 0.5))
            return
        if self._changes_cursor is None:
            last: list[tuple[str, dict[str, str]]] = await self.redis.xrevrange(Keys.changes, count=1)  # type: ignore[assignment]  # decoded: str
            self._changes_cursor = last[0][0] if last else "0-0"
        got: Any = await self.redis.xread({Keys.changes: self._changes_cursor}, count=1000, block=1000)
        if got:
            self._changes_cursor = got[0][1][-1][0]
            self._wake_at(None)

    async def apply(self, decisions: list[Decision], jobs: dict[str, JobRecord], epoch: int, *,
                    nodes: Sequence[NodeRecord] = (), out: Sequence[health.OutOfService] = ()) -> None:
        """Admit, preempt, or note why a job waits (:meth:`_note_waits`: at most ``max_wait_notes`` a pass, in one
        round trip)."""
        waits: list[Wait] = []
        for decision in decisions:
            try:
                if isinstance(decision, Admit):
                    await self.admission.admit(decision.job_id, decision.placement, epoch)
                elif isinstance(decision, Preempt):
                    await self.stops.preempt(decision, epoch)
                elif isinstance(decision, Wait) and decision.reason is not None:
                    waits.append(decision)
            except LeaseConflictError as exc:
                log.info("placement of %s raced another allocation, retrying next tick: %s", decision.job_id, exc)
                self.cache.leases_changed()
                self._wake_at(None)
        if waits:
            await self._note_waits(waits, jobs, epoch, healthy_devices(nodes), out)

    async def _note_waits(self, waits: list[Wait], jobs: dict[str, JobRecord], epoch: int, have: dict[str, int],
                          out: Sequence[health.OutOfService]) -> int:
        """Record why jobs wait, where the record does not say so already: a new kind of wait at once, a new
        wording of the same kind (its counts: "12 free") at most every ``wait_note_refresh_s`` — a deep queue's
        notes would otherwise rewrite every queued record on every pass. One round trip for all of them
        (:meth:`~trainyard_scheduler.jobtx.JobTransactions.write_if_unchanged`); the number written."""
        now = asyncio.get_running_loop().time()
        writes: list[tuple[str, str, str]] = []
        records: dict[str, JobRecord] = {}
        for decision in waits:
            job = jobs[decision.job_id]
            reason, kind = decision.reason, decision.kind
            assert reason is not None
            if out:  # name quarantined or drained nodes when they are why it waits
                gpu_type = job.spec.resources.gpu_type
                reason, kind = health.explain_wait(reason, kind, gpu_type=gpu_type,
                                                   available_devices=have.get(gpu_type, 0), out=list(out))
            if (job.queued_reason, job.queued_reason_kind) == (reason, kind):
                continue
            fresh = now - self._noted_at.get(job.job_id, -1e9) < self.settings.wait_note_refresh_s
            if job.queued_reason_kind == kind and job.queued_reason is not None and fresh:
                continue
            outcome = tr.note_waiting(job, reason, kind)
            raw = self.cache.raw(job.job_id)
            if not outcome.changed or raw is None:
                continue
            records[job.job_id] = outcome.job
            writes.append((job.job_id, raw, outcome.job.dumps()))
            if len(writes) >= self.settings.max_wait_notes:
                break
        written = await self.writer.jobs.write_if_unchanged(writes, fence=epoch)
        if len(self._noted_at) > 2 * len(jobs) + 1000:  # forget the jobs no longer here
            self._noted_at = {k: v for k, v in self._noted_at.items() if k in jobs}
        for job_id, _, raw in writes:
            if job_id in written:
                self._noted_at[job_id] = now
                self.cache.wrote(job_id, raw, records[job_id])
        return len(written)
