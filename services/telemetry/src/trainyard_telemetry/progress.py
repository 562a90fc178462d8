"""The progress read model: rank 0's StepMetrics → ``Progress`` at ``Keys.progress(job)``.

Progress only moves forward. Order is (attempt, step): a newer attempt replaces an older
one even at a lower step (it resumed from a checkpoint), and within an attempt a step
that is not newer is a duplicate or a late delivery and is ignored.

Its tokens/s and MFU are the attempt's (:func:`throughput`), not the newest step's: a finished job's last step
is its final save, and showed a fraction of the run's throughput.

With a :class:`~trainyard_telemetry.calibrator.Calibrator`, the step's calibration samples (step time,
checkpoint stall) are pushed in the same transaction as the progress, so a redelivered or stale
StepMetrics, which moves nothing, samples nothing either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import WatchError

from trainyard_contract.events import StepMetrics, utcnow
from trainyard_contract.records import Progress
from trainyard_runtime.store import Keys
from trainyard_telemetry.steps import step_time

if TYPE_CHECKING:
    from trainyard_telemetry.calibration import Measurement
    from trainyard_telemetry.calibrator import Calibrator

log = logging.getLogger(__name__)

STEP_METRICS = Counter(
    "trainyard_api_step_metrics_total",
    "StepMetrics events seen by the progress read model",
    ["outcome"],
)


def _work(m: StepMetrics) -> tuple[float, float] | None:
    """The step's tokens and its seconds without its checkpoint stall (None when it reported no rate)."""
    t = step_time(m)
    if not m.tokens_per_second or t.seconds <= 0:
        return None
    return (m.tokens_per_second * t.seconds, t.work_seconds) if t.work_seconds > 0 else None


def throughput(current: Progress | None, m: StepMetrics) -> tuple[float, float, float | None, float | None]:
    """(attempt tokens, attempt work seconds, tokens/s, MFU) after ``m``.

    The attempt's figure, not the newest step's: the tokens of its steps after the first (whose window holds the
    launch and warm-up) over their step time without checkpoint stalls — a run's last step is usually its final
    save, and a step that saved is slower for it. Until a second step, the first one's rate without its stall.
    MFU is proportional to tokens/s within an attempt, so it is scaled by the same figure.
    """
    same = current is not None and current.attempt == m.attempt
    work = _work(m)
    tokens, seconds = (current.attempt_tokens, current.attempt_work_seconds) if same and current else (0.0, 0.0)
    if same and work:
        tokens, seconds = tokens + work[0], seconds + work[1]
    rate: float | None
    if seconds > 0:
        rate = tokens / seconds
    elif work:  # the attempt's first step
        rate = work[0] / work[1]
    elif same and current and current.tokens_per_second is not None:
        rate = current.tokens_per_second
    else:  # a rate without a step time to weigh it by
        rate = m.tokens_per_second
    if m.mfu is not None and m.tokens_per_second and rate is not None:
        mfu: float | None = m.mfu * rate / m.tokens_per_second
    else:
        mfu = current.mfu if same and current else m.mfu
    return tokens, seconds, rate, mfu


def advance_progress(current: Progress | None, m: StepMetrics, now: datetime) -> Progress | None:
    """The new progress after ``m``, or None when ``m`` changes nothing (not rank 0, or not newer)."""
    if m.rank != 0:
        return None
    if current is not None:
        if (m.attempt, m.step) <= (current.attempt or 0, current.global_step):
            return None
    tokens, seconds, tokens_per_second, mfu = throughput(current, m)
    return Progress(
        attempt=m.attempt,
        global_step=m.step,
        max_steps=m.max_steps if m.max_steps is not None else (current.max_steps if current else None),
        consumed_tokens=m.consumed_tokens,
        consumed_samples=m.consumed_samples,
        last_loss=m.loss,
        lr=m.lr,
        tokens_per_second=tokens_per_second,
        mfu=mfu,
        step_seconds=m.step_seconds,
        attempt_tokens=tokens,
        attempt_work_seconds=seconds,
        updated_at=now,
    )


class ProgressProjector:
    """Applies StepMetrics to Redis with an optimistic transaction (WATCH), so two API
    replicas racing on the same job never move progress backwards."""

    def __init__(self, redis: Redis, *, clock: Callable[[], datetime] = utcnow,
                 calibrator: Calibrator | None = None) -> None:
        self.redis = redis
        self.clock = clock
        self.calibrator = calibrator

    async def on_step_metrics(self, m: StepMetrics) -> None:
        """Bus handler for ``trainyard.metrics``."""
        if m.rank != 0:
            STEP_METRICS.labels("other_rank").inc()
            return
        samples = await self._samples(m)
        applied = await self.apply(m, samples)
        STEP_METRICS.labels("applied" if applied else "stale").inc()
        if applied and samples and self.calibrator is not None:
            self.calibrator.recorded(samples)

    async def _samples(self, m: StepMetrics) -> list[Measurement]:
        if self.calibrator is None:
            return []
        try:
            return await self.calibrator.measurements_for(m)
        except Exception:  # noqa: BLE001 - calibration is a by-product: never hold progress back for it
            log.exception("no calibration samples from step %d of %s", m.step, m.job_id)
            return []

    async def apply(self, m: StepMetrics, samples: list[Measurement] | None = None) -> bool:
        """True when ``m`` moved the job's progress forward (and ``samples`` were recorded with it)."""
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
                    if samples and self.calibrator is not None:
                        self.calibrator.queue(pipe, samples)
                    await pipe.execute()
                    return True
                except WatchError:
                    log.debug("progress of %s changed concurrently; retrying", m.job_id)
                    continue
