"""The scheduling cycle: the tick, and one pass of the leader in numbered phases (kueue's ``schedule()``).

tick  1. leader lease (fenced, epoch); a standby only keeps the queue policy current
pass  1. reconcile when due (:mod:`reconcile`)  2. the snapshot brought up to date from the change log
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
from trainyard_scheduler.metrics import ClusterGauges, cluster_view
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
            await self.schedule(epoch)
        except StaleLeaderError as exc:
            log.warning("a newer scheduler leads (%s); standing by", exc)
            self.stand_by()
        except FencingError as exc:  # a fenced write refused for another reason: lead again from scratch
            log.warning("a fenced write was refused (%s); the pass ends, leadership is taken again", exc)
            self.stand_by()
        took = loop.time() - started
        if took > 0.01:  # a long pass (a deep queue): rest before the next one, whatever wakes it meanwhile
            await asyncio.sleep(took * self.settings.pass_rest_ratio)

    def stand_by(self) -> None:
        self.leader.stand_by()
        self.gauges.clear()

    async def schedule(self, epoch: int) -> None:
        """One pass as leader ``epoch``: 1. repair when due  2. snapshot (only what changed is re-read)
        3. take in new jobs  4. drains and preemptions in progress  5. plan (pure)  6. apply."""
        now = self.clock()
        await self.reconciler.maybe_reconcile(now, epoch)
        view = await self.cache.refresh()
        jobs = dict(view.jobs)
        await self.intake.take_in(view.new_jobs, jobs, epoch)
        await self.stops.advance_drains(jobs, epoch, view.drains)
        await self.stops.advance_preemptions(jobs, epoch)
        timeout = self.settings.node_timeout_s
        live = health.live_nodes(view.nodes, now, timeout)
        nodes = health.placeable_nodes(live, quarantined=view.quarantine.keys(), drained=view.drains.keys())
        decisions = self.view.plan(jobs, nodes, view, now, self.queue.config)
        out = health.out_of_service(live, {n.node_id for n in nodes}, quarantine=view.quarantine, drains=view.drains)
        await self.apply(decisions, jobs, epoch, nodes=nodes, out=out)
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
        """Admit, preempt, or note why a job waits (at most ``max_wait_notes`` new notes a pass)."""
        notes = 0
        have: dict[str, int] | None = None  # healthy devices per type on placeable nodes, counted when needed
        for decision in decisions:
            try:
                if isinstance(decision, Admit):
                    await self.admission.admit(decision.job_id, decision.placement, epoch)
                elif isinstance(decision, Preempt):
                    await self.stops.preempt(decision, epoch)
                elif isinstance(decision, Wait) and decision.reason is not None \
                        and notes < self.settings.max_wait_notes:
                    if have is None:
                        have = healthy_devices(nodes)
                    notes += await self._note_wait(decision, jobs[decision.job_id], epoch, have, out)
            except LeaseConflictError as exc:
                log.info("placement of %s raced another allocation, retrying next tick: %s", decision.job_id, exc)
                self.cache.leases_changed()
                self._wake_at(None)

    async def _note_wait(self, decision: Wait, job: JobRecord, epoch: int, have: dict[str, int],
                         out: Sequence[health.OutOfService]) -> int:
        """Record why ``job`` waits, unless the record says so already; 1 when a note was written."""
        reason, kind = decision.reason, decision.kind
        assert reason is not None
        if out:  # name quarantined or drained nodes when they are why it waits
            gpu_type = job.spec.resources.gpu_type
            reason, kind = health.explain_wait(reason, kind, gpu_type=gpu_type,
                                               available_devices=have.get(gpu_type, 0), out=list(out))
        if (job.queued_reason, job.queued_reason_kind) == (reason, kind):
            return 0
        await self.writer.mutate(job.job_id, lambda j, _: tr.note_waiting(j, reason, kind), label="waiting",
                                 fence=epoch)
        return 1
