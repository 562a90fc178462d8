"""The coordinator's records in Redis, the system of record of the checkpoint protocol (design.md §6): the
shard reports of a checkpoint (first report of a rank wins), their timing, the checkpoint records and the
pending index. Every change of a record happens here, under WATCH, and a settled record's event is staged
in the same MULTI (:meth:`CheckpointLedger.transition`): READY (or FAILED) and its announcement are one.

The decisions applied here (:func:`assembly.classify_shard`, the settle functions) stay pure; this module
only reads what they judge and writes what they return.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import datetime
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import WatchError
from trainyard_contract.events import ShardWritten
from trainyard_contract.records import CheckpointRecord
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import Keys

from trainyard_checkpoint_coordinator.assembly import (
    CheckpointKey,
    ShardReport,
    ShardTiming,
    ShardVerdict,
    classify_shard,
    pending_record,
    settled_event,
)
from trainyard_checkpoint_coordinator.collector import JOBS_INDEX

#: Sorted set of pending checkpoints (member: JSON [job, attempt, step]; score: creation time).
PENDING_INDEX = Keys.pending_checkpoints

Clock = Callable[[], datetime]
Transition = Callable[[CheckpointRecord, int], CheckpointRecord]


def member(key: CheckpointKey) -> str:
    """The checkpoint's member of :data:`PENDING_INDEX`."""
    return json.dumps([key.job_id, key.attempt, key.global_step])


def parse_member(text: str) -> CheckpointKey:
    job_id, attempt, step = json.loads(text)
    return CheckpointKey(job_id, int(attempt), int(step))


class CheckpointLedger:
    """Reads and writes the checkpoint records, shard reports and pending index; settles under WATCH."""

    def __init__(self, redis: Redis, outbox: Outbox, *, clock: Clock) -> None:
        self.redis, self.outbox, self.clock = redis, outbox, clock

    async def classify(self, key: CheckpointKey, report: ShardReport) -> tuple[ShardVerdict, ShardReport | None]:
        """The report judged against the job's fencing epoch and the rank's recorded report (if any)."""
        raw_epoch, raw_existing = await asyncio.gather(
            self.redis.get(Keys.epoch(key.job_id)),
            self.redis.hget(Keys.shards(key.job_id, key.attempt, key.global_step), str(report.rank)),
        )
        existing = ShardReport.loads(raw_existing) if raw_existing else None  # type: ignore[arg-type]  # decoded: str
        return classify_shard(report, current_epoch=int(raw_epoch or 0), existing=existing), existing

    async def record_shard(self, key: CheckpointKey, report: ShardReport, event: ShardWritten) -> bool:
        """Store the shard (first report wins) and, with the first shard, the PENDING record."""
        now = self.clock()
        shards = Keys.shards(key.job_id, key.attempt, key.global_step)
        timing = json.dumps({"at": event.occurred_at.isoformat(), "writeSeconds": event.write_seconds})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(shards, str(report.rank), report.dumps())
            pipe.hsetnx(Keys.shard_timing(key.job_id, key.attempt, key.global_step), str(report.rank), timing)
            pipe.hsetnx(Keys.checkpoints(key.job_id), key.checkpoint_id, pending_record(key, report, now=now).dumps())
            pipe.zadd(PENDING_INDEX, {member(key): now.timestamp()}, nx=True)
            pipe.zadd(JOBS_INDEX, {key.job_id: now.timestamp()})
            stored, *_ = await pipe.execute()
        return bool(stored)

    async def reports(self, key: CheckpointKey) -> dict[int, ShardReport]:
        raw: dict[str, str] = await self.redis.hgetall(  # type: ignore[assignment]  # decoded: str
            Keys.shards(key.job_id, key.attempt, key.global_step))
        return {int(rank): ShardReport.loads(text) for rank, text in raw.items()}

    async def shard_count(self, key: CheckpointKey) -> int:
        return int(await self.redis.hlen(Keys.shards(key.job_id, key.attempt, key.global_step)))

    async def epoch(self, job_id: str) -> int:
        """The job's fencing epoch (0 when none was set)."""
        return int(await self.redis.get(Keys.epoch(job_id)) or 0)

    async def timing(self, key: CheckpointKey) -> ShardTiming:
        raw = await self.redis.hgetall(Keys.shard_timing(key.job_id, key.attempt, key.global_step))
        reports: dict[int, tuple[datetime, float | None]] = {}
        for rank, text in raw.items():
            entry = json.loads(text)
            reports[int(rank)] = (datetime.fromisoformat(entry["at"]), entry.get("writeSeconds"))
        return ShardTiming.of(reports)

    async def record(self, key: CheckpointKey) -> CheckpointRecord | None:
        raw = await self.redis.hget(Keys.checkpoints(key.job_id), key.checkpoint_id)
        return CheckpointRecord.model_validate_json(raw) if raw else None

    async def fenced(self, key: CheckpointKey, record: CheckpointRecord) -> bool:
        """Whether a newer attempt holds the job's fencing epoch (assess() then rejects the set)."""
        return record.epoch < await self.epoch(key.job_id)

    async def change(
        self, job_id: str, record_id: str, change: Callable[[CheckpointRecord], CheckpointRecord | None]
    ) -> CheckpointRecord | None:
        """Rewrite one record under WATCH (and drop it from the pending index); None: unchanged."""
        records_key = Keys.checkpoints(job_id)
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(records_key)
                    raw = await pipe.hget(records_key, record_id)
                    changed = change(CheckpointRecord.model_validate_json(raw)) if raw else None
                    if changed is None:
                        return None
                    pipe.multi()
                    pipe.hset(records_key, record_id, changed.dumps())
                    pipe.zrem(PENDING_INDEX, member(CheckpointKey(job_id, changed.attempt, changed.global_step)))
                    await pipe.execute()
                    return changed
                except WatchError:
                    continue

    async def transition(self, key: CheckpointKey, change: Transition) -> CheckpointRecord | None:
        """Settle a PENDING record and stage its event atomically (WATCH on the record and the
        job's fencing epoch). None when the record is missing or settled already."""
        records_key, epoch_key = Keys.checkpoints(key.job_id), Keys.epoch(key.job_id)
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(records_key, epoch_key)
                    raw = await pipe.hget(records_key, key.checkpoint_id)
                    record = CheckpointRecord.model_validate_json(raw) if raw else None
                    if record is None or record.state != "PENDING":
                        return None
                    settled = change(record, int(await pipe.get(epoch_key) or 0))
                    pipe.multi()
                    pipe.hset(records_key, key.checkpoint_id, settled.dumps())
                    pipe.zrem(PENDING_INDEX, member(key))
                    self.outbox.stage(pipe, settled_event(settled, self.clock()))
                    await pipe.execute()
                    return settled
                except WatchError:
                    continue

    async def pending_before(self, cutoff: float) -> list[tuple[str, float]]:
        """Members of the pending index created before ``cutoff`` (epoch seconds), with their creation time."""
        entries = await self.redis.zrangebyscore(PENDING_INDEX, "-inf", cutoff, withscores=True)
        return cast(list[tuple[str, float]], entries)

    async def unindex(self, text: str) -> None:
        await self.redis.zrem(PENDING_INDEX, text)
