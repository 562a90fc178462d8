"""Down-sampling of step series: point counts, extremes kept, windows, heat-map buckets."""

from __future__ import annotations

import numpy as np
import pytest

from trainyard_telemetry.downsample import Buckets, bucket_stats, lttb, minmax
from trainyard_telemetry.metrics_history import curve, decode, parse_series, window
from trainyard_contract.errors import SpecError


def series(n: int) -> tuple[np.ndarray, np.ndarray]:
    steps = np.arange(1, n + 1, dtype=np.int64)
    return steps, np.cos(steps / 5000.0) + 0.01 * np.sin(steps / 7.0)


@pytest.mark.parametrize("n,max_points", [(10, 2000), (5000, 2000), (100_000, 2000), (1_000_000, 2000), (50, 3)])
def test_lttb_bounds_the_answer_and_keeps_the_ends(n: int, max_points: int) -> None:
    steps, values = series(n)
    s, v = lttb(steps, values, max_points)
    assert len(s) == min(n, max_points)
    assert s[0] == steps[0] and s[-1] == steps[-1]
    assert np.all(np.diff(s) > 0)
    np.testing.assert_array_equal(v, values[s - 1])


@pytest.mark.parametrize("n", [10_000, 1_000_000])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_lttb_keeps_the_extreme_a_spike_makes(n: int, sign: float) -> None:
    steps, values = series(n)
    values = values.copy()
    at = n // 3 + 17
    values[at] = sign * 50.0
    s, v = lttb(steps, values, 2000)
    assert steps[at] in s
    assert (v.max() if sign > 0 else v.min()) == sign * 50.0


def test_minmax_keeps_both_extremes_of_each_bucket() -> None:
    steps, values = series(100_000)
    values = values.copy()
    values[123], values[99_000] = 9.0, -9.0
    s, v = minmax(steps, values, 2000)
    assert len(s) <= 2000 and 9.0 in v and -9.0 in v


def test_windows_clip_to_what_is_stored() -> None:
    assert window(100, None, None) == window(100, 0, 99)
    assert window(100, 10, 1000).last == 99
    assert window(100, 200, None) is None
    assert window(0, None, None) is None


def test_decode_skips_steps_never_written_and_nan() -> None:
    att = np.array([0, 1, 2, 0, 1], dtype="<u2").tobytes()
    raw = np.array([0, 1.5, 2.5, 0, np.nan], dtype="<f4").tobytes()
    steps, values = decode(att, raw, 10)
    assert steps.tolist() == [11, 12] and values.tolist() == [1.5, 2.5]


def test_buckets_are_shared_and_give_mean_min_max() -> None:
    b = Buckets.over(1, 100, 10)
    assert b.starts.tolist() == list(range(1, 101, 10))
    steps = np.arange(1, 101, dtype=np.int64)
    mean, lo, hi = bucket_stats(b, steps, steps.astype(float))
    assert mean[0] == 5.5 and lo[0] == 1 and hi[0] == 10
    mean2, _, _ = bucket_stats(b, steps[:50], steps[:50].astype(float))  # a rank with half the steps
    assert len(mean2) == len(mean) and np.isnan(mean2[-1])


def test_unknown_series_is_named() -> None:
    assert parse_series("loss, lr,loss", [], by_rank=False) == ["loss", "lr"]
    assert parse_series("gradNorm", ["gradNorm"], by_rank=False) == ["gradNorm"]
    with pytest.raises(SpecError) as err:
        parse_series("loss,nope", [], by_rank=False)
    assert err.value.field == "query.series" and "nope" in err.value.detail


def test_bucket_stats_agree_with_a_plain_loop_on_ragged_input() -> None:
    rng = np.random.default_rng(5)
    steps = np.sort(rng.choice(np.arange(10, 1_000), size=300, replace=False)).astype(np.int64)
    values = rng.normal(0, 1, len(steps))
    counts = rng.integers(1, 9, len(steps)).astype(np.float64)
    shuffled = rng.permutation(len(steps))  # input order does not matter
    b = Buckets.over(0, 1_499, 40)  # empty buckets at both ends and a trailing run past the data
    mean, lo, hi = bucket_stats(b, steps[shuffled], values[shuffled], counts=counts[shuffled])
    for i, (start, end) in enumerate(zip(b.edges[:-1], b.edges[1:])):
        inside = (steps >= start) & (steps < end)
        if not inside.any():
            assert np.isnan(mean[i]) and np.isnan(lo[i]) and np.isnan(hi[i])
            continue
        assert mean[i] == pytest.approx(np.average(values[inside], weights=counts[inside]))
        assert (lo[i], hi[i]) == (values[inside].min(), values[inside].max())


SMALL = [2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("method", ["lttb", "minmax"])
@pytest.mark.parametrize("max_points", SMALL)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 17, 100, 10_000])
def test_every_method_answers_any_small_max_points_with_real_points_in_step_order(
    method: str, max_points: int, n: int,
) -> None:
    """``maxPoints`` down to the API's least (2) over windows shorter and longer than it: min/max with fewer
    than four points was a panic inside tsdownsample, a 500 from GET …/metrics?method=minmax&maxPoints=2."""
    steps, values = series(n)
    values = values.copy()
    values[n // 3], values[(2 * n) // 3] = 7.0, -7.0  # the window's extremes (one point when n == 1)
    answer = curve(steps, values, max_points, method)
    s = np.asarray(answer.steps)
    assert len(s) == min(n, max_points) if method == "lttb" else 0 < len(s) <= max_points
    assert np.all(np.diff(s) > 0) and answer.total_points == n
    np.testing.assert_array_equal(answer.values, values[s - 1])  # real points at their real steps
    if method == "lttb":
        assert s[0] == steps[0] and s[-1] == steps[-1]
    else:
        assert max(answer.values) == values.max() and min(answer.values) == values.min()


def test_minmax_needs_room_for_a_range_s_two_extremes() -> None:
    with pytest.raises(ValueError, match="max_points 1 < 2"):
        minmax(*series(10), 1)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_heat_map_buckets_for_small_max_points(count: int) -> None:
    b = Buckets.over(1, 50, count)
    steps = np.arange(1, 51, dtype=np.int64)
    mean, lo, hi = bucket_stats(b, steps, steps.astype(float))
    assert len(b.starts) == count and b.starts[0] == 1 and b.edges[-1] == 51
    assert lo[0] == 1 and hi[-1] == 50 and not np.isnan(mean).any()
