"""Which jobs the scheduler follows: the active set it reads at reconcile, and the stored jobs it would miss.

:meth:`JobDiscovery.discover` is a repair, run by the reconcile (design.md §3.6): a live job in ``ty:jobs`` that is
neither active nor incoming (a record written without the change entry, by an older API) goes back into
``ty:sched:incoming``, where the snapshot's reload finds it and :mod:`trainyard_scheduler.intake` takes it in;
incoming entries of jobs that ended before they were taken in are dropped.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from redis.asyncio import Redis

from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore

from trainyard_scheduler.keys import SchedulerKeys

log = logging.getLogger(__name__)

DISCOVERY_WINDOW_S = 3600.0  # after the first full scan, only jobs stored this recently are looked at
_MGET_CHUNK = 500


class JobDiscovery:
    """The active set, read with a parse cache, and the discovery of stored jobs the scheduler does not follow."""

    def __init__(self, redis: Redis, store: StateStore) -> None:
        self.redis, self.store = redis, store
        self._scanned_all = False
        self._parsed: dict[str, tuple[str, JobRecord]] = {}  # job id → (its JSON, the record parsed from it)

    async def discover(self, now: datetime) -> None:
        """Live jobs stored without a trace the scheduler follows become incoming; incoming entries of jobs that
        ended (or were taken in) are dropped."""
        if self._scanned_all:
            since = (now - timedelta(seconds=DISCOVERY_WINDOW_S)).timestamp()
            ids: list[str] = await self.redis.zrangebyscore(Keys.jobs, since, "+inf")  # type: ignore[assignment]  # decoded: str
        else:
            ids = await self.redis.zrange(Keys.jobs, 0, -1)  # type: ignore[assignment]  # decoded: str
        active: set[str] = await self.redis.smembers(SchedulerKeys.active)  # type: ignore[assignment]  # decoded: str
        incoming: set[str] = await self.redis.smembers(Keys.incoming_jobs)  # type: ignore[assignment]  # decoded: str
        missing = [i for i in ids if i not in active and i not in incoming]
        for start in range(0, len(missing), _MGET_CHUNK):
            jobs = await self.store.get_jobs(missing[start:start + _MGET_CHUNK])
            live = [j.job_id for j in jobs if j.state not in TERMINAL_STATES]
            if live:
                await self.redis.sadd(Keys.incoming_jobs, *live)
                log.info("discovered %d job(s) from the store: %s", len(live), ", ".join(live[:10]))
        waiting = sorted(incoming)
        for start in range(0, len(waiting), _MGET_CHUNK):
            chunk = waiting[start:start + _MGET_CHUNK]
            got = {j.job_id: j for j in await self.store.get_jobs(chunk)}
            gone = [i for i in chunk if i not in got or got[i].state in TERMINAL_STATES or i in active]
            if gone:
                await self.redis.srem(Keys.incoming_jobs, *gone)
        self._scanned_all = True

    async def active_jobs(self) -> list[JobRecord]:
        """Non-terminal jobs of the active set (terminal or vanished ids are pruned from it); a record is parsed
        again only when its JSON changed since the last call."""
        ids: list[str] = sorted(await self.redis.smembers(SchedulerKeys.active))  # type: ignore[arg-type]  # decoded: str
        jobs: list[JobRecord] = []
        parsed: dict[str, tuple[str, JobRecord]] = {}
        for start in range(0, len(ids), _MGET_CHUNK):
            chunk = ids[start:start + _MGET_CHUNK]
            for job_id, raw in zip(chunk, await self.redis.mget([Keys.job(i) for i in chunk]), strict=True):
                if not raw:
                    continue
                hit = self._parsed.get(job_id)
                record = hit[1] if hit and hit[0] == raw else JobRecord.model_validate_json(raw)
                parsed[job_id] = (raw, record)  # type: ignore[assignment]  # decoded: str
                jobs.append(record)
        self._parsed = parsed
        live = [j for j in jobs if j.state not in TERMINAL_STATES]  # transitions never mutate their input
        gone = set(ids) - {j.job_id for j in live}
        if gone:
            await self.redis.srem(SchedulerKeys.active, *gone)
        return live
