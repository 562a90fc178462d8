"""The progress read model: rank 0's StepMetrics → ``Progress`` at ``Keys.progress(job)``.

Progress only moves forward. Order is (attempt, step): a newer attempt replaces an older
one even at a lower step (it resumed from a checkpoint), and within an attempt a step
that is not newer is a duplicate or a late delivery and is ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import WatchError

from trainyard_common.events import StepMetrics, utcnow
from trainyard_common.records import Progress
from trainyard_common.store import Keys

log = logging.getLogger(__name__)

STEP_METRICS = Counter(
    "trainyard_api_step_metrics_total",
    "StepMetrics events seen by the progress read model",
    ["outcome"],
)


def advance_progress(current: Progress | None, m: StepMetrics, now: datetime) -> Progress | None:
    """The new progress after ``m``, or None when ``m`` changes nothing (not rank 0, or not newer)."""
    if m.rank != 0:
        return None
    if current is not None:
        if (m.attempt, m.step) <= (current.attempt or 0, current.global_step):
            return None
    return Progress(
        attempt=m.attempt,
        global_step=m.step,
        max_steps=m.max_steps if m.max_steps is not None else (current.max_steps if current else None),
        consumed_tokens=m.consumed_tokens,
        consumed_samples=m.consumed_samples,
        last_loss=m.loss,
        lr=m.lr,
        tokens_per_second=m.tokens_per_second,
        mfu=m.mfu,
        step_seconds=m.step_seconds,
        updated_at=now,
    )


class ProgressProjector:
    """Applies StepMetrics to Redis with an optimistic transaction (WATCH), so two API
    replicas racing on the same job never move progress backwards."""

    def __init__(self, redis: Redis, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.redis = redis
        self.clock = clock

    async def on_step_metrics(self, m: StepMetrics) -> None:
        """Bus handler for ``trainyard.metrics``."""
        if m.rank != 0:
            STEP_METRICS.labels("other_rank").inc()
            return
        applied = await self.apply(m)
        STEP_METRICS.labels("applied" if applied else "stale").inc()

    async def apply(self, m: StepMetrics) -> bool:
        """True when ``m`` moved the job's progress forward."""
        key = Keys.progress(m.job_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    current = Progress.model_validate_json(raw) if raw else None
                    new = advance_progress(current, m, self.clock())
                    if new is None:
                        await pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.set(key, new.dumps())
                    await pipe.execute()
                    return True
                except WatchError:
                    log.debug("progress of %s changed concurrently; retrying", m.job_id)
                    continue
