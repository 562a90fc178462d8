"""Metric history: every StepMetrics of every rank, stored compactly at ingest, down-sampled on read.

Redis, per job and rank (keys below; ``ty:mh:`` prefix):

- ``att``: a string of little-endian uint16, one per step at offset ``step × 2``: the attempt that
  wrote the step, plus one (0: no value for that step). It is both the presence map and the fence:
- ``s:<series>``: a string of little-endian float32, one per step at offset ``step × 4`` (SETRANGE);
  NaN where the step did not carry the series (a custom metric logged every tenth step).

- ``s:<series>:l<k>``: the series' coarser levels, ``k`` = 1…5, one 18-byte entry per block of
  ``8^k`` steps (8, 64, 512, 4,096, 32,768): float32 minimum, maximum and mean over the block's present
  steps, then uint16 count, and the offsets in the block of the minimum and of the maximum.

One Lua script per StepMetrics writes every series of the step only when no newer attempt wrote it,
so a redelivered event rewrites the same bytes and a late event of an older attempt changes nothing,
while a resumed attempt replaying steps overwrites them (the newest attempt's value for a step wins).
The same script recomputes the step's block at each level from the eight entries below it, so a
replaced value leaves no trace in any level. A million steps cost 4 MB per series, 2 MB of fence and
~0.6 MB of levels.

A read picks the coarsest level that still has at least two blocks per point asked for
(:func:`level_for`): a curve is down-sampled from the blocks' minima and maxima, which are real points
at their real steps (so a spike survives: it is its block's extreme), a heat map from the blocks' means
and counts with bucket edges on block boundaries (so every mean is exact). The blocks that hold the
window's first and last steps are read at full resolution (:class:`ReadPlan`). A whole 1M-step run at 2,000 points reads
~280 KB per series instead of 4 MB.

Rank 0 stores every series (loss, lr, tokensPerSecond, mfu, the timing series and the script's own
``metrics``); the other ranks the timing series. ``series`` (set) names the job's custom series,
``ranks`` (set) the ranks that reported. Retention: the API deletes no job read model (progress,
step timing, checkpoints stay with the job record), so the history stays with them; :meth:`delete`
removes it for whoever purges a job.
"""

from __future__ import annotations

import asyncio
import functools
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.asyncio import Redis

from trainyard_contract.errors import SpecError
from trainyard_contract.events import StepMetrics
from trainyard_runtime.replication import undecoded
from trainyard_runtime.store import Keys
from trainyard_telemetry.downsample import Buckets, bucket_stats, lttb, minmax

CURVES = ("loss", "lr", "tokensPerSecond", "mfu")
TIMING = ("stepSeconds", "computeSeconds", "collectiveSeconds", "dataWaitSeconds", "checkpointSeconds")
BUILTIN = CURVES + TIMING
_FIELDS = {"loss": "loss", "lr": "lr", "tokensPerSecond": "tokens_per_second", "mfu": "mfu",
           "stepSeconds": "step_seconds", "computeSeconds": "compute_seconds",
           "collectiveSeconds": "collective_seconds", "dataWaitSeconds": "data_wait_seconds",
           "checkpointSeconds": "checkpoint_seconds"}
SERIES_NAME = re.compile(r"^[A-Za-z0-9_.:/-]{1,64}$")
MAX_STEP = 50_000_000  # 200 MB per series: a bound on what one bad event may allocate
NAN = struct.pack("<f", float("nan"))


def _prefix(job_id: str) -> str:
    return Keys.metrics_history(job_id)


def attempt_key(job_id: str, rank: int) -> str:
    return f"{_prefix(job_id)}:{rank}:att"


def series_key(job_id: str, rank: int, series: str) -> str:
    return f"{_prefix(job_id)}:{rank}:s:{series}"


FANOUT = 8
LEVELS = tuple(FANOUT ** k for k in range(1, 6))  # steps per block at levels 1…5
ENTRY = np.dtype([("lo", "<f4"), ("hi", "<f4"), ("mean", "<f4"), ("count", "<u2"), ("argmin", "<u2"),
                  ("argmax", "<u2")])  # 18 bytes, packed


def level_key(job_id: str, rank: int, series: str, level: int) -> str:
    return f"{series_key(job_id, rank, series)}:l{level}"


@functools.lru_cache(maxsize=65_536)
def _rank_keys(job_id: str, rank: int) -> tuple[str, str, str]:
    """A rank's first three keys of the write (every StepMetrics of every rank builds them: kept)."""
    return attempt_key(job_id, rank), custom_series_key(job_id), ranks_key(job_id)


