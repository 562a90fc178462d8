"""What the interval advice is computed from, measured as events arrive, and the advice itself.

* ``StepMetrics`` → ``Keys.checkpoint_timing(job)``: the stall of each step (slowest rank:
  ``stall:<attempt>:<step>``); rank 0's furthest (attempt, step) per job (``LIVE_STEPS``, for the
  protection watch); and the device-seconds of training of the job's device type
  (``exposure`` in ``Keys.failure_stats(type)``: rank 0's step time x the job's devices).
* rank 0's step time without the stall is not derived here: the telemetry service derives it once and keeps
  an exponential moving average of it in the step-timing read model (``recentWorkSeconds`` of
  ``Keys.attempt_steps(job, attempt)``), which the advice reads (:func:`recent_step_seconds`).
* ``WorkerExited`` that is an interruption (see :func:`advice.counts_as_interruption`) →
  ``failures`` of the device type, once per (job, attempt) however many ranks report it.
* every ``advice_interval_s`` and after each READY: :func:`advice.advise` for each running job →
  ``Keys.checkpoint_advice(job)`` (JSON, camelCase; the API shows it in the job's GET).

All counters are updated by Lua scripts, so they are atomic and a re-delivered event changes a
maximum or an already-counted attempt not at all (exposure may count a re-delivered step twice).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from redis.asyncio import Redis

from trainyard_contract.events import TERMINAL_STATES, StepMetrics, WorkerExited, utcnow
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore
from trainyard_telemetry.readmodels import StepTiming, StepTimingStore

from trainyard_checkpoint_coordinator.advice import CheckpointAdvice, FailureStats, advise, counts_as_interruption
from trainyard_checkpoint_coordinator.collector import JOBS_INDEX
from trainyard_checkpoint_coordinator.protection import LIVE_STEPS
from trainyard_checkpoint_coordinator.settings import CoordinatorSettings

log = logging.getLogger(__name__)
Clock = Callable[[], datetime]

# KEYS: timing, failure stats, live steps   ARGV: rank, attempt, step, checkpoint seconds, exposure, job id
_ON_STEP = """
if ARGV[1] == '0' then
  local seen = redis.call('HGET', KEYS[3], ARGV[6])
  local attempt, step = tonumber(ARGV[2]), tonumber(ARGV[3])
  local newer = true
  if seen then
    local a, s = string.match(seen, '^(%d+):(%d+)$')
    newer = a == nil or attempt > tonumber(a) or (attempt == tonumber(a) and step > tonumber(s))
  end
  if newer then redis.call('HSET', KEYS[3], ARGV[6], ARGV[2] .. ':' .. ARGV[3]) end
end
local stall = tonumber(ARGV[4])
if stall > 0 then
  local field = 'stall:' .. ARGV[2] .. ':' .. ARGV[3]
  local current = tonumber(redis.call('HGET', KEYS[1], field) or '-1')
  if stall > current then redis.call('HSET', KEYS[1], field, ARGV[4]) end
end
if tonumber(ARGV[5]) > 0 then redis.call('HINCRBYFLOAT', KEYS[2], 'exposure', ARGV[5]) end
return 1
"""

# KEYS: seen marker, failure stats   ARGV: ttl seconds
_ON_FAILURE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('HINCRBY', KEYS[2], 'failures', 1)
end
return -1
"""

SEEN_TTL_S = 90 * 86_400
RECENT_ATTEMPTS = 2  # the current attempt, and the one before while the current has no step yet
_MAX_STALL_FIELDS = 2000


@dataclass(frozen=True)
class JobFacts:
    """What the measurements need of a job, cached: its device type and size."""

    device_type: str
    devices: int


