"""The calibration loop's I/O: measurements into capped Redis lists, the periodic refit, the report.

    rank 0's derived step (telemetry's ingest) ──ProgressProjector──> samples, in the same transaction as the progress
    refresh loop: 1. failed attempts of the newest jobs → samples  2. read every window  3. fit  4. store

Redis (every key in :class:`~trainyard_runtime.store.Keys`):

- ``calibration_samples(device, kind)``: a list of :class:`Measurement` JSON, newest first, capped
  at ``calibration_max_samples`` (LPUSH + LTRIM in one transaction);
- ``calibration_devices``: the device types that have samples;
- ``calibration_failures_seen``: failed attempts already sampled (``job:attempt``), so that the
  periodic scan records each once (a Lua script: seen-check and push are one step);
- ``calibration``: the fitted :class:`StoredCalibration`, what ``POST /v1/plan`` applies.

The decisions (what to sample, the predictions, the fit, the report) are in
:mod:`trainyard_telemetry.calibration`; nothing here decides.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime

from prometheus_client import Counter
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.events import StepMetrics, utcnow
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore
from trainyard_telemetry.calibration import (
    KINDS,
    JobPrediction,
    Measurement,
    StoredCalibration,
    attempt_start_step,
    failure_measurements,
    fit_measurements,
    predict_job,
    step_measurements,
)
from trainyard_telemetry.settings import CalibrationSettings

log = logging.getLogger(__name__)

SAMPLES = Counter("trainyard_api_calibration_samples_total", "calibration samples recorded", ["kind", "device_type"])
SEEN_FAILURES_KEPT = 100_000

# KEYS: seen zset, sample list, devices set. ARGV: id, ended-at score, measurement JSON, list cap,
# device type, seen cap. 1 when the failure was new and pushed, 0 when it was sampled before.
_PUSH_FAILURE = """
if redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[3])
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
redis.call('SADD', KEYS[3], ARGV[5])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[6]) + 1))
return 1
"""


class CalibrationStore:
    """Samples and the fitted calibration in Redis."""

    def __init__(self, redis: Redis, *, max_samples: int) -> None:
        self.redis = redis
        self.max_samples = max_samples
        self._push_failure = redis.register_script(_PUSH_FAILURE)

    def queue(self, pipe: Pipeline, measurements: Iterable[Measurement]) -> None:
        """Add the pushes to ``pipe`` (in MULTI): the caller's transaction records them or nothing."""
        for m in measurements:
            key = Keys.calibration_samples(m.sample.device_type, m.sample.kind.value)
            pipe.lpush(key, m.dumps())
            pipe.ltrim(key, 0, self.max_samples - 1)
            pipe.sadd(Keys.calibration_devices, m.sample.device_type)

    async def add(self, measurements: Sequence[Measurement]) -> None:
        """Record ``measurements`` in a transaction of their own."""
        async with self.redis.pipeline(transaction=True) as pipe:
            self.queue(pipe, measurements)
            await pipe.execute()

    async def add_failure(self, failure_id: str, m: Measurement) -> bool:
        """Record a failed attempt's sample once; False when it was recorded before."""
        key = Keys.calibration_samples(m.sample.device_type, m.sample.kind.value)
        pushed = await self._push_failure(
            keys=[Keys.calibration_failures_seen, key, Keys.calibration_devices],
            args=[failure_id, m.recorded_at.timestamp(), m.dumps(), self.max_samples, m.sample.device_type,
                  SEEN_FAILURES_KEPT],
        )
        return bool(pushed)

    async def device_types(self) -> list[str]:
        """The device types that have samples."""
        return sorted(await self.redis.smembers(Keys.calibration_devices))  # type: ignore[arg-type]  # decoded: str

    async def measurements(self, device_types: Sequence[str] | None = None) -> dict[str, list[Measurement]]:
        """Every stored measurement per device type, newest first within each kind."""
        types = list(device_types) if device_types is not None else await self.device_types()
        async with self.redis.pipeline(transaction=False) as pipe:
            for device_type in types:
                for kind in KINDS:
                    pipe.lrange(Keys.calibration_samples(device_type, kind.value), 0, -1)
            raws = await pipe.execute()
        out: dict[str, list[Measurement]] = {}
        for i, device_type in enumerate(types):
            chunk = raws[i * len(KINDS):(i + 1) * len(KINDS)]
            parsed = [m for raw in chunk for m in _parse(raw)]
            if parsed:
                out[device_type] = parsed
        return out

    async def load(self) -> StoredCalibration | None:
        """The last fit, or None before the first (or when it cannot be read)."""
        raw = await self.redis.get(Keys.calibration)
        if not raw:
            return None
        try:
            return StoredCalibration.model_validate_json(raw)
        except ValidationError:
            log.warning("the stored calibration at %s is unreadable; ignored until the next refit", Keys.calibration)
            return None

    async def save(self, stored: StoredCalibration) -> None:
        await self.redis.set(Keys.calibration, stored.dumps())


