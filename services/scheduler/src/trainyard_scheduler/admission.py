"""Admitting a job the planner placed: reserve, persist, undo (design.md §3.3 step 4, §3.9).

The decision that the job starts, and where, is the planner's; the attempt it starts is the pure
:func:`transitions.admit`. What this module does is the I/O around them, in numbered phases: the job WATCHed with
the leader epoch; what the attempt starts from (a settling checkpoint waited for, the latest READY checkpoint, the
``initFrom`` job's); the reservation (the fenced lease grant and a rendezvous port, together); the attempt and its
GangAllocated in one MULTI — and the reservation released whenever that is declined or fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from trainyard_contract.errors import ConfigError
from trainyard_contract.events import CheckpointRef
from trainyard_contract.records import CheckpointRecord, JobRecord
from trainyard_runtime.store import Keys, StateStore

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.fencing import FencedLeases
from trainyard_scheduler.gang import Placement
from trainyard_scheduler.jobtx import JobTransactions, job_span
from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.ports import SYSTEM_RANDOM, choose_port, live_ports
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.snapshot import SnapshotCache
from trainyard_scheduler.writer import JobWriter

log = logging.getLogger(__name__)


def _log_placed(job_id: str, outcome: tr.Outcome, allocation_id: str, lease_epoch: int, placement: Placement) -> None:
    detail = placement.detail
    log.info("job %s: %s (allocation %s, epoch %d, world %d, score %.2f, %s)", job_id, outcome.note,
             allocation_id, lease_epoch, placement.world_size, placement.score,
             f"{detail.nodes} nodes / {detail.racks} racks / {detail.cross_rack_links} cross-rack links"
             if detail else "")


class Admission:
    """Starts the attempts the planner decided on; every write fenced by the leader epoch."""

    def __init__(self, *, redis: Redis, store: StateStore, leases: FencedLeases, jobs: JobTransactions,
                 writer: JobWriter, cache: SnapshotCache, settings: SchedulerSettings,
                 clock: Callable[[], datetime]) -> None:
        self.redis, self.store, self.leases, self.jobs, self.writer = redis, store, leases, jobs, writer
        self.cache, self.settings, self.clock = cache, settings, clock

    async def admit(self, job_id: str, placement: Placement, epoch: int) -> None:
        """Reserve (leases, fenced Lua), persist (attempt + GangAllocated in one fenced MULTI), undo on conflict.

        Four round trips for a new job: WATCH, GET, the lease grant (its Lua refuses a stale leader) with the
        port drawn beside it, and the MULTI (WATCHing the leader epoch: a takeover after the grant fails it).
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
            settling = await self.settling_checkpoint(job)
            if settling is not None:  # placing now would fence it out; decided again next tick
                await self._wait_for_settling(job, settling, epoch)
                return
            allocation_id = f"{job_id}-a{len(job.attempts) + 1}-{uuid.uuid4().hex[:8]}"
            try:
                start = await self.start_checkpoint(job)
            except ConfigError as exc:
                await self._fail_unstartable(pipe, job, exc, epoch)
                return
            every = await self.advised_interval(job)
            # 3. reserve: the leases (the grant refuses a stale leader) and the rendezvous port
            granted, port = await asyncio.gather(self.leases.acquire(epoch, job_id, allocation_id, devices),
                                                 self._next_ports(job), return_exceptions=True)
            if isinstance(granted, BaseException):
                raise granted
            lease_epoch = granted
            # 4. persist the attempt and its GangAllocated; undo the reservation when that fails or is declined
            try:
                if isinstance(port, BaseException):
                    raise port
                with job_span(job, "scheduler.place"):
                    outcome = tr.admit(job, placement=placement, allocation_id=allocation_id, epoch=lease_epoch,
                                       master_port=port[0], start_checkpoint=start, now=self.clock(),
                                       checkpoint_every_steps=every, lighthouse_port=port[1])
                    written = outcome.changed and await self.jobs.try_execute(pipe, job_id, outcome)
            except BaseException:
                await self.writer.release(allocation_id, lease_epoch, devices)
                raise
            if not written:  # the transition declined, or the job or the leader epoch changed under WATCH
                await self.writer.release(allocation_id, lease_epoch, devices)
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
        await self.writer.mutate(job.job_id, lambda j, _: tr.note_waiting(j, reason, "checkpoint"),
                                 label="waiting", fence=epoch)

    async def _fail_unstartable(self, pipe: Pipeline, job: JobRecord, exc: ConfigError, epoch: int) -> None:
        """Fail a job whose start cannot be resolved, in ``pipe``'s MULTI (still WATCHing the job)."""
        await self.jobs.check_epoch(pipe, epoch)  # no lease grant fences this write
        outcome = tr.fail_unstartable(job, str(exc), self.clock())
        self.jobs.stage(pipe, job.job_id, outcome)
        with contextlib.suppress(WatchError):  # changed meanwhile: decided again next tick
            await pipe.execute()
            log.warning("job %s cannot start: %s", job.job_id, exc)

    async def advised_interval(self, job: JobRecord) -> int | None:
        """With ``checkpointPolicy.auto``: the coordinator's Young/Daly interval in steps, once it has one."""
        if not getattr(job.spec.checkpoint_policy, "auto", False):
            return None
        raw = await self.redis.get(Keys.checkpoint_advice(job.job_id))
        try:
            steps = json.loads(raw).get("intervalSteps") if raw else None
        except (ValueError, AttributeError):
            return None
        return int(steps) if isinstance(steps, int | float) and steps >= 1 else None

    async def settling_checkpoint(self, job: JobRecord) -> CheckpointRecord | None:
        """A complete, not yet READY checkpoint of the attempt that just ended (tr.checkpoint_settling)."""
        current, settle_s = job.current, self.settings.checkpoint_settle_s
        if current is None or current.ended_at is None \
                or self.clock() >= current.ended_at + timedelta(seconds=settle_s):
            return None
        records = await self.store.list_checkpoints(job.job_id)
        recorded = {c.checkpoint_id: await self.redis.hlen(Keys.shards(job.job_id, c.attempt, c.global_step))
                    for c in records if c.state == "PENDING" and c.attempt == current.attempt}
        return tr.checkpoint_settling(job, records, recorded, now=self.clock(), settle_s=settle_s)

    async def start_checkpoint(self, job: JobRecord) -> CheckpointRef | None:
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

    async def _next_ports(self, job: JobRecord) -> tuple[int, int | None]:
        """A random rendezvous port, none that a live attempt holds (:mod:`ports`; the snapshot brought up to date
        first, so attempts placed earlier in this pass count); for a fault-tolerant job a second one, its
        Lighthouse's."""
        view = await self.cache.refresh()
        low, high = self.settings.rendezvous_port_min, self.settings.rendezvous_port_max
        taken = live_ports(view.jobs.values())
        port = choose_port(SYSTEM_RANDOM, low, high, taken)
        if job.spec.fault_tolerance is None:
            return port, None
        return port, choose_port(SYSTEM_RANDOM, low, high, taken | {port})
