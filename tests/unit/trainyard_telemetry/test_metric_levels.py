"""The metric history's coarser levels, as pure functions: the whole-history builder against a plain
per-block computation, the level a read picks, the read plan's full-resolution ends, aligned buckets."""

from __future__ import annotations

import numpy as np
import pytest

from trainyard_telemetry.downsample import Buckets
from trainyard_telemetry.metrics_history import (ENTRY, LEVELS, Blocks, Part, ReadPlan, Window, decode_blocks,
                                                 level_for, levels_of)


def history(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    fence = np.where(rng.random(n) < 0.05, 0, 1 + (np.arange(n) > n // 2)).astype("<u2")  # gaps, two attempts
    values = rng.normal(0, 1, n).astype("<f4")
    values[rng.random(n) < 0.03] = np.nan  # steps that did not carry the series
    return fence, values


@pytest.mark.parametrize("n", [1, 7, 8, 9, 4_097, 40_000])
def test_each_level_holds_each_blocks_extremes_mean_and_count(n: int) -> None:
    fence, values = history(n)
    present = (fence > 0) & ~np.isnan(values)
    for k, raw in enumerate(levels_of(fence, values), start=1):
        size = LEVELS[k - 1]
        blocks, starts = decode_blocks(raw, 0, size)
        assert len(blocks) == -(-n // size)
        for b in range(len(blocks)):
            sl = slice(b * size, (b + 1) * size)
            v, p = values[sl].astype(np.float64), present[sl]
            assert blocks["count"][b] == p.sum()
            if p.sum() == 0:
                assert np.isnan(blocks["lo"][b]) and np.isnan(blocks["hi"][b])
                continue
            lo, hi = v[p].min(), v[p].max()
            assert blocks["lo"][b] == np.float32(lo) and blocks["hi"][b] == np.float32(hi)
            assert v[blocks["argmin"][b]] == lo and v[blocks["argmax"][b]] == hi
            assert p[blocks["argmin"][b]] and p[blocks["argmax"][b]]
            assert blocks["mean"][b] == pytest.approx(v[p].mean(), rel=1e-5, abs=1e-6)
        assert starts.tolist() == [b * size for b in range(len(blocks))]


def test_a_read_takes_the_coarsest_level_with_two_blocks_per_point() -> None:
    assert level_for(10_000, 2000) == 0  # a zoom: full resolution
    assert level_for(1_000_000, 2000) == 2  # 64-step blocks: 15,625 of them for 2,000 points
    assert level_for(50_000_000, 2000) == 4
    for span, points in [(1_000_000, 2000), (123_457, 300), (50_000_000, 500)]:
        k = level_for(span, points)
        assert span // LEVELS[k - 1] >= 2 * points
        assert k == len(LEVELS) or span // LEVELS[k] < 2 * points


@pytest.mark.parametrize("first,last", [(0, 999_999), (5, 1_000_000), (64, 127_999), (1_001, 4_444)])
def test_a_plan_covers_the_window_once_with_its_end_blocks_at_full_resolution(first: int, last: int) -> None:
    plan = ReadPlan.of(Window(first, last), 2)
    size = plan.size
    assert plan.head.first == first and plan.tail.last == last
    assert plan.head.last + 1 == plan.first_block * size and plan.end_block * size == plan.tail.first
    assert plan.head.last - plan.head.first + 1 >= 1 and plan.tail.last - plan.tail.first + 1 >= 1
    assert plan.head.first // size == plan.head.last // size  # the head is (part of) one block
    assert plan.tail.first // size == plan.tail.last // size
    assert ReadPlan.of(Window(10, 70), 2).level == 0  # no whole block between the ends: full resolution


def test_a_blocks_candidates_are_its_real_extremes_at_their_steps() -> None:
    fence, values = history(4_096, seed=1)
    values[1_234] = 99.0
    blocks, starts = decode_blocks(levels_of(fence, values)[1], 0, 64)
    part = Part(np.empty(0, np.int64), np.empty(0), Blocks.of(blocks, starts))
    steps, got = part.candidates()
    assert np.all(np.diff(steps) > 0) and 1_234 in steps.tolist()
    np.testing.assert_array_equal(got, values[steps].astype(np.float64))
    assert part.total == int(((fence > 0) & ~np.isnan(values)).sum())


def test_aligned_buckets_put_each_block_in_one_bucket() -> None:
    b = Buckets.over(3, 999_999, 2000, align=64)
    assert b.edges[0] == 3 and b.edges[-1] == 1_000_000
    assert all(e % 64 == 0 for e in b.edges[1:-1]) and np.all(np.diff(b.edges) > 0)
    assert len(b.starts) <= 2000


def test_an_entry_is_eighteen_packed_bytes() -> None:
    assert ENTRY.itemsize == 18
