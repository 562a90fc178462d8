"""The one door into the scheduler: a job the API stored is taken in by the leader's pass, from the change log.

The API's submission writes the record, ``ty:sched:incoming`` and a ``ty:changes`` entry in one MULTI; the
leader's snapshot (:mod:`trainyard_scheduler.snapshot`) follows that log, and every job in it that the scheduler
has not taken in yet comes through :meth:`Intake.take_in` — the only code that adds a job to the scheduler's
active set. ``JobSubmitted`` is a wake-up for that same pass and an audit of the bus (design.md §3.3), never a
second way in; jobs stored without a change entry (an older API) are put back on this path by the reconcile's
discovery (:mod:`trainyard_scheduler.discovery`).

Taking a job in checks one thing first: that its tenant may read its dataset (the pure
:func:`transitions.dataset_refusal`); a job that may not is failed, never placed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime

from redis.asyncio import Redis

from trainyard_contract.records import DatasetRecord, JobRecord
from trainyard_runtime.store import Keys

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.snapshot import SnapshotCache
from trainyard_scheduler.writer import JobWriter

log = logging.getLogger(__name__)


def intake_refusals(jobs: Mapping[str, JobRecord], datasets: Mapping[str, str | None]) -> dict[str, str]:
    """Job id → why it may not be taken in (its tenant may not read its dataset), for the jobs that may not.
    ``datasets``: each dataset reference → its stored record's JSON (None: none stored)."""
    refused = {}
    for job_id, job in jobs.items():
        raw = datasets.get(job.spec.dataset)
        record = DatasetRecord.model_validate_json(raw) if raw else None
        if (reason := tr.dataset_refusal(job.spec.dataset, job.tenant, record)) is not None:
            refused[job_id] = reason
    return refused


class Intake:
    """Takes in the jobs the snapshot shows first: dataset checked, into the active set, out of incoming."""

    def __init__(self, redis: Redis, cache: SnapshotCache, writer: JobWriter, *, clock: Callable[[], datetime]) -> None:
        self.redis, self.cache, self.writer, self.clock = redis, cache, writer, clock

    async def take_in(self, new: tuple[str, ...], jobs: dict[str, JobRecord], epoch: int) -> None:
        """Take in ``new`` (ids in ``jobs``): their datasets read in one round trip, the accepted ones added in
        one MULTI; a refused job is failed and dropped from ``jobs``."""
        if not new:
            return
        arrivals = {i: jobs[i] for i in new}
        refs = sorted({j.spec.dataset for j in arrivals.values()})
        found: dict[str, str | None] = dict(zip(refs, await self.redis.hmget(Keys.datasets, refs), strict=True))  # type: ignore[arg-type]  # decoded: str
        refused = intake_refusals(arrivals, found)
        for job_id, reason in refused.items():
            await self._refuse(arrivals[job_id], reason, epoch)
            jobs.pop(job_id, None)
        accepted = [i for i in new if i not in refused]
        async with self.redis.pipeline(transaction=True) as pipe:
            if accepted:
                pipe.sadd(SchedulerKeys.active, *accepted)
            pipe.srem(Keys.incoming_jobs, *new)
            await pipe.execute()
        self.cache.accepted.update(accepted)

    async def _refuse(self, job: JobRecord, reason: str, epoch: int) -> None:
        """Fail (never place) a job whose dataset its tenant may not read."""
        log.warning("job %s of tenant %s refused: %s", job.job_id, job.tenant, reason)
        await self.writer.mutate(job.job_id, lambda current, _: tr.fail_unstartable(current, reason, self.clock()),
                                 label="dataset refused", fence=epoch)
