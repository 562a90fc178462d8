"""Per-attempt step timing read models, from StepMetrics and StragglerDetected.

* rank 0: ``Keys.attempt_steps(job, attempt)`` (hash: first step, when it completed and its
  seconds; last step and when; Σ work seconds = step seconds without checkpoint stall (see
  :mod:`.steps`); Σ stall; step count; ``recentWorkSeconds``, an exponential moving average of the work
  seconds, which the checkpoint coordinator's interval advice reads instead of deriving its own) and
  ``Keys.attempt_step_points`` (sorted set step → cumulative work seconds). The goodput ledger needs
  the cumulative work at the attempt's last READY checkpoint, which lies at most one checkpoint
  interval behind its last step, so only the newest ``max_points`` steps are
  kept (ZREMRANGEBYRANK); an older step is interpolated at the attempt's mean step time. Memory
  per attempt is bounded (~``max_points`` × 30 bytes) whether it runs 1e3 or 1e6 steps.
* every rank: ``Keys.rank_timing(job, attempt)`` (hash rank → its latest timing breakdown).
* ``Keys.stragglers(job)``: the job's StragglerDetected events, newest first, capped.

Each change is one Lua script, applied only when the step is newer than the last one recorded,
so a duplicate or late StepMetrics changes nothing (per-job order holds on the metrics topic).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from trainyard_contract.events import StepMetrics, StragglerDetected
from trainyard_runtime.store import Keys
from trainyard_telemetry.goodput import StepTiming
from trainyard_telemetry.steps import step_time

log = logging.getLogger(__name__)

_RANK0 = """
local last = redis.call('HGET', KEYS[1], 'lastStep')
local step = tonumber(ARGV[1])
if last and step <= tonumber(last) then return 0 end
if not last then
  redis.call('HSET', KEYS[1], 'firstStep', ARGV[1], 'firstStepAt', ARGV[2], 'firstStepSeconds', ARGV[5])
end
local cum = redis.call('HINCRBYFLOAT', KEYS[1], 'workSeconds', ARGV[3])
local work, alpha = tonumber(ARGV[3]), tonumber(ARGV[7])
if work > 0 then
  local old = redis.call('HGET', KEYS[1], 'recentWorkSeconds')
  local value = work
  if old then value = tonumber(old) * (1 - alpha) + work * alpha end
  redis.call('HSET', KEYS[1], 'recentWorkSeconds', string.format('%.9g', value))
end
redis.call('HINCRBYFLOAT', KEYS[1], 'checkpointSeconds', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'steps', 1)
redis.call('HSET', KEYS[1], 'lastStep', ARGV[1], 'lastStepAt', ARGV[2])
redis.call('ZADD', KEYS[2], cum, ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -(tonumber(ARGV[6]) + 1))
return 1
"""

WORK_EWMA_ALPHA = 0.2
"""Weight of the newest step in ``recentWorkSeconds`` (the checkpoint coordinator's advice reads it)."""

_RANK = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and cjson.decode(cur)['step'] >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


def rank_breakdown(m: StepMetrics) -> dict[str, Any]:
    """What a job view shows of one rank's latest step."""
    return {
        "step": m.step, "at": m.occurred_at.isoformat(), "stepSeconds": m.step_seconds,
        "computeSeconds": m.compute_seconds, "collectiveSeconds": m.collective_seconds,
        "dataWaitSeconds": m.data_wait_seconds, "checkpointSeconds": m.checkpoint_seconds,
        "tokensPerSecond": m.tokens_per_second, "mfu": m.mfu,
    }


def timing_from_redis(attempt: int, fields: dict[str, str], points: Sequence[tuple[str, float]]) -> StepTiming:
    """A :class:`StepTiming` from the hash and sorted set of one attempt."""
    if not fields.get("lastStep"):
        return StepTiming(attempt=attempt)

    def when(name: str) -> datetime:
        return datetime.fromtimestamp(float(fields[name]), tz=UTC)

    return StepTiming(
        attempt=attempt, steps=int(fields.get("steps", 0)), first_step=int(fields["firstStep"]),
        first_step_at=when("firstStepAt"), first_step_seconds=float(fields.get("firstStepSeconds", 0)),
        last_step=int(fields["lastStep"]), last_step_at=when("lastStepAt"),
        work_seconds=float(fields.get("workSeconds", 0)), checkpoint_seconds=float(fields.get("checkpointSeconds", 0)),
        points=[(int(step), float(cum)) for step, cum in points],
        recent_work_seconds=float(fields["recentWorkSeconds"]) if fields.get("recentWorkSeconds") else None,
    )


class StepTimingStore:
    """Writes and reads the step timing read models."""

    def __init__(self, redis: Redis, *, max_points: int = 4096, max_stragglers: int = 100) -> None:
        self.redis = redis
        self.max_points = max_points
        self.max_stragglers = max_stragglers
        self._rank0 = redis.register_script(_RANK0)
        self._rank = redis.register_script(_RANK)

    async def on_step_metrics(self, m: StepMetrics) -> None:
        """Bus handler (trainyard.metrics): every rank's breakdown; rank 0's step into the ledger."""
        async with self.redis.pipeline(transaction=False) as pipe:
            await self.stage(pipe, m)
            await pipe.execute()

    async def stage(self, pipe: Any, m: StepMetrics) -> None:
        """:meth:`on_step_metrics`'s writes, staged in the caller's pipeline (a batch in one round trip)."""
        await self._rank(keys=[Keys.rank_timing(m.job_id, m.attempt)],
                         args=[str(m.rank), m.step, json.dumps(rank_breakdown(m))], client=pipe)
        if m.rank != 0:
            return
        t = step_time(m)
        await self._rank0(
            keys=[Keys.attempt_steps(m.job_id, m.attempt), Keys.attempt_step_points(m.job_id, m.attempt)],
            args=[m.step, repr(m.occurred_at.timestamp()), repr(t.work_seconds), repr(t.stall_seconds),
                  repr(t.seconds), self.max_points, repr(WORK_EWMA_ALPHA)], client=pipe,
        )

    async def on_straggler(self, event: StragglerDetected) -> None:
        """Bus handler (trainyard.workers): keep the job's newest straggler reports."""
        key = Keys.stragglers(event.job_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(key, event.model_dump_json(by_alias=True, exclude={"event_type", "schema_version"}))
            pipe.ltrim(key, 0, self.max_stragglers - 1)
            await pipe.execute()

    async def timings(self, job_id: str, attempts: Sequence[int]) -> dict[int, StepTiming]:
        """Rank 0's step timing of each of ``attempts``."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for n in attempts:
                pipe.hgetall(Keys.attempt_steps(job_id, n))
                pipe.zrange(Keys.attempt_step_points(job_id, n), 0, -1, withscores=True)
            raw = await pipe.execute()
        return {n: timing_from_redis(n, raw[2 * i], raw[2 * i + 1]) for i, n in enumerate(attempts)}

    async def ranks(self, job_id: str, attempt: int) -> dict[int, dict[str, Any]]:
        raw = await self.redis.hgetall(Keys.rank_timing(job_id, attempt))
        return {int(rank): json.loads(value) for rank, value in sorted(raw.items(), key=lambda kv: int(kv[0]))}

    async def stragglers(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(s) for s in await self.redis.lrange(Keys.stragglers(job_id), 0, -1)]