def _model_config(job: JobRecord, catalog: Mapping[str, ModelConfig]) -> ModelConfig | None:
    """The job's model: inline, or looked up in ``catalog`` (None when the reference is unknown)."""
    ref = job.spec.model_config_ref
    return ref if isinstance(ref, ModelConfig) else catalog.get(ref)


def _parse(raws: Iterable[str]) -> list[Measurement]:
    out = []
    for raw in raws:
        try:
            out.append(Measurement.model_validate_json(raw))
        except ValidationError:
            log.warning("skipping an unreadable calibration sample: %.200s", raw)
    return out


class Calibrator:
    """Turns rank-0 StepMetrics and failed attempts into samples, and refits periodically."""

    cache_size = 256

    def __init__(
        self,
        store: StateStore,
        settings: CalibrationSettings,
        *,
        clock: Callable[[], datetime] = utcnow,
        catalog: Mapping[str, ModelConfig] = MODEL_CATALOG,
    ) -> None:
        self.store = store
        self.settings = settings
        self.samples = CalibrationStore(store.redis, max_samples=settings.calibration_max_samples)
        self.assumptions = settings.assumptions
        self.clock = clock
        self.catalog = catalog
        self._jobs: OrderedDict[tuple[str, int], tuple[JobRecord, JobPrediction, int]] = OrderedDict()

    async def measurements_for(self, m: StepMetrics) -> list[Measurement]:
        """The samples rank 0's ``m`` gives (none for other ranks, unknown jobs, warm-up steps)."""
        if m.rank != 0 or m.step - self.settings.calibration_warmup_steps <= 0:
            return []
        found = await self._job(m.job_id, m.attempt)
        if found is None:
            return []
        job, prediction, start_step = found
        return step_measurements(m, job, prediction, start_step, now=self.clock(),
                                 warmup_steps=self.settings.calibration_warmup_steps,
                                 every=self.settings.calibration_sample_every)

    async def _job(self, job_id: str, attempt: int) -> tuple[JobRecord, JobPrediction, int] | None:
        """The job, the planner's prediction for it and the attempt's start step (cached per attempt)."""
        key = (job_id, attempt)
        if key in self._jobs:
            self._jobs.move_to_end(key)
            return self._jobs[key]
        job = await self.store.get_job(job_id)
        config = _model_config(job, self.catalog) if job else None
        start_step = attempt_start_step(job, attempt) if job else None
        if job is None or config is None or start_step is None:
            return None  # not cached: the job or its attempt may be recorded later
        entry = (job, predict_job(job.spec, config, self.assumptions), start_step)
        self._jobs[key] = entry
        if len(self._jobs) > self.cache_size:
            self._jobs.popitem(last=False)
        return entry

    def queue(self, pipe: Pipeline, measurements: Sequence[Measurement]) -> None:
        """Add ``measurements`` to the caller's transaction (the progress update)."""
        self.samples.queue(pipe, measurements)

    def recorded(self, measurements: Sequence[Measurement]) -> None:
        """Count samples once their transaction succeeded."""
        for m in measurements:
            SAMPLES.labels(m.sample.kind.value, m.sample.device_type).inc()

    async def harvest_failures(self) -> int:
        """Sample the failed attempts of the newest jobs not sampled before; how many were new."""
        ids = await self.store.list_job_ids(limit=self.settings.calibration_scan_jobs)
        new = 0
        for job in await self.store.get_jobs(ids):
            for failure_id, m in failure_measurements(job):
                if await self.samples.add_failure(failure_id, m):
                    self.recorded([m])
                    new += 1
        return new

    async def refresh(self) -> StoredCalibration:
        """1. failed attempts → samples 2. read the windows 3. fit 4. store (a ServiceRuntime loop)."""
        await self.harvest_failures()
        measurements = await self.samples.measurements()
        calibration = fit_measurements((m for group in measurements.values() for m in group),
                                       min_samples=self.settings.calibration_min_samples)
        stored = StoredCalibration(calibration=calibration.to_dict(), fitted_at=self.clock(),
                                   min_samples=self.settings.calibration_min_samples)
        await self.samples.save(stored)
        log.debug("calibration refitted: %s", {d: c.step_time_samples for d, c in calibration.devices.items()})
        return stored
