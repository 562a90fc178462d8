"""The experiments' driver: a loop in every API process that moves each running search on.

Each tick, for each experiment in ``ty:experiments:active``, the process that holds the experiment's driver
lease (``ty:experiment-driver:<id>``, SET NX with a TTL, renewed each tick; another process takes over when
it lapses) 1. observes the trials' jobs (records, the metric history's rank-0 series), 2. decides
(:func:`trainyard_api.search.decide`, pure), 3. writes the record under WATCH — points drawn and job ids
derived before any job is submitted, so a restart finds them — and 4. applies the actions: submit (an
Idempotency-Key per trial), pause, resume, cancel (``JobService.control``, as a user's request would be).
Everything it knows is in Redis: an API restarted mid-sweep carries on from the record.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from prometheus_client import Counter
from pydantic import ValidationError
from redis.asyncio import Redis

from trainyard_contract.errors import ConflictError, NotFoundError
from trainyard_contract.events import utcnow
from trainyard_contract.experiments import ExperimentRecord, ParamValue
from trainyard_contract.records import ExperimentOrigin, JobRecord
from trainyard_runtime.bus import is_retryable
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import Keys
from trainyard_telemetry.metrics_history import series_key

from trainyard_api.bodies import SubmittedSpec
from trainyard_api.experiments import ExperimentStore, experiment_token, trial_job_id, trial_key
from trainyard_api.jobs import JobService
from trainyard_api.search import ENDED, Action, Observation, decide, rung_steps, sample_point, trial_body
from trainyard_api.validation import InvalidSpecError, field_errors

log = logging.getLogger(__name__)

EXPERIMENT_ACTIONS = Counter("trainyard_api_experiment_actions_total", "trial actions the experiments' driver took",
                             ["action"])
LEASE_S = 10
SMOOTHING = 8
"""A rung's (and a trial's) value is the mean of its last this-many reported values up to the rung's step."""


def device_hours(job: JobRecord, now: datetime) -> float:
    """The device-hours the job's attempts held (a running attempt up to ``now``)."""
    total = 0.0
    for attempt in job.attempts:
        end = attempt.ended_at or now
        total += max(0.0, (end - attempt.started_at).total_seconds()) * job.spec.resources.gpu_count
    return total / 3600