class Measurements:
    """Consumes StepMetrics and WorkerExited; computes and stores each job's interval advice."""

    def __init__(self, redis: Redis, settings: CoordinatorSettings, *, clock: Clock = utcnow) -> None:
        self.redis = redis
        self.store = StateStore(redis)
        self.settings = settings
        self.clock = clock
        self._on_step = redis.register_script(_ON_STEP)
        self._on_failure = redis.register_script(_ON_FAILURE)
        self.timing = StepTimingStore(redis)  # the telemetry service's read model: rank 0's step time
        self._facts: dict[str, JobFacts | None] = {}

    async def _job_facts(self, job_id: str) -> JobFacts | None:
        if job_id not in self._facts:
            if len(self._facts) > 10_000:
                self._facts.clear()
            job = await self.store.get_job(job_id)
            if job is None:
                return None  # not cached: the job record may appear later
            self._facts[job_id] = JobFacts(job.spec.resources.gpu_type, job.spec.resources.gpu_count)
        return self._facts[job_id]

    # ------------------------------------------------------------------ events
    async def on_step_metrics_batch(self, batch: list[StepMetrics]) -> None:
        """A fetched batch, in order (rank 0's events are the ones that write)."""
        for event in batch:
            await self.on_step_metrics(event)

    async def on_step_metrics(self, event: StepMetrics) -> None:
        """Record this step's stall and step time, and the device-seconds it took.

        Rank 0 speaks for the step (time, and exposure for every device of the job, since all of
        them spend the step together); the other ranks only matter when they stalled on a save.
        """
        if event.rank != 0 and event.checkpoint_seconds <= 0:
            return
        facts = await self._job_facts(event.job_id)
        if facts is None:
            return
        exposure = max(event.step_seconds, 0.0) * facts.devices if event.rank == 0 else 0.0
        await self._on_step(
            keys=[Keys.checkpoint_timing(event.job_id), Keys.failure_stats(facts.device_type), LIVE_STEPS],
            args=[event.rank, event.attempt, event.step, max(event.checkpoint_seconds, 0.0), exposure, event.job_id],
        )

    async def on_worker_exited(self, event: WorkerExited) -> None:
        """Count a failed attempt of the job's device type (once per attempt)."""
        if not counts_as_interruption(event.reason, event.exit_code):
            return
        facts = await self._job_facts(event.job_id)
        if facts is None:
            return
        count = await self._on_failure(
            keys=[Keys.failures_seen(event.job_id, event.attempt), Keys.failure_stats(facts.device_type)],
            args=[SEEN_TTL_S],
        )
        if int(count) > 0:
            log.info("failure %d of device type %s: job %s attempt %d (%s)", int(count), facts.device_type,
                     event.job_id, event.attempt, event.reason)

    # ------------------------------------------------------------------ advice
    async def advise_all(self) -> None:
        """Refresh the advice of every job with checkpoints that has not ended."""
        job_ids: list[str] = await self.redis.zrange(JOBS_INDEX, 0, -1)  # type: ignore[assignment]  # decoded: str
        for job_id in job_ids:
            await self.advise(job_id, only_running=True)

    async def advise(self, job_id: str, *, only_running: bool = False) -> CheckpointAdvice | None:
        """Compute and store the advice for one job; None when the job is unknown (or ended)."""
        job = await self.store.get_job(job_id)
        if job is None or (only_running and job.state in TERMINAL_STATES):
            return None
        advice = await self._compute(job)
        await self.redis.set(Keys.checkpoint_advice(job_id), advice.dumps())
        return advice

    async def _compute(self, job: JobRecord) -> CheckpointAdvice:
        records = await self.store.list_checkpoints(job.job_id)
        measured = [c for c in records if c.ready_at is not None]  # READY, or READY once (DELETED)
        timing: dict[str, str] = await self.redis.hgetall(  # type: ignore[assignment]  # decoded: str
            Keys.checkpoint_timing(job.job_id))
        stalls = _stalls(timing)
        if len(stalls) > _MAX_STALL_FIELDS:
            await self._trim(job.job_id, stalls)
        device_type = job.spec.resources.gpu_type
        raw = await self.redis.hgetall(Keys.failure_stats(device_type))
        stats = FailureStats(int(raw.get("failures", 0)), float(raw.get("exposure", 0.0)))
        attempts = [a.attempt for a in job.attempts[-RECENT_ATTEMPTS:]]
        step_seconds = recent_step_seconds(await self.timing.timings(job.job_id, attempts)) if attempts else None
        return advise(
            job_id=job.job_id, device_type=device_type, devices=job.spec.resources.gpu_count,
            policy=job.spec.checkpoint_policy, max_steps=job.spec.training.max_steps, ready=measured,
            stall_by_step=stalls, step_seconds=step_seconds,
            stats=stats, now=self.clock(), prior_mtbf_s=self.settings.prior_device_mtbf_s,
            window=self.settings.advice_window,
        )

    async def _trim(self, job_id: str, stalls: dict[tuple[int, int], float]) -> None:
        """Drop the oldest per-step stall entries (only the last few checkpoints are used)."""
        old = sorted(stalls)[: len(stalls) - _MAX_STALL_FIELDS // 2]
        await self.redis.hdel(Keys.checkpoint_timing(job_id), *[f"stall:{a}:{s}" for a, s in old])


def recent_step_seconds(timings: Mapping[int, StepTiming]) -> float | None:
    """Rank 0's recent step time without checkpoint stalls, from the step-timing read model: the newest
    attempt's that has one (a new attempt has none until its first step, and then the previous one's is the
    better guess). Pure."""
    for attempt in sorted(timings, reverse=True):
        if timings[attempt].recent_work_seconds is not None:
            return timings[attempt].recent_work_seconds
    return None


def _stalls(timing: dict[str, str]) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for field, value in timing.items():
        if field.startswith("stall:"):
            _, attempt, step = field.split(":")
            out[(int(attempt), int(step))] = float(value)
    return out
