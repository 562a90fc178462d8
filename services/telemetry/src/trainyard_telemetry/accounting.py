"""Goodput accounting: the I/O shell around :mod:`.goodput`.

A job's ledger is computed from its record (attempts), its checkpoint records and rank 0's step
timing (``steptiming.py``). A finished job's ledger never changes again, so it is kept in
``Keys.goodput_final`` and later sums read it instead of recomputing. Tenant sums walk the tenant's
job index. ``refresh()`` (a loop of the API process) recomputes every tenant's sum, sets the
``trainyard_goodput_device_seconds{tenant,kind}`` gauges (requests never touch them) and records the
sums as the tenant's goodput history: ``Keys.goodput_history(tenant)``, one field per bucket of
``bucket_s`` (HSET overwrites, so API processes refreshing the same bucket agree), fields older than
``retention_s`` trimmed in the same pass (see :mod:`.goodput_history`). The same walk keeps the per-job
series current (``trainyard_job_goodput_ratio``; :mod:`.jobmetrics`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime

from prometheus_client import Gauge
from redis.exceptions import RedisError

from trainyard_contract.errors import StateStoreError
from trainyard_contract.events import TERMINAL_STATES, utcnow
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore
from trainyard_telemetry.goodput import KINDS, Ledger, job_ledger
from trainyard_telemetry.goodput_history import Sample, expired_buckets, parse_samples, sample_entry
from trainyard_telemetry.jobmetrics import JobSeries
from trainyard_telemetry.steptiming import StepTimingStore

log = logging.getLogger(__name__)

GOODPUT = Gauge(
    "trainyard_goodput_device_seconds",
    "device-seconds per tenant: allocated, productive, wasted, and each kind of waste",
    ["tenant", "kind"],
)
_BATCH = 200
HISTORY_BUCKET_S = 300
HISTORY_RETENTION_S = 30 * 86400.0


class GoodputAccountant:
    """Ledgers of jobs and tenants."""

    def __init__(self, store: StateStore, timing: StepTimingStore, *,
                 clock: Callable[[], datetime] = utcnow, history_bucket_s: int = HISTORY_BUCKET_S,
                 history_retention_s: float = HISTORY_RETENTION_S, series: JobSeries | None = None) -> None:
        self.store = store
        self.redis = store.redis
        self.timing = timing
        self.clock = clock
        self.history_bucket_s = history_bucket_s
        self.history_retention_s = history_retention_s
        self.series = series  # per-job series (step time, goodput) the refresh walk keeps current

    async def job(self, job: JobRecord) -> Ledger:
        """The job's ledger (the stored final one when the job is finished)."""
        raw = await self.redis.hget(Keys.goodput_final, job.job_id)
        if raw:
            return Ledger.from_json(json.loads(raw)["ledger"])
        checkpoints = await self.store.list_checkpoints(job.job_id)
        timings = await self.timing.timings(job.job_id, [a.attempt for a in job.attempts])
        ledger = job_ledger(job, checkpoints, timings, now=self.clock())
        if job.state in TERMINAL_STATES and all(a.ended_at is not None for a in job.attempts):
            await self.redis.hset(Keys.goodput_final, job.job_id,
                                  json.dumps({"tenant": job.tenant, "ledger": ledger.to_json()}))
        return ledger

    async def tenant(self, tenant: str) -> tuple[Ledger, int]:
        """The sum over the tenant's jobs, and how many jobs that is."""
        total, count, offset = Ledger(), 0, 0
        while True:
            ids = await self.store.list_job_ids(tenant, limit=_BATCH, offset=offset)
            for job in await self.store.get_jobs(ids):
                total.add(await self.job(job))
                count += 1
            if len(ids) < _BATCH:
                return total, count
            offset += len(ids)

    async def all_tenants(self, each: Callable[[JobRecord, Ledger], None] | None = None) -> dict[str, Ledger]:
        """Every tenant's ledger, in one walk over the job index (``each`` sees every job's ledger)."""
        ledgers: dict[str, Ledger] = {}
        offset = 0
        while True:
            ids = await self.store.list_job_ids(None, limit=_BATCH, offset=offset)
            for job in await self.store.get_jobs(ids):
                ledger = await self.job(job)
                ledgers.setdefault(job.tenant, Ledger()).add(ledger)
                if each is not None:
                    each(job, ledger)
            if len(ids) < _BATCH:
                return ledgers
            offset += len(ids)

    async def refresh(self) -> dict[str, Ledger]:
        """Recompute every tenant's ledger, set the gauges and record the history (a loop of the API process)."""
        when = self.clock()
        now = when.timestamp()
        series = self.series
        if series is not None:
            series.begin()
        ledgers = await self.all_tenants(each=None if series is None else lambda j, lg: series.observe(j, lg, when))
        for tenant, ledger in ledgers.items():
            for kind, seconds in ledger.seconds().items():
                GOODPUT.labels(tenant, kind).set(seconds)
        if series is not None:
            series.prune(when)
        await self.record_history(ledgers, now_s=now)
        return ledgers

    async def record_history(self, ledgers: dict[str, Ledger], *, now_s: float) -> None:
        """1. each tenant's cumulative seconds, and when, under the current bucket  2. drop buckets past the
        retention."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for tenant, ledger in ledgers.items():
                pipe.hset(Keys.goodput_history(tenant), *sample_entry(now_s, self.history_bucket_s, ledger.seconds()))
                pipe.sadd(Keys.goodput_history_tenants, tenant)
            await pipe.execute()
        for tenant in ledgers:
            key = Keys.goodput_history(tenant)
            fields = [int(f) for f in await self.redis.hkeys(key) if str(f).isdigit()]
            if old := expired_buckets(fields, now_s=now_s, retention_s=self.history_retention_s):
                await self.redis.hdel(key, *(str(b) for b in old))

    async def history(self, tenant: str) -> list[Sample]:
        """The tenant's recorded cumulative samples, oldest first."""
        try:
            return parse_samples(await self.redis.hgetall(Keys.goodput_history(tenant)))  # type: ignore[arg-type]  # decoded
        except RedisError as exc:
            raise StateStoreError(f"cannot read the goodput history of {tenant}: {exc!r}") from exc

    async def history_tenants(self) -> list[str]:
        """The tenants that have a goodput history, sorted."""
        try:
            return sorted(await self.redis.smembers(Keys.goodput_history_tenants))  # type: ignore[arg-type]  # decoded: str
        except RedisError as exc:
            raise StateStoreError(f"cannot list the goodput histories: {exc!r}") from exc


__all__ = ["GOODPUT", "KINDS", "GoodputAccountant"]