def smoothed(raw: bytes) -> float | None:
    """The mean of the last :data:`SMOOTHING` values present in a float32 run (NaN: no value that step)."""
    values = [v for (v,) in struct.iter_unpack("<f", raw[: len(raw) // 4 * 4]) if math.isfinite(v)]
    tail = values[-SMOOTHING:]
    return sum(tail) / len(tail) if tail else None


def is_trial_job(job: JobRecord, experiment_id: str, number: int) -> bool:
    """Whether ``job`` is the one the driver submitted for the trial (not one submitted by hand under its key)."""
    origin = job.experiment
    return origin is not None and origin.experiment_id == experiment_id and origin.trial == number


class ExperimentDriver:
    """Moves the running experiments on (see the module's docstring)."""

    def __init__(self, redis: Redis, raw: Redis, jobs: Callable[[], JobService], instance: str, *,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.redis = redis
        self.raw = raw  # bytes, for the metric history's float32 runs
        self.store = ExperimentStore(redis)
        self.jobs = jobs
        self.instance = instance
        self.clock = clock

    def install(self, runtime: ServiceRuntime, every_s: float = 1.0) -> None:
        runtime.add_loop("experiments", self.tick, every_s=every_s)

    async def tick(self) -> None:
        for experiment_id in await self.store.active():
            if await self._lease(experiment_id):
                try:
                    await self.drive(experiment_id)
                except Exception as exc:
                    if is_retryable(exc):
                        raise
                    log.exception("experiment %s: this tick failed; the next one tries again", experiment_id)

    async def _lease(self, experiment_id: str) -> bool:
        """Hold (or renew) the experiment's driver lease; False when another process holds it."""
        key = Keys.experiment_driver(experiment_id)
        if await self.redis.set(key, self.instance, nx=True, ex=LEASE_S):
            return True
        if await self.redis.get(key) == self.instance:
            await self.redis.expire(key, LEASE_S)
            return True
        return False

    async def drive(self, experiment_id: str) -> None:
        """One step of the search: observe, decide, write, act."""
        actions: list[Action] = []

        async def step(record: ExperimentRecord) -> ExperimentRecord | None:
            if record.state != "running":
                return None
            max_steps = int(record.spec.base.get("training", {}).get("maxSteps", 0))
            rungs = rung_steps(record.spec, max_steps)
            observed = await self.observe(record, rungs)

            def sampler(n: int, finished: Sequence[tuple[Mapping[str, ParamValue], float]]) -> dict[str, ParamValue]:
                return sample_point(record.spec, n, finished)

            decision = decide(record, observed, rungs=rungs, sampler=sampler, now=self.clock())
            trials = [t if t.job_id else t.model_copy(update={"job_id": trial_job_id(record, t.number)})
                      for t in decision.record.trials]
            actions[:] = decision.actions
            return decision.record.model_copy(update={"trials": trials})

        record = await self.store.update(experiment_id, step)
        if record is not None:
            for action in actions:
                await self.apply(record, action)

    async def observe(self, record: ExperimentRecord, rungs: Sequence[int]) -> dict[int, Observation]:
        """The jobs of the trials not over yet (one MGET; an ended trial's record already holds all it will)."""
        now = self.clock()
        out: dict[int, Observation] = {}
        live = [t for t in record.trials if t.job_id is not None and t.state not in ENDED]
        jobs = {j.job_id: j for j in await self.jobs().store.get_jobs([t.job_id or "" for t in live])}
        for trial in live:
            if (job := jobs.get(trial.job_id or "")) is None:
                continue
            if not is_trial_job(job, record.experiment_id, trial.number):
                out[trial.number] = Observation(state="failed", rung_values={}, reason=(
                    f"its job id {job.job_id} was taken by a job that is not this trial's (submitted with the "
                    "trial's Idempotency-Key by hand?); the trial did not run"))
                continue
            key = series_key(job.job_id, 0, record.spec.metric.name)
            last = await self.raw.strlen(key) // 4 - 1
            values: dict[int, float] = {}
            for k in range(len(trial.rungs), len(rungs)):
                if rungs[k] > last:
                    break
                if (v := await self._mean_upto(key, rungs[k])) is not None:
                    values[k] = v
            out[trial.number] = Observation(
                state=job.state, rung_values=values, last_step=max(last, 0),
                last_value=await self._mean_upto(key, last) if last >= 0 else None,
                device_hours=device_hours(job, now), reason=job.reason, control=job.control)
        return out

    async def _mean_upto(self, key: str, step: int) -> float | None:
        first = max(0, step - 4 * SMOOTHING)
        raw = await self.raw.getrange(key, first * 4, step * 4 + 3)
        return smoothed(raw if isinstance(raw, bytes) else raw.encode("latin-1"))

    async def apply(self, record: ExperimentRecord, action: Action) -> None:
        trial = record.trials[action.trial]
        jobs, token = self.jobs(), experiment_token(record)
        EXPERIMENT_ACTIONS.labels(action.kind).inc()
        if action.kind == "submit":
            await self._submit(record, action.trial)
            return
        assert trial.job_id is not None
        try:
            await jobs.control(token, trial.job_id, action.kind, reason=f"experiment {record.spec.name}: "
                                                                       f"{action.reason or action.kind}")
            log.info("experiment %s trial %d: %s (%s)", record.experiment_id, trial.number, action.kind,
                     action.reason)
        except (ConflictError, NotFoundError) as exc:  # the job moved on meanwhile: the next tick sees where to
            log.info("experiment %s trial %d: %s not done: %s", record.experiment_id, trial.number, action.kind, exc)

    async def _submit(self, record: ExperimentRecord, number: int) -> None:
        trial = record.trials[number]
        origin = ExperimentOrigin(experiment_id=record.experiment_id, experiment_name=record.spec.name,
                                  trial=number, params=dict(trial.params))
        try:
            spec = SubmittedSpec.model_validate(trial_body(record.spec, trial))
            await self.jobs().submit(spec, experiment_token(record), idempotency_key=trial_key(
                record.experiment_id, number), experiment=origin)
        except ValidationError as exc:
            await self._trial_failed(record.experiment_id, number, "its spec does not validate: " + "; ".join(
                f"{p.field}: {p.message}" for p in field_errors(exc.errors())))
        except InvalidSpecError as exc:
            await self._trial_failed(record.experiment_id, number, "its spec was refused: " + "; ".join(
                f"{p.field}: {p.message}" for p in exc.problems))
        except ConflictError as exc:  # the key's job exists with another spec: observe() judges whose it is
            log.warning("experiment %s trial %d: %s", record.experiment_id, number, exc)
        else:
            log.info("experiment %s: trial %d submitted as %s with %s", record.experiment_id, number, trial.job_id,
                     trial.params)

    async def _trial_failed(self, experiment_id: str, number: int, reason: str) -> None:
        log.warning("experiment %s trial %d failed: %s", experiment_id, number, reason)

        async def fail(current: ExperimentRecord) -> ExperimentRecord | None:
            trials = list(current.trials)
            trials[number] = trials[number].model_copy(update={"state": "failed", "reason": reason})
            return current.model_copy(update={"trials": trials})

        await self.store.update(experiment_id, fail)
