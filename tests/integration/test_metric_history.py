"""The metric history's coarser levels on a real redis-server: what the ingest script leaves at every level
is what the whole-history builder computes from the stored steps (through replays and late events), and a
read at a coarse level keeps the extremes and gives the exact bucket means a full-resolution read gives."""

from __future__ import annotations

import numpy as np
import pytest

from trainyard_telemetry.downsample import Buckets, bucket_stats
from trainyard_telemetry.metrics_history import (
    ENTRY, LEVELS, MetricHistory, Part, ReadPlan, Window, attempt_key, decode, level_key, level_for, levels_of,
    series_key,
)
from trainyard_contract.events import StepMetrics

pytestmark = pytest.mark.integration
JOB = "job-levels"


def step(attempt: int, s: int, rank: int, loss: float, compute: float, *, grad: bool = True) -> StepMetrics:
    return StepMetrics(job_id=JOB, tenant="t", attempt=attempt, rank=rank, step=s, loss=loss, consumed_tokens=s,
                       step_seconds=1.0, compute_seconds=compute, metrics={"gradNorm": float(s % 7)} if grad else {})


@pytest.fixture
async def history(redis: object) -> MetricHistory:
    h = MetricHistory(redis)  # type: ignore[arg-type]  # the fixture's client
    yield h
    await h.aclose()


async def test_every_level_is_what_the_stored_steps_say_through_replays_and_late_events(
        history: MetricHistory) -> None:
    rng = np.random.default_rng(7)
    steps = 1_300  # past two level-3 blocks (512 steps), with a partial one
    for s in range(steps):
        # the script's own gradNorm is logged on most steps only: the others must read as absent, not as 0
        assert await history.on_step_metrics(step(1, s, 0, float(rng.normal(3.0, 1.0)), float(rng.random()),
                                                  grad=s % 97 not in (5, 6, 7)))
    for s in range(700, 900):  # attempt 2 resumed at 700 and replays: its values replace attempt 1's everywhere
        assert await history.on_step_metrics(step(2, s, 0, float(rng.normal(-5.0, 0.1)), 0.25))
    assert not await history.on_step_metrics(step(1, 750, 0, 1e6, 1e6))  # a late event of attempt 1: ignored
    assert await history.on_step_metrics(step(2, 899, 0, 1234.0, 0.25))  # a spike, redelivered twice
    assert await history.on_step_metrics(step(2, 899, 0, 1234.0, 0.25))

    att = await history.raw.get(attempt_key(JOB, 0))
    grad = np.frombuffer(await history.raw.get(series_key(JOB, 0, "gradNorm")), "<f4")
    assert np.isnan(grad[[5, 6, 7, 102]]).all() and not np.isnan(grad[[4, 8, 101]]).any()
    for name in ("loss", "computeSeconds", "gradNorm"):
        raw = await history.raw.get(series_key(JOB, 0, name))
        n = min(len(att) // 2, len(raw) // 4)
        fence, values = np.frombuffer(att[: n * 2], "<u2"), np.frombuffer(raw[: n * 4], "<f4")
        for k, expected in enumerate(levels_of(fence, values), start=1):
            stored = await history.raw.get(level_key(JOB, 0, name, k))
            got = np.frombuffer(stored, dtype=ENTRY)
            want = np.frombuffer(expected, dtype=got.dtype)
            assert len(got) == len(want) == -(-n // LEVELS[k - 1]), (name, k)
            for field in ("count", "argmin", "argmax"):
                np.testing.assert_array_equal(got[field], want[field], err_msg=f"{name} level {k} {field}")
            for field in ("lo", "hi", "mean"):
                np.testing.assert_allclose(got[field], want[field], rtol=1e-6, equal_nan=True,
                                           err_msg=f"{name} level {k} {field}")
        # and the levels' extremes are the stored steps' extremes
        present = (fence > 0) & ~np.isnan(values)
        top = np.frombuffer(await history.raw.get(level_key(JOB, 0, name, 3)), dtype=ENTRY)
        assert top["count"].sum() == present.sum()
        assert np.nanmax(top["hi"]) == values[present].max() and np.nanmin(top["lo"]) == values[present].min()


async def test_a_coarse_read_keeps_the_extremes_and_gives_the_exact_bucket_means(history: MetricHistory) -> None:
    steps = 5_000
    rng = np.random.default_rng(3)
    loss = rng.normal(2.0, 0.2, steps)
    loss[4_321] = 40.0  # the spike a faithful chart must show
    compute = rng.random(steps)
    for s in range(steps):
        await history.on_step_metrics(step(1, s, 0, float(loss[s]), float(compute[s])))
    points = 30
    level = level_for(steps, points)
    assert level >= 2  # the read below really comes from a coarse level

    answer = await history.query(JOB, ["loss"], from_step=None, to_step=None, max_points=points, method="lttb",
                                 by_rank=True)
    got = answer["series"]["loss"]
    assert len(got.steps) == points and got.total_points == steps and answer["method"] == "lttb"
    assert 4_321 in got.steps and max(got.values) == pytest.approx(40.0)
    assert got.steps[0] == 0 and got.steps[-1] == steps - 1
    stored = np.asarray(loss, dtype=np.float32).astype(np.float64)
    assert all(stored[s] == pytest.approx(v) for s, v in zip(got.steps, got.values))  # real points, real steps

    heat = answer["ranks"]["0"]["computeSeconds"]
    edges = np.asarray(heat.steps + [steps])
    assert all(e % LEVELS[level - 1] == 0 for e in edges[1:-1])  # bucket edges on block boundaries
    c32 = np.asarray(compute, dtype=np.float32).astype(np.float64)
    mean, lo, hi = bucket_stats(Buckets(edges), np.arange(steps), c32)
    np.testing.assert_allclose(heat.values, mean, rtol=1e-5)
    np.testing.assert_allclose(heat.minimum, lo, rtol=1e-6)
    np.testing.assert_allclose(heat.maximum, hi, rtol=1e-6)

    # a zoom whose ends fall inside blocks: the partial blocks are read at full resolution
    w = Window(1_001, 4_444)
    plan = ReadPlan.of(w, level_for(w.last - w.first + 1, 20))
    assert plan.level and plan.head is not None and plan.tail is not None
    part: Part = (await history._read(JOB, 0, ["loss"], plan))["loss"]
    assert part.total == w.last - w.first + 1
    s, v = part.candidates()
    assert s[0] == w.first and s[-1] == w.last and 4_321 in s.tolist()
    full = decode(*(await _full(history, w)), w.first)
    assert set(s.tolist()) <= set(full[0].tolist())


async def _full(history: MetricHistory, w: Window) -> tuple[bytes, bytes]:
    att = await history.raw.getrange(attempt_key(JOB, 0), w.first * 2, w.last * 2 + 1)
    raw = await history.raw.getrange(series_key(JOB, 0, "loss"), w.first * 4, w.last * 4 + 3)
    return att, raw