@functools.lru_cache(maxsize=262_144)
def _series_keys(job_id: str, rank: int, series: str) -> tuple[str, ...]:
    """A series' key and its level keys, as the write's KEYS list them."""
    return series_key(job_id, rank, series), *(level_key(job_id, rank, series, k) for k in range(1, len(LEVELS) + 1))


def custom_series_key(job_id: str) -> str:
    return f"{_prefix(job_id)}:series"


def ranks_key(job_id: str) -> str:
    return f"{_prefix(job_id)}:ranks"


# KEYS: att, custom-series set, ranks set, then per series its key and its 5 level keys.
# ARGV: step, attempt+1, rank, count, names…, values…
_WRITE = """
local FAN, NLEV, ESZ = 8, 5, 18
local NAN = struct.pack('<f', 0/0)
local step = tonumber(ARGV[1])
local cur = redis.call('GETRANGE', KEYS[1], step * 2, step * 2 + 1)
if #cur == 2 and struct.unpack('<I2', cur) > tonumber(ARGV[2]) then return 0 end
redis.call('SETRANGE', KEYS[1], step * 2, struct.pack('<I2', tonumber(ARGV[2])))
redis.call('SADD', KEYS[3], ARGV[3])

local function pack(lo, hi, sum, cnt, alo, ahi)
  if cnt == 0 then return struct.pack('<fffI2I2I2', 0/0, 0/0, 0/0, 0, 0, 0) end
  return struct.pack('<fffI2I2I2', lo, hi, sum / cnt, cnt, alo, ahi)
end

-- level 1: the FAN steps of the block, from the fence and the values
local function from_steps(vkey, block)
  local first = block * FAN
  local att = redis.call('GETRANGE', KEYS[1], first * 2, first * 2 + FAN * 2 - 1)
  local val = redis.call('GETRANGE', vkey, first * 4, first * 4 + FAN * 4 - 1)
  local n = math.min(math.floor(#att / 2), math.floor(#val / 4))
  local lo, hi, sum, cnt, alo, ahi = 0, 0, 0, 0, 0, 0
  for j = 0, n - 1 do
    if struct.unpack('<I2', att, j * 2 + 1) > 0 then
      local v = struct.unpack('<f', val, j * 4 + 1)
      if v == v then
        if cnt == 0 or v < lo then lo = v; alo = j end
        if cnt == 0 or v > hi then hi = v; ahi = j end
        sum = sum + v; cnt = cnt + 1
      end
    end
  end
  return pack(lo, hi, sum, cnt, alo, ahi)
end

-- level k > 1: the FAN entries of level k - 1 under the block (each `size` steps)
local function from_entries(lkey, block, size)
  local raw = redis.call('GETRANGE', lkey, block * FAN * ESZ, (block + 1) * FAN * ESZ - 1)
  local lo, hi, sum, cnt, alo, ahi = 0, 0, 0, 0, 0, 0
  for j = 0, math.floor(#raw / ESZ) - 1 do
    local elo, ehi, emean, ecnt, ealo, eahi = struct.unpack('<fffI2I2I2', raw, j * ESZ + 1)
    if ecnt > 0 then
      if cnt == 0 or elo < lo then lo = elo; alo = j * size + ealo end
      if cnt == 0 or ehi > hi then hi = ehi; ahi = j * size + eahi end
      sum = sum + emean * ecnt; cnt = cnt + ecnt
    end
  end
  return pack(lo, hi, sum, cnt, alo, ahi)
end

local n = tonumber(ARGV[4])
for i = 1, n do
  local base = 3 + (i - 1) * (NLEV + 1)
  local vkey = KEYS[base + 1]
  local len = redis.call('STRLEN', vkey)
  if len < step * 4 then  -- steps this series skipped read as absent (NaN), not as zeros
    redis.call('SETRANGE', vkey, len, string.rep(NAN, (step * 4 - len) / 4))
  end
  redis.call('SETRANGE', vkey, step * 4, ARGV[4 + n + i])
  local block = math.floor(step / FAN)
  redis.call('SETRANGE', KEYS[base + 2], block * ESZ, from_steps(vkey, block))
  local size = FAN
  for k = 2, NLEV do
    block = math.floor(block / FAN)
    redis.call('SETRANGE', KEYS[base + 1 + k], block * ESZ, from_entries(KEYS[base + k], block, size))
    size = size * FAN
  end
  local name = ARGV[4 + i]
  if string.sub(name, 1, 1) == '+' then redis.call('SADD', KEYS[2], string.sub(name, 2)) end
end
return 1
"""


