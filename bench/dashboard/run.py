"""What the dashboard's reads cost on a real redis-server: a 1,000,000-step metric history and a 10,000-job list.

    python bench/dashboard/run.py [--steps 1000000] [--jobs 10000] [--repeat 50] [--json results.json]

A benchmark, not a test: it prints p50 / p99 and the ratio to a baseline measured in the same run, and never
fails on them. Goals (issue #17): metrics endpoint on a 1M-step history with maxPoints=2000 p99 <= 50 ms; the
first page of a 10,000-job list p99 <= 100 ms.

* **metrics**: ``MetricHistory.query`` (what ``GET /v1/training-jobs/{id}/metrics`` runs after the tenant check:
  the pipelined GETRANGEs, decoding, LTTB / bucket means) plus the response model's validation and JSON, for
  the four curves of the whole run, a zoomed window, and the per-rank heat map of 2 ranks (at 2,000 buckets, and
  at the 60 the job page asks for; each also answers rank 0's five timing curves), read from the
  history's coarser levels where the window is long (``metrics_history.level_for``). Baseline: one
  pipelined plain GET of the same raw bytes (the least any reader of this history must do).
* **ingest**: what one rank-0 StepMetrics costs the API's consumer (the Lua script: fence, 9 series, their
  5 levels). Baseline: a pipelined SETRANGE of the same 9 values (no fence, no levels). No goal; for the record.
* **job list**: the first page (50) of ``GET /v1/training-jobs`` as ``JobService.list`` reads it — the tenant's
  index, the job records and their progress in one MGET each, each row built by ``views.job_summary`` and the
  page serialised. Baseline: the same ZREVRANGE + MGETs without parsing.

The HTTP framing and the token lookup (one Redis GET) come on top; both are well under a millisecond locally.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import struct
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

from trainyard_telemetry.metrics_history import (
    CURVES, TIMING, MetricHistory, attempt_key, level_key, levels_of, ranks_key, series_key,
)
from trainyard_api.routes.dashboard import MetricHistoryView, _plain
from trainyard_contract.events import StepMetrics
from trainyard_api.schemas import EXAMPLE_SPEC, JobPage
from trainyard_api.views import job_summary
from trainyard_cli.infra import start_redis
from trainyard_contract.records import JobRecord, Progress
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys

JOB = "job-bench00000001"
HEAT_BUCKETS = 60  # what the job page asks for (ui/job.js)
TENANT = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def timed(fn: Any, repeat: int) -> list[float]:
    await fn()  # warm
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def write_history(redis: Redis, steps: int) -> None:
    """The history as the ingest Lua leaves it after ``steps`` steps of attempt 1 on 2 ranks."""
    rng = np.random.default_rng(0)
    x = np.arange(steps, dtype=np.float64)
    att = struct.pack("<H", 2) * steps  # attempt 1 (+1) wrote every step
    curves = {"loss": 7 * np.exp(-x / (steps / 5)) + 2 + rng.normal(0, 0.05, steps),
              "lr": 3e-4 * np.minimum(1, x / 2000), "tokensPerSecond": 1e5 + rng.normal(0, 1e3, steps),
              "mfu": 0.45 + rng.normal(0, 0.01, steps)}
    fence = np.frombuffer(att, dtype="<u2")

    async def put(rank: int, name: str, values: np.ndarray) -> None:
        values = values.astype("<f4")
        await redis.set(series_key(JOB, rank, name), values.tobytes())
        for k, level in enumerate(levels_of(fence, values), start=1):  # what the ingest script keeps
            await redis.set(level_key(JOB, rank, name, k), level)

    for rank in (0, 1):
        await redis.set(attempt_key(JOB, rank), att)
        for name in TIMING:
            await put(rank, name, 0.5 + rng.random(steps) * 0.1)
        if rank == 0:
            for name, values in curves.items():
                await put(0, name, values)
    await redis.sadd(ranks_key(JOB), 0, 1)


async def write_jobs(redis: Redis, count: int) -> None:
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for start in range(0, count, 1000):
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(start, min(count, start + 1000)):
                job = JobRecord(job_id=f"job-{i:012x}", tenant=TENANT, spec=spec, spec_hash=spec.spec_hash(),
                                state="running", created_at=t0 + timedelta(seconds=i), updated_at=t0)
                pipe.set(Keys.job(job.job_id), job.dumps())
                pipe.zadd(Keys.tenant_jobs(TENANT), {job.job_id: job.created_at.timestamp()})
                pipe.set(Keys.progress(job.job_id), Progress(attempt=1, global_step=i % 40, max_steps=40,
                                                             tokens_per_second=1e4, step_seconds=0.1).dumps())
            await pipe.execute()


async def bench(args: argparse.Namespace, url: str) -> dict[str, dict[str, float]]:
    redis = Redis.from_url(url, decode_responses=True)
    raw = Redis.from_url(url, decode_responses=False)
    history = MetricHistory(redis)
    print(f"writing a {args.steps:,}-step history (2 ranks) and {args.jobs:,} jobs…", flush=True)
    await write_history(raw, args.steps)
    await write_jobs(redis, args.jobs)

    async def metrics(from_step: int | None = None, to_step: int | None = None, by_rank: bool = False,
                      max_points: int | None = None) -> None:
        names = list(TIMING) if by_rank else list(CURVES)
        answer = await history.query(JOB, names, from_step=from_step, to_step=to_step,
                                     max_points=max_points or args.max_points, method="lttb", by_rank=by_rank)
        MetricHistoryView.model_validate(_plain(answer)).model_dump_json(by_alias=True)

    async def raw_history(names: tuple[str, ...] = CURVES, ranks: tuple[int, ...] = (0,)) -> None:
        async with raw.pipeline(transaction=False) as pipe:
            for rank in ranks:
                pipe.get(attempt_key(JOB, rank))
                for n in names:
                    pipe.get(series_key(JOB, rank, n))
            await pipe.execute()

    async def job_page() -> None:
        ids = await redis.zrevrange(Keys.tenant_jobs(TENANT), 0, 49)
        jobs = await redis.mget([Keys.job(j) for j in ids])
        progress = await redis.mget([Keys.progress(j) for j in ids])
        rows = [job_summary(JobRecord.model_validate_json(j), Progress.model_validate_json(p) if p else None)
                for j, p in zip(jobs, progress, strict=True)]
        JobPage(jobs=rows, next_offset=50).model_dump_json(by_alias=True)

    async def raw_page() -> None:
        ids = await redis.zrevrange(Keys.tenant_jobs(TENANT), 0, 49)
        await redis.mget([Keys.job(j) for j in ids])
        await redis.mget([Keys.progress(j) for j in ids])

    ingest_step = iter(range(10**9))

    async def ingest() -> None:  # one rank-0 StepMetrics of a fresh job: 9 series, each with its 5 levels
        await history.on_step_metrics(StepMetrics(
            job_id="job-ingest", tenant=TENANT, attempt=1, rank=0, step=next(ingest_step), loss=2.5, lr=3e-4,
            consumed_tokens=0, tokens_per_second=1e5, mfu=0.4, step_seconds=0.5, compute_seconds=0.3,
            collective_seconds=0.1, data_wait_seconds=0.01, checkpoint_seconds=0.0))

    base_step = iter(range(10**9))

    async def raw_ingest() -> None:  # the same bytes, one SETRANGE each, no fence and no levels
        s = next(base_step)
        async with raw.pipeline(transaction=False) as pipe:
            for name in CURVES + TIMING:
                pipe.setrange(series_key("job-raw", 0, name), s * 4, struct.pack("<f", 0.5))
            await pipe.execute()

    mid = args.steps // 2
    cases = [
        ("metrics: 4 curves, whole run", lambda: metrics(), lambda: raw_history(), 50),
        ("metrics: zoom to 10,000 steps", lambda: metrics(mid, mid + 9_999), lambda: raw_history(), 50),
        ("metrics: heat map, 2 ranks x 5 timings", lambda: metrics(by_rank=True),
         lambda: raw_history(TIMING, (0, 1)), 50),
        (f"metrics: the page's heat map ({HEAT_BUCKETS} buckets)",
         lambda: metrics(by_rank=True, max_points=HEAT_BUCKETS),
         lambda: raw_history(TIMING, (0, 1)), 50),
        ("job list: first page of 50", job_page, raw_page, 100),
        ("ingest: one StepMetrics of rank 0", ingest, raw_ingest, None),
    ]
    results: dict[str, dict[str, float]] = {}
    print(f"{'':42} {'p50 ms':>8} {'p99 ms':>8} {'baseline p50':>13} {'ratio':>7} {'goal p99':>9}")
    for name, fn, base, goal in cases:
        samples = await timed(fn, args.repeat)
        baseline = await timed(base, args.repeat)
        p50, p99, b50 = statistics.median(samples), percentile(samples, 0.99), statistics.median(baseline)
        results[name] = {"p50Ms": p50, "p99Ms": p99, "baselineP50Ms": b50, "ratio": p50 / b50, "goalP99Ms": goal}
        print(f"{name:42} {p50:8.2f} {p99:8.2f} {b50:13.2f} {p50 / b50:7.2f} "
              f"{('<= ' + str(goal)) if goal else '—':>9}{'' if goal is None or p99 <= goal else '  (over the goal)'}")
    await history.aclose()
    await redis.aclose()
    await raw.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps in the metric history")
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs of the tenant")
    parser.add_argument("--max-points", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=50, help="timed requests per case")
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        server = start_redis(free_port(), Path(tmp) / "redis", Path(tmp) / "redis.log")
        try:
            results = asyncio.run(bench(args, server.address))
        finally:
            server.stop()
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
