"""The protection watch: every running job's distance from its newest READY checkpoint.

Every ``sweep_interval_s`` it reads the furthest step rank 0 of each job reported
(:data:`~trainyard_checkpoint_coordinator.protection.LIVE_STEPS`, kept by the measurements), the
job's live attempt and its READY checkpoints, decides with
:func:`~trainyard_checkpoint_coordinator.protection.assess_protection`, and applies: the condition
in ``ty:job:<id>:ckpt-protection``, the gauge ``trainyard_checkpoint_unprotected_intervals{job_id}``,
and on each transition a log line (and ``trainyard_checkpoint_stalls_total`` when it begins).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from redis.asyncio import Redis

from trainyard_contract.events import TERMINAL_STATES, utcnow
from trainyard_runtime.store import StateStore

from trainyard_checkpoint_coordinator import metrics
from trainyard_checkpoint_coordinator.protection import (
    CONDITION,
    LIVE_STEPS,
    Protection,
    assess_protection,
    protection_key,
)
from trainyard_checkpoint_coordinator.settings import CoordinatorSettings

log = logging.getLogger(__name__)
Clock = Callable[[], datetime]


class ProtectionWatch:
    """Flags running jobs that train on while none of their checkpoints becomes READY."""

    def __init__(self, redis: Redis, settings: CoordinatorSettings, *, clock: Clock = utcnow) -> None:
        self.redis = redis
        self.store = StateStore(redis)
        self.settings = settings
        self.clock = clock

    async def check_all(self) -> None:
        live: dict[str, str] = await self.redis.hgetall(LIVE_STEPS)  # type: ignore[assignment]  # decoded: str
        for job_id, value in live.items():
            attempt, step = (int(x) for x in value.split(":", 1))
            await self.check(job_id, attempt, step)

    async def check(self, job_id: str, attempt: int, step: int) -> Protection | None:
        """Assess and store one job's condition; None (and the condition removed) once it has ended."""
        job = await self.store.get_job(job_id)
        record = next((a for a in job.attempts if a.attempt == attempt), None) if job else None
        if job is None or job.state in TERMINAL_STATES:
            await self._forget(job_id)
            return None
        if record is None or record.state not in ("starting", "running"):
            return None  # between attempts: the next one reports its own steps
        every = record.checkpoint_every_steps or job.spec.checkpoint_policy.every_steps or 0
        ready = [c.global_step for c in await self.store.list_checkpoints(job_id) if c.state == "READY"]
        start = record.start_checkpoint.global_step if record.start_checkpoint else 0
        raw: str | None = await self.redis.get(protection_key(job_id))  # type: ignore[assignment]  # decoded: str
        previous = Protection.loads(raw) if raw else None
        now = assess_protection(job_id=job_id, attempt=attempt, step=step, protected_step=max([start, *ready]),
                                every_steps=every, threshold=self.settings.stall_intervals, now=self.clock(),
                                previous=previous)
        await self.redis.set(protection_key(job_id), now.dumps())
        metrics.UNPROTECTED_INTERVALS.labels(job_id).set(now.unprotected_intervals)
        if now.stalled and not (previous and previous.stalled and previous.attempt == attempt):
            metrics.STALLS.inc()
            log.error("%s: %s: %s", job_id, CONDITION, now.reason)
        elif previous is not None and previous.stalled and not now.stalled:
            log.warning("%s: %s cleared: %s", job_id, CONDITION, now.reason)
        return now

    async def _forget(self, job_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(LIVE_STEPS, job_id)
            pipe.delete(protection_key(job_id))
            await pipe.execute()
        try:
            metrics.UNPROTECTED_INTERVALS.remove(job_id)
        except KeyError:
            pass