def step_values(m: StepMetrics) -> dict[str, float | None]:
    """The series one StepMetrics carries: every one on rank 0, the timing series on the others."""
    names = BUILTIN if m.rank == 0 else TIMING
    out: dict[str, float | None] = {name: getattr(m, _FIELDS[name]) for name in names}
    if m.rank == 0:
        for name, value in m.metrics.items():
            if name not in out and SERIES_NAME.match(name):
                out[name] = value
    return out


def pack(value: float | None) -> bytes:
    return NAN if value is None else struct.pack("<f", value)


@dataclass(frozen=True)
class Window:
    first: int
    last: int


@dataclass
class SeriesData:
    steps: list[int]
    values: list[float | None]
    total_points: int
    minimum: list[float | None] | None = None
    maximum: list[float | None] | None = None


def window(length: int, from_step: int | None, to_step: int | None) -> Window | None:
    """The step window a request asks for within ``length`` stored steps (None: nothing stored there)."""
    first = max(from_step or 0, 0)
    last = min(to_step if to_step is not None else length - 1, length - 1)
    return Window(first, last) if first <= last else None


def decode(att: bytes, raw: bytes, first: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) present in a GETRANGE of the fence and of a series starting at step ``first``."""
    n = min(len(att) // 2, len(raw) // 4)
    fence = np.frombuffer(att[: n * 2], dtype="<u2")
    values = np.frombuffer(raw[: n * 4], dtype="<f4").astype(np.float64)
    present = (fence > 0) & ~np.isnan(values)
    steps = np.nonzero(present)[0].astype(np.int64) + first
    return steps, values[present]


@dataclass(frozen=True)
class Blocks:
    """Entries of one level as columns (only those holding a point): the first step of each block, its
    extremes with their steps, its mean and how many steps it stands for."""

    starts: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    mean: np.ndarray
    count: np.ndarray
    argmin: np.ndarray
    argmax: np.ndarray

    @classmethod
    def empty(cls) -> Blocks:
        e, i = np.empty(0), np.empty(0, np.int64)
        return cls(i, e, e, e, i, i, i)

    @classmethod
    def of(cls, entries: np.ndarray, starts: np.ndarray) -> Blocks:
        count = entries["count"].astype(np.int64)
        full = count > 0
        starts = starts[full]
        return cls(starts, entries["lo"][full].astype(np.float64), entries["hi"][full].astype(np.float64),
                   entries["mean"][full].astype(np.float64), count[full],
                   starts + entries["argmin"][full], starts + entries["argmax"][full])


@dataclass
class Part:
    """What a read found of one series in a window: points at full resolution (the window's partial
    blocks at its ends, or all of it) and the whole blocks of one level in between."""

    steps: np.ndarray
    values: np.ndarray
    blocks: Blocks

    @classmethod
    def of_points(cls, steps: np.ndarray, values: np.ndarray) -> Part:
        return cls(steps, values, Blocks.empty())

    @property
    def total(self) -> int:
        """How many stored points the window holds."""
        return len(self.steps) + int(self.blocks.count.sum())

    @property
    def dense(self) -> bool:
        """Whether some block stands for more than the two points a curve takes from it."""
        return bool((self.blocks.count > 2).any())

    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """The points a curve is drawn from: every full-resolution point, each block's minimum and maximum
        (real points at their steps), in step order."""
        b = self.blocks
        steps = np.concatenate([self.steps, b.argmin, b.argmax])
        values = np.concatenate([self.values, b.lo, b.hi])
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
        keep = np.concatenate([[True], np.diff(steps) > 0]) if len(steps) else np.empty(0, bool)
        return steps[keep], values[keep]

    def entries(self) -> tuple[np.ndarray, ...]:
        """(steps, means, counts, lows, highs): full-resolution points count once, blocks by their count."""
        b = self.blocks
        return (np.concatenate([self.steps, b.starts]), np.concatenate([self.values, b.mean]),
                np.concatenate([np.ones(len(self.steps)), b.count.astype(np.float64)]),
                np.concatenate([self.values, b.lo]), np.concatenate([self.values, b.hi]))


def level_for(span: int, points: int) -> int:
    """The coarsest level (0: full resolution) with at least two blocks per point asked for in ``span`` steps."""
    level = 0
    for k, size in enumerate(LEVELS, start=1):
        if span // size >= 2 * points:
            level = k
    return level


@dataclass(frozen=True)
class ReadPlan:
    """A window read at ``level``: whole blocks ``[first_block, end_block)`` of it, the rest at full resolution."""

    level: int
    head: Window | None
    first_block: int
    end_block: int
    tail: Window | None

    @classmethod
    def of(cls, w: Window, level: int) -> ReadPlan:
        if level == 0:
            return cls(0, w, 0, 0, None)
        size = LEVELS[level - 1]
        # the blocks holding the window's first and last step are read at full resolution, so the answer
        # begins and ends with the window's real first and last points, wherever the window's edges fall
        first_block, end_block = w.first // size + 1, w.last // size
        if first_block >= end_block:
            return cls(0, w, 0, 0, None)
        return cls(level, Window(w.first, first_block * size - 1), first_block, end_block,
                   Window(end_block * size, w.last))

    @property
    def size(self) -> int:
        return LEVELS[self.level - 1] if self.level else 1


def decode_blocks(raw: bytes, first_block: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(entries, their first steps) of a GETRANGE of a level key from block ``first_block``."""
    blocks = np.frombuffer(raw[: len(raw) // ENTRY.itemsize * ENTRY.itemsize], dtype=ENTRY)
    return blocks, (np.arange(len(blocks), dtype=np.int64) + first_block) * size


def levels_of(fence: np.ndarray, values: np.ndarray) -> list[bytes]:
    """Every level of a series as the ingest script leaves it (``fence``: uint16 per step, ``values``:
    float32 per step): for tools that write a whole history at once, and to check the script."""
    present = (fence > 0) & ~np.isnan(values)
    out: list[bytes] = []
    lo = np.where(present, values, np.nan).astype(np.float64)
    hi, mean, count = lo.copy(), lo.copy(), present.astype(np.int64)
    argmin = np.zeros(len(values), np.int64)
    argmax = np.zeros(len(values), np.int64)
    size = 1
    for _ in LEVELS:
        n = -(-len(count) // FANOUT)
        pad = n * FANOUT - len(count)

        def grid(a: np.ndarray, fill: float) -> np.ndarray:
            return np.concatenate([a, np.full(pad, fill, dtype=a.dtype)]).reshape(n, FANOUT)  # noqa: B023 - called in this iteration only

        glo, ghi, gmean, gcount = grid(lo, np.nan), grid(hi, np.nan), grid(mean, np.nan), grid(count, 0)
        offsets = np.arange(FANOUT) * size
        full = gcount > 0
        jlo = np.where(full, glo, np.inf).argmin(axis=1)
        jhi = np.where(full, ghi, -np.inf).argmax(axis=1)
        rows = np.arange(n)
        new_count = gcount.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            new_mean = np.where(new_count > 0, np.where(full, gmean * gcount, 0).sum(axis=1) / new_count, np.nan)
        new_lo = np.where(new_count > 0, glo[rows, jlo], np.nan)
        new_hi = np.where(new_count > 0, ghi[rows, jhi], np.nan)
        new_argmin = np.where(new_count > 0, offsets[jlo] + grid(argmin, 0)[rows, jlo], 0)
        new_argmax = np.where(new_count > 0, offsets[jhi] + grid(argmax, 0)[rows, jhi], 0)
        entries = np.zeros(n, ENTRY)
        entries["lo"], entries["hi"], entries["mean"] = new_lo, new_hi, new_mean
        entries["count"], entries["argmin"], entries["argmax"] = new_count, new_argmin, new_argmax
        out.append(entries.tobytes())
        # the next level combines this one's float32 entries, as the script does
        lo, hi, mean = (entries[f].astype(np.float64) for f in ("lo", "hi", "mean"))
        count, argmin, argmax = new_count, new_argmin, new_argmax
        size *= FANOUT
    return out


def _json_floats(values: np.ndarray) -> list[float | None]:
    if not np.isnan(values).any():
        return values.tolist()
    return [None if v != v else v for v in values.tolist()]


def curve(steps: np.ndarray, values: np.ndarray, max_points: int, method: str,
          total: int | None = None) -> SeriesData:
    """A series as the answer gives it: down-sampled by ``method`` to at most ``max_points``."""
    if method == "minmax":
        s, v = minmax(steps, values, max_points)
    else:
        s, v = lttb(steps, values, max_points)
    return SeriesData(steps=s.tolist(), values=np.asarray(v, dtype=np.float64).tolist(),
                      total_points=len(steps) if total is None else total)


def heat(buckets: Buckets, part: Part) -> SeriesData:
    steps, means, counts, lows, highs = part.entries()
    mean, lo, hi = bucket_stats(buckets, steps, means, counts=counts, lows=lows, highs=highs)
    return SeriesData(steps=buckets.starts.tolist(), values=_json_floats(mean), total_points=part.total,
                      minimum=_json_floats(lo), maximum=_json_floats(hi))


def parse_series(raw: str, custom: Sequence[str], *, by_rank: bool) -> list[str]:
    """The requested series names; SpecError naming ``query.series`` for one the job does not have."""
    names = [s.strip() for s in raw.split(",") if s.strip()]
    if not names:
        raise SpecError("query.series", "name at least one series, e.g. series=loss,lr")
    known = set(BUILTIN) | set(custom)
    if unknown := [n for n in names if n not in known]:
        raise SpecError("query.series", f"unknown series {', '.join(unknown)}; this job has "
                                        f"{', '.join(sorted(known))}")
    return list(dict.fromkeys(names))


class MetricHistory:
    """Writes StepMetrics into the history and reads windows of it back."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        # the float32 and uint16 strings are bytes: read them over a client that does not decode UTF-8
        self.raw = undecoded(redis)  # a Sentinel client's copy follows failovers too
        self._write = redis.register_script(_WRITE)

    async def aclose(self) -> None:
        await self.raw.aclose()

    async def on_step_metrics(self, m: StepMetrics) -> bool:
        """Bus handler (trainyard.metrics); False when a newer attempt already wrote the step."""
        if m.step < 0 or m.step > MAX_STEP:
            return False
        keys, args = self._write_args(m)
        return bool(await self._write(keys=keys, args=args))

    async def stage(self, pipe: Any, m: StepMetrics) -> None:
        """:meth:`on_step_metrics`'s write, staged in the caller's pipeline (a batch in one round trip)."""
        if 0 <= m.step <= MAX_STEP:
            keys, args = self._write_args(m)
            await self._write(keys=keys, args=args, client=pipe)

    @staticmethod
    def _write_args(m: StepMetrics) -> tuple[list[str], list[Any]]:
        values = step_values(m)
        names = [("+" if n not in BUILTIN else "") + n for n in values]
        keys = list(_rank_keys(m.job_id, m.rank))
        for n in values:
            keys += _series_keys(m.job_id, m.rank, n)
        args: list[Any] = [m.step, m.attempt + 1, m.rank, len(values), *names, *(pack(v) for v in values.values())]
        return keys, args

    async def custom_series(self, job_id: str) -> list[str]:
        return sorted(await self.redis.smembers(custom_series_key(job_id)))  # type: ignore[arg-type]  # decoded: str

    async def ranks(self, job_id: str) -> list[int]:
        return sorted(int(r) for r in await self.redis.smembers(ranks_key(job_id)))

    async def _length(self, job_id: str, rank: int) -> int:
        return await self.redis.strlen(attempt_key(job_id, rank)) // 2

    async def _read(self, job_id: str, rank: int, names: Sequence[str], plan: ReadPlan) -> dict[str, Part]:
        """Each series of ``names`` in the plan's window: one pipelined round trip."""
        ends = [w for w in (plan.head, plan.tail) if w is not None]
        async with self.raw.pipeline(transaction=False) as pipe:
            for w in ends:
                pipe.getrange(attempt_key(job_id, rank), w.first * 2, w.last * 2 + 1)
                for n in names:
                    pipe.getrange(series_key(job_id, rank, n), w.first * 4, w.last * 4 + 3)
            if plan.level:
                for n in names:
                    pipe.getrange(level_key(job_id, rank, n, plan.level), plan.first_block * ENTRY.itemsize,
                                  plan.end_block * ENTRY.itemsize - 1)
            raw = iter(await pipe.execute())
        points: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {n: [] for n in names}
        for w in ends:
            att = next(raw)
            for n in names:
                points[n].append(decode(att, next(raw), w.first))
        out: dict[str, Part] = {}
        for n in names:
            steps = np.concatenate([p[0] for p in points[n]]) if points[n] else np.empty(0, np.int64)
            values = np.concatenate([p[1] for p in points[n]]) if points[n] else np.empty(0)
            part = Part.of_points(steps, values)
            if plan.level:
                part.blocks = Blocks.of(*decode_blocks(next(raw), plan.first_block, plan.size))
            out[n] = part
        return out

    async def fence(self, job_id: str, first: int) -> np.ndarray:
        """Rank 0's fence from step ``first`` to the end of its history: attempt + 1 per step, 0 where none."""
        raw: bytes = await self.raw.getrange(attempt_key(job_id, 0), first * 2, -1)  # type: ignore[assignment]  # undecoded client
        return np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<u2")

    async def points(self, job_id: str, names: Sequence[str], first: int,
                     last: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rank 0's stored (steps, values) of each series in steps ``first..last``, at full resolution."""
        parts = await self._read(job_id, 0, names, ReadPlan.of(Window(first, last), 0))
        return {n: (p.steps, p.values) for n, p in parts.items()}

    async def query(self, job_id: str, names: Sequence[str], *, from_step: int | None, to_step: int | None,
                    max_points: int, method: str, by_rank: bool) -> dict[str, object]:
        """The answer of ``GET /v1/training-jobs/{id}/metrics`` (the job's tenant checked by the caller)."""
        w = window(await self._length(job_id, 0), from_step, to_step)
        parts = await self._curves(job_id, names, w, max_points)
        answer: dict[str, object] = {
            "jobId": job_id, "fromStep": w.first if w else from_step, "toStep": w.last if w else to_step,
            "method": "all" if all(p.total <= max_points for p in parts.values()) else method,
            "series": {n: curve(*p.candidates(), max_points, method, total=p.total) for n, p in parts.items()},
        }
        if by_rank:
            timing = [n for n in names if n in TIMING] or list(TIMING)
            answer["ranks"] = await self._by_rank(job_id, timing, from_step, to_step, max_points)
        return answer

    async def _curves(self, job_id: str, names: Sequence[str], w: Window | None, max_points: int) -> dict[str, Part]:
        """Rank 0's series over ``w``, read at the level that suits ``max_points``; a series that fits in
        ``max_points`` although some block holds more than its two extremes is read again in full."""
        if w is None:
            return {n: Part.of_points(np.empty(0, np.int64), np.empty(0)) for n in names}
        plan = ReadPlan.of(w, level_for(w.last - w.first + 1, max_points))
        parts = await self._read(job_id, 0, names, plan)
        if sparse := [n for n, p in parts.items() if p.total <= max_points and p.dense]:
            parts |= await self._read(job_id, 0, sparse, ReadPlan.of(w, 0))
        return parts

    async def _by_rank(self, job_id: str, names: Sequence[str], from_step: int | None, to_step: int | None,
                       max_points: int) -> dict[str, dict[str, SeriesData]]:
        ranks = await self.ranks(job_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in ranks:
                pipe.strlen(attempt_key(job_id, r))
            lengths = await pipe.execute()
        windows = {r: window(n // 2, from_step, to_step) for r, n in zip(ranks, lengths, strict=True)}
        present = [w for w in windows.values() if w is not None]
        if not present:
            return {str(r): {} for r in ranks}
        first, last = min(w.first for w in present), max(w.last for w in present)
        level = level_for(last - first + 1, max_points)
        buckets = Buckets.over(first, last, max_points, align=LEVELS[level - 1] if level else 1)
        nothing = {n: Part.of_points(np.empty(0, np.int64), np.empty(0)) for n in names}

        async def rank(r: int, w: Window | None) -> dict[str, SeriesData]:
            parts = await self._read(job_id, r, names, ReadPlan.of(w, level)) if w else nothing
            return {n: heat(buckets, p) for n, p in parts.items()}

        rows = await asyncio.gather(*(rank(r, w) for r, w in windows.items()))
        return {str(r): row for r, row in zip(windows, rows, strict=True)}

    async def delete(self, job_id: str) -> None:
        """Forget the job's history (every rank)."""
        ranks = await self.ranks(job_id)
        names = list(BUILTIN) + await self.custom_series(job_id)
        keys = [custom_series_key(job_id), ranks_key(job_id)]
        for r in ranks:
            keys += [attempt_key(job_id, r)] + [series_key(job_id, r, n) for n in names]
            keys += [level_key(job_id, r, n, k) for n in names for k in range(1, len(LEVELS) + 1)]
        await self.redis.delete(*keys)
