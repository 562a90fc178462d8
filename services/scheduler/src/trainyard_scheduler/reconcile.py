"""The leader's repair from durable state (design.md §3.6), when due and first thing in a new term.

In order: the queue config; job discovery; reinstatement of nodes whose score decayed; every live attempt
checked (:func:`transitions.check_attempt`, silent nodes judged by :func:`blame.judge_silence`); orphan leases
released (read from the lease keys themselves); expired leases of live attempts restored; the snapshot verified
against Redis. Every write is fenced by the leader epoch it runs under.
"""

from __future__ import annotations

import asyncio

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from redis.asyncio import Redis

from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.blame import Silence, SilencePolicy, judge_silence
from trainyard_scheduler.discovery import JobDiscovery
from trainyard_scheduler.fencing import FencedLeases
from trainyard_scheduler.jobtx import Facts
from trainyard_scheduler.leader import LeaderRole
from trainyard_scheduler.node_health import NodeHealth
from trainyard_scheduler.queueconfig import QueueConfigSource
from trainyard_scheduler.queueview import attempt_devices
from trainyard_scheduler.snapshot import HeldAllocation, SnapshotCache, read_held_allocations
from trainyard_scheduler.writer import JobWriter

log = logging.getLogger(__name__)


class Reconciler:
    """Runs the repair every ``interval_s`` (and at once after :meth:`due_now`): a term's first repair inside the
    first pass (the predecessor's leases restored and orphans released before anything is placed), every later
    one beside the passes (:meth:`SchedulingCycle.repair`), so a pass never waits for it; the one step that
    must not overlap a pass, the snapshot's reload, takes :attr:`snapshot_lock`, which a pass holds."""

    def __init__(self, *, redis: Redis, store: StateStore, queue: QueueConfigSource, discovery: JobDiscovery,
                 nodes: NodeHealth, leases: FencedLeases, writer: JobWriter, cache: SnapshotCache, leader: LeaderRole,
                 silence: SilencePolicy, deadlines: tr.Deadlines, clock: Callable[[], datetime],
                 interval_s: float, verify_every: int = 1) -> None:
        self.redis, self.store, self.queue, self.discovery = redis, store, queue, discovery
        self.nodes, self.leases, self.writer, self.cache, self.leader = nodes, leases, writer, cache, leader
        self.silence, self.deadlines, self.clock = silence, deadlines, clock
        self.interval = timedelta(seconds=interval_s)
        self._next: datetime | None = None
        self.verify_every = max(1, verify_every)
        self._reconciles = 0
        self._term = 0  # counts due_now(): a repair begun in an earlier term does not schedule the next one
        self.snapshot_lock = asyncio.Lock()

    def due_now(self) -> None:
        """Repair at the next pass (a new leadership: its predecessor's orphans first, the snapshot verified)."""
        self._next = None
        self._reconciles = 0
        self._term += 1

    async def maybe_reconcile(self, now: datetime, epoch: int, *, in_pass: bool = True) -> bool:
        """Reconcile when due; whether it did. ``in_pass``: called by a pass (holding :attr:`snapshot_lock`),
        which makes only a term's first repair; otherwise by the repair loop, which makes every later one."""
        due = self._next
        if in_pass != (due is None) or (due is not None and now < due):
            return False
        term = self._term
        await self.reconcile(now, epoch, in_pass=in_pass)
        if term == self._term:
            self._next = now + self.interval
        return True

    async def reconcile(self, now: datetime, epoch: int, *, in_pass: bool = True) -> None:
        """Repair from durable state: config, job discovery, live attempts, orphan and expired leases; the
        snapshot verified against Redis every ``verify_every`` reconciles (and at the first of a term)."""
        await self.queue.load()
        await self.discovery.discover(now)
        await self.nodes.reinstate_recovered(now)
        jobs = await self.discovery.active_jobs()
        await self._check_attempts(now, epoch, jobs)
        if in_pass:
            await self._repair_leases(epoch, jobs)
        else:  # never beside a pass: a pass's admission grants leases before it writes the attempt
            async with self.snapshot_lock:
                await self._repair_leases(epoch, jobs)
        self._reconciles += 1

    async def _repair_leases(self, epoch: int, jobs: list[JobRecord]) -> None:
        """Orphans released, expired leases of live attempts restored, and the snapshot reloaded whole every
        ``verify_every`` reconciles (what the change log missed is counted). Called where no pass runs."""
        held = await read_held_allocations(self.redis)
        await self._release_orphans(held, epoch, {j.job_id: j for j in jobs})
        await self._restore_leases(held, epoch, jobs)
        if self._reconciles % self.verify_every == 0:
            await self.cache.verify()

    async def _check_attempts(self, now: datetime, epoch: int, jobs: list[JobRecord]) -> None:
        """Every live (or completed, not yet settled) attempt against the nodes' liveness and its deadlines:
        decided first on the record as read (pure, no round trip), and only a live attempt that this says must
        change — or a completed one, whose outcome needs its checkpoints — in a transaction, decided again there
        (thousands of healthy running jobs cost no write and no WATCH)."""
        # Liveness, not placeability: a quarantined node's running attempts run on.
        available = frozenset(n.node_id for n in await self.nodes.available_nodes(now, include_quarantined=True))
        last_seen = {n.node_id: n.last_seen for n in await self.store.list_nodes()}
        draining: frozenset[str] = frozenset(await self.redis.hkeys(Keys.node_drain))  # type: ignore[arg-type]  # decoded: str
        since = self.leader.since

        def judge(nodes: list[str]) -> Silence:
            return judge_silence(nodes, available=available, last_seen=last_seen, draining=draining,
                                 watching_since=since, now=self.clock(), policy=self.silence)

        watched = (now - since).total_seconds() if since else 0.0

        def decide(j: JobRecord, facts: Facts) -> tr.Outcome:
            return tr.check_attempt(j, available_nodes=available, final_ready=facts.final_ready,
                                    deadlines=self.deadlines, policy=self.writer.policy, now=self.clock(),
                                    latest_ready_step=facts.latest_ready_step, judge=judge, watched_s=watched)

        for job in jobs:
            current = job.current
            if current is None or not (tr.is_live(current) or current.state == "succeeded"):
                continue
            # a live attempt's checks (silence, start time-out, republication) do not read the checkpoints: what
            # they decide on the record as read is what they would decide under the WATCH, but for its details
            if tr.is_live(current) and not decide(job, Facts()).changed:
                continue
            await self.writer.mutate(job.job_id, decide, need_checkpoints=True, label="reconcile", fence=epoch)

    async def _release_orphans(self, held: dict[str, HeldAllocation], epoch: int, jobs: dict[str, JobRecord]) -> None:
        """Leases of allocations that are no job's live attempt (the job read again only when the active
        jobs do not show the allocation live)."""
        for allocation in held.values():
            job = jobs.get(allocation.job_id)
            current = job.current if job else None
            if current is not None and current.allocation_id == allocation.allocation_id and tr.is_live(current):
                continue
            job = await self.store.get_job(allocation.job_id)
            current = job.current if job else None
            if current is None or current.allocation_id != allocation.allocation_id or not tr.is_live(current):
                await self.writer.release(allocation.allocation_id, allocation.epoch, allocation.devices, fence=epoch)
                log.warning("released orphan allocation %s of job %s", allocation.allocation_id, allocation.job_id)

    async def _restore_leases(self, held: dict[str, HeldAllocation], epoch: int, jobs: list[JobRecord]) -> None:
        """Expired lease keys of live attempts, granted again under the attempt's own epoch."""
        for job in jobs:
            current = job.current
            if not tr.is_live(current) or current is None:
                continue
            have = len(held[current.allocation_id].devices) if current.allocation_id in held else 0
            if have < len(current.devices):
                job = await self.store.get_job(job.job_id) or job  # as it is now: the repair may have ended it
                if job.current is None or job.current.allocation_id != current.allocation_id \
                        or not tr.is_live(job.current):
                    continue
                restored, conflicts = await self.leases.restore(epoch, current.allocation_id, current.epoch,
                                                                attempt_devices(job))
                log.warning("job %s: restored %d expired lease(s) of allocation %s%s", job.job_id, restored,
                            current.allocation_id, f" ({conflicts} held by others!)" if conflicts else "")
