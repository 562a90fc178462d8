"""Goodput accounting: the I/O shell around :mod:`.goodput`.

A job's ledger is computed from its record (attempts), its checkpoint records and rank 0's step
timing (``steptiming.py``). A finished job's ledger never changes again, so it is kept in
``Keys.goodput_final`` and later sums read it instead of recomputing. Tenant sums walk the tenant's
job index. ``refresh()`` (a loop of the API process) recomputes every tenant's sum and sets the
``trainyard_goodput_device_seconds{tenant,kind}`` gauges; requests never touch the gauges.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime

from prometheus_client import Gauge

from trainyard_common.events import TERMINAL_STATES, utcnow
from trainyard_common.records import JobRecord
from trainyard_common.store import Keys, StateStore

from trainyard_api.goodput import KINDS, Ledger, job_ledger
from trainyard_api.steptiming import StepTimingStore

log = logging.getLogger(__name__)

GOODPUT = Gauge(
    "trainyard_goodput_device_seconds",
    "device-seconds per tenant: allocated, productive, wasted, and each kind of waste",
    ["tenant", "kind"],
)
_BATCH = 200


class GoodputAccountant:
    """Ledgers of jobs and tenants."""

    def __init__(self, store: StateStore, timing: StepTimingStore, *,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.redis = store.redis
        self.timing = timing
        self.clock = clock

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

    async def all_tenants(self) -> dict[str, Ledger]:
        """Every tenant's ledger, in one walk over the job index."""
        ledgers: dict[str, Ledger] = {}
        offset = 0
        while True:
            ids = await self.store.list_job_ids(None, limit=_BATCH, offset=offset)
            for job in await self.store.get_jobs(ids):
                ledgers.setdefault(job.tenant, Ledger()).add(await self.job(job))
            if len(ids) < _BATCH:
                return ledgers
            offset += len(ids)

    async def refresh(self) -> dict[str, Ledger]:
        """Recompute every tenant's ledger and set the gauges (a loop of the API process)."""
        ledgers = await self.all_tenants()
        for tenant, ledger in ledgers.items():
            for kind, seconds in ledger.seconds().items():
                GOODPUT.labels(tenant, kind).set(seconds)
        return ledgers


__all__ = ["GOODPUT", "KINDS", "GoodputAccountant"]
