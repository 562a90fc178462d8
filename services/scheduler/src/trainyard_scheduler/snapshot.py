"""The leader's picture of the cluster, kept current from what changed instead of reloaded per pass.

A scheduling pass needs every non-terminal job, the node records, which nodes are quarantined or drained,
their failure scores and which devices are leased. Reading all of that per pass costs a round trip and a
parse per item, and the pass runs on every submission. :class:`SnapshotCache` keeps it in memory:

* jobs — every writer of a job record (the API's submission, the scheduler's transitions, either instance)
  appends the job id to ``Keys.changes`` in the MULTI that writes it (``stage_change``). A refresh reads the
  entries after its cursor and re-reads only those records (one XRANGE, one MGET). A cursor the stream was
  trimmed past, or a first use, reloads everything: the active set and the jobs stored but not yet taken
  in (``Keys.incoming_jobs``, written with a new record), then the records;
* nodes — the records with their quarantine, drain and reputation entries, re-read (one pipeline, records
  parsed only when their JSON changed) when a ``node`` entry says something placement-relevant changed,
  when this instance's handlers say so (:meth:`nodes_changed`) and at most ``node_refresh_s`` apart for the
  heartbeats' ``lastSeen``;
* leases — the lease keys are scanned at reconcile time (:meth:`rescan_leases`) and after a placement raced a
  lease it did not know of. Between scans a held allocation counts until the job cache shows its attempt
  ended (its release follows that MULTI); a live attempt's devices count whatever the scan said.

The cache is only a hint for deciding: every write stays fenced (the leader epoch in each MULTI, the lease
grant in Lua), so a stale cache can cost a placement that is refused and decided again, never a double
booking. The reconcile (every ``reconcile_interval_s`` and on a new leadership) reloads everything and counts
what the incremental path had missed (``trainyard_scheduler_snapshot_repairs_total``, which should stay 0).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from prometheus_client import Counter
from redis.asyncio import Redis

from trainyard_contract.devices import Device
from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.records import JobRecord, NodeRecord
from trainyard_runtime.store import Keys

from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.metrics import SNAPSHOT_RELOAD_SECONDS
from trainyard_scheduler.transitions import is_live

log = logging.getLogger(__name__)

SNAPSHOT_REPAIRS = Counter(
    "trainyard_scheduler_snapshot_repairs_total",
    "entries of the leader's cached snapshot that a full reload found different (should stay 0)", ["part"])
_CHUNK = 500
_MAX_ENTRIES = 10_000  # more changes than this since the last refresh: reload everything instead


@dataclass
class HeldAllocation:
    """An allocation that still holds at least one device lease."""

    job_id: str
    allocation_id: str
    epoch: int
    devices: list[Device] = field(default_factory=list)


@dataclass(frozen=True)
class Snapshot:
    """What one scheduling pass reads (do not mutate: it is the cache's own state)."""

    jobs: dict[str, JobRecord]
    nodes: list[NodeRecord]
    quarantine: dict[str, dict]
    drains: dict[str, dict]
    reputation: dict[str, dict]
    held: dict[str, HeldAllocation]
    new_jobs: tuple[str, ...] = ()  # ids not yet taken in by the scheduler (dataset checked, in its active set)


class SnapshotCache:
    """See the module docstring. Not shared between tasks: the leader's pass is its only user."""

    def __init__(self, redis: Redis, *, clock: Callable[[], datetime], node_refresh_s: float = 1.0) -> None:
        self.redis = redis
        self.clock = clock
        self.node_refresh = timedelta(seconds=node_refresh_s)
        self._cursor: str | None = None  # last Keys.changes entry read; None: reload everything next time
        self._jobs: dict[str, tuple[str, JobRecord]] = {}
        self._ended: set[str] = set()  # allocations whose attempt the job cache saw end since the last scan
        self._nodes: dict[str, tuple[str, NodeRecord]] = {}
        self._quarantine: dict[str, dict] = {}
        self._drains: dict[str, dict] = {}
        self._reputation: dict[str, dict] = {}
        self._nodes_at: datetime | None = None  # when the node part was read; None: read it next time
        self._held: dict[str, HeldAllocation] | None = None  # None: scan next time
        self.accepted: set[str] = set()  # job ids the scheduler has taken in (dataset checked, active)

    # ------------------------------------------------------------------ invalidation
    def reset(self) -> None:
        """Forget everything (a new leadership): the next refresh reloads."""
        self._cursor, self._nodes_at, self._held = None, None, None
        self._ended.clear()
        self.accepted.clear()

    def nodes_changed(self) -> None:
        self._nodes_at = None

    def leases_changed(self) -> None:
        self._held = None

    def raw(self, job_id: str) -> str | None:
        """The job's record as last read (its JSON), None if it is not cached."""
        had = self._jobs.get(job_id)
        return had[0] if had is not None else None

    def wrote(self, job_id: str, raw: str, record: JobRecord) -> None:
        """This instance wrote ``record`` (as ``raw``): the change log's entry for it then costs no parse."""
        if job_id in self._jobs:
            self._jobs[job_id] = (raw, record)

    def note_node(self, record: NodeRecord) -> None:
        """A heartbeat this instance stored: its ``lastSeen`` without a reload."""
        if self._nodes_at is not None:
            self._nodes[record.node_id] = (record.dumps(), record)

    # ------------------------------------------------------------------ refresh
    async def refresh(self) -> Snapshot:
        """The current snapshot: what changed since the last call, re-read (see the module docstring)."""
        started, whole = time.perf_counter(), self._cursor is None
        if self._cursor is None:
            await self._reload_jobs()
        else:
            await self._follow_changes()
        if self._nodes_at is None or self.clock() - self._nodes_at >= self.node_refresh:
            await self._read_nodes()
        if self._held is None:
            await self.rescan_leases()
        if whole:
            took = time.perf_counter() - started
            SNAPSHOT_RELOAD_SECONDS.observe(took)
            log.info("snapshot rebuilt in %.0f ms: %d jobs, %d nodes, %d allocations holding leases", took * 1000,
                     len(self._jobs), len(self._nodes), len(self._held or {}))
        return Snapshot(jobs={k: v[1] for k, v in self._jobs.items()},
                        nodes=[v[1] for v in self._nodes.values()], quarantine=self._quarantine,
                        drains=self._drains, reputation=self._reputation, held=self._effective_held(),
                        new_jobs=tuple(k for k in self._jobs if k not in self.accepted))

    async def verify(self) -> int:
        """Reload everything and count what the incremental path had wrong (a metric; logged): it follows the
        change log first, so only what the log did not say counts."""
        if self._cursor is None:  # nothing cached yet: nothing to compare
            await self._reload_jobs()
            return 0
        await self._follow_changes()
        before = {k: v[0] for k, v in self._jobs.items()}
        self._cursor = None
        await self._reload_jobs()
        after = {k: v[0] for k, v in self._jobs.items()}
        repaired = sum(1 for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if repaired:
            SNAPSHOT_REPAIRS.labels("jobs").inc(repaired)
            log.warning("snapshot: %d job(s) differed from Redis and were reloaded", repaired)
        self._nodes_at = None
        await self.rescan_leases()
        return repaired

    async def _reload_jobs(self) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:  # the cursor and the set from one moment
            pipe.xrevrange(Keys.changes, count=1)
            pipe.smembers(SchedulerKeys.active)
            pipe.smembers(Keys.incoming_jobs)
            last, active, incoming = await pipe.execute()
        self._cursor = last[0][0] if last else "0-0"
        self.accepted |= active
        old = self._jobs
        self._jobs = {}
        await self._read_jobs(sorted(active | incoming | old.keys()), old)

    async def _follow_changes(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(Keys.changes, min=f"({self._cursor}", count=_MAX_ENTRIES)
            pipe.xrange(Keys.changes, count=1)
            entries, first = await pipe.execute()
        trimmed = self._cursor != "0-0" and (not first or _id_after(first[0][0], self._cursor))  # type: ignore[arg-type]  # refresh: set
        if trimmed or len(entries) >= _MAX_ENTRIES:
            log.info("snapshot: %s; reloading every job", "change log trimmed past the cursor" if trimmed
                     else f"over {_MAX_ENTRIES} changes since the last pass")
            await self._reload_jobs()
            return
        if not entries:
            return
        self._cursor = entries[-1][0]
        jobs = {f["id"] for _, f in entries if f.get("kind") == "job"}
        if any(f.get("kind") == "node" for _, f in entries):
            self._nodes_at = None
        if jobs:
            await self._read_jobs(sorted(jobs), self._jobs)

    async def _read_jobs(self, ids: list[str], old: dict[str, tuple[str, JobRecord]]) -> None:
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start:start + _CHUNK]
            for job_id, raw in zip(chunk, await self.redis.mget([Keys.job(i) for i in chunk]), strict=True):
                had = old.get(job_id)
                if not raw:
                    self._forget(job_id, had)
                    continue
                record = had[1] if had and had[0] == raw else JobRecord.model_validate_json(raw)
                before = had[1].current if had is not None else None
                if before is not None and is_live(before) and (
                        record.current is None or record.current.allocation_id != before.allocation_id
                        or not is_live(record.current)):
                    self._ended.add(before.allocation_id)
                if record.state in TERMINAL_STATES:
                    self._forget(job_id, (raw, record))  # type: ignore[arg-type]  # decoded: str
                    continue
                self._jobs[job_id] = (raw, record)  # type: ignore[assignment]  # decoded: str

    def _forget(self, job_id: str, had: tuple[str, JobRecord] | None) -> None:
        self._jobs.pop(job_id, None)
        self.accepted.discard(job_id)
        if had is not None and had[1].current is not None:
            self._ended.add(had[1].current.allocation_id)

    async def _read_nodes(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(Keys.nodes)
            pipe.hgetall(Keys.node_quarantine)
            pipe.hgetall(Keys.node_drain)
            pipe.hgetall(Keys.node_reputation)
            nodes, quarantine, drains, reputation = await pipe.execute()
        old = self._nodes
        self._nodes = {k: (raw, old[k][1] if k in old and old[k][0] == raw else NodeRecord.model_validate_json(raw))
                       for k, raw in nodes.items()}
        self._quarantine = {k: json.loads(v) for k, v in quarantine.items()}
        self._drains = {k: json.loads(v) for k, v in drains.items()}
        self._reputation = {k: json.loads(v) for k, v in reputation.items()}
        self._nodes_at = self.clock()

    async def rescan_leases(self) -> None:
        """Every allocation holding a device lease, from the lease keys themselves."""
        self._held = await read_held_allocations(self.redis)
        self._ended.clear()

    def _effective_held(self) -> dict[str, HeldAllocation]:
        assert self._held is not None
        if not self._ended:
            return self._held
        return {k: v for k, v in self._held.items() if k not in self._ended}


def _id_after(a: str, b: str) -> bool:
    """Whether stream id ``a`` comes after ``b``."""
    ams, _, aseq = a.partition("-")
    bms, _, bseq = b.partition("-")
    return (int(ams), int(aseq or 0)) > (int(bms), int(bseq or 0))


async def read_held_allocations(redis: Redis) -> dict[str, HeldAllocation]:
    """Every allocation holding a device lease, read from the lease keys themselves (allocation id → holder)."""
    keys = [k async for k in redis.scan_iter(match=Keys.lease("*", "*"), count=500)]  # type: ignore[arg-type]  # a pattern, not a key
    held: dict[str, HeldAllocation] = {}
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start:start + _CHUNK]
        for key, raw in zip(chunk, await redis.mget(chunk), strict=True):
            if not raw:
                continue
            node_id, index = key.removeprefix("ty:lease:").rsplit(":", 1)
            holder = json.loads(raw)
            entry = held.setdefault(holder["allocationId"], HeldAllocation(
                holder["jobId"], holder["allocationId"], int(holder["epoch"])))
            entry.devices.append(Device(node_id, int(index)))
    return held
