"""Checkpoint size, write time, storage, and the Young and Daly intervals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_planner import (
    checkpoint_bytes,
    daly_interval,
    daly_optimal_interval,
    daly_wasted_fraction,
    job_mtbf,
    plan_checkpoint,
    storage_bytes,
    wasted_fraction,
    write_seconds,
    young_interval,
)

TB = 1e12
MINUTE = 60.0
HOUR = 3600.0


def test_seed_1_tb_at_10_gb_per_s_is_100_s() -> None:
    """The seed: with 10 GB/s of checkpoint bandwidth, writing 1 TB stalls about 100 s."""
    assert write_seconds(1 * TB, 10e9) == 100.0


def test_seed_storage_3_tb_per_job_300_tb_for_100_jobs() -> None:
    """The seed: 1 TB checkpoints, keep 3: at least 3 TB hot per job, 300 TB for 100 jobs, staging
    of the one being uploaded not counted."""
    assert storage_bytes(1 * TB, keep_last=3) == 3 * TB
    assert storage_bytes(1 * TB, keep_last=3, jobs=100) == 300 * TB
    assert storage_bytes(1 * TB, keep_last=3, jobs=100, in_flight=1) == 400 * TB


def test_70b_checkpoint_is_about_1_tb() -> None:
    """Weights 2 + master 4 + Adam 8 = 14 bytes/param (no gradients): 70B -> 0.98 TB, the seed's
    "about 1 TB"."""
    assert checkpoint_bytes(70e9) == 0.98 * TB
    assert checkpoint_bytes(70e9, include_gradients=True) == 1.12 * TB


def test_young_interval() -> None:
    """Young 1974: tau = sqrt(2 delta M); 100 s writes and a 5 h MTBF give sqrt(3.6e6) = 1897 s."""
    assert young_interval(100, 5 * HOUR) == pytest.approx(1897.37, abs=0.01)
    assert young_interval(5 * MINUTE, 24 * HOUR) == pytest.approx(120 * MINUTE)


DALY_FIGURES = [
    # Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    # Figures 3-5: delta = 5 min, R = 10 min; the model predicts tau_opt = 117 min at M = 24 h,
    # 57 min at M = 6 h and 9.1 min at M = 15 min (as printed; the exact root is 9.17).
    (24 * HOUR, 117.0, 0.5),
    (6 * HOUR, 57.0, 0.5),
    (15 * MINUTE, 9.1, 0.1),
]


@pytest.mark.parametrize(("mtbf", "published_min", "tolerance_min"), DALY_FIGURES)
def test_daly_2006_published_optima(mtbf: float, published_min: float, tolerance_min: float) -> None:
    """Daly 2006 Figs. 3-5: tau_opt of 117 min (M = 24 h), 57 min (M = 6 h), 9.1 min (M = 15 min)
    for 5-minute dumps."""
    exact = daly_optimal_interval(5 * MINUTE, mtbf) / MINUTE
    assert exact == pytest.approx(published_min, abs=tolerance_min)
    if mtbf >= HOUR:  # the perturbation series is good while delta << M
        assert daly_interval(5 * MINUTE, mtbf) / MINUTE == pytest.approx(published_min, abs=0.5)


def test_daly_interval_caps_at_mtbf() -> None:
    assert daly_interval(10 * HOUR, 2 * HOUR) == 2 * HOUR


def test_wasted_fraction_is_overhead_plus_rework() -> None:
    """Young's first order: delta/tau + tau/(2M) (+ R/M)."""
    assert wasted_fraction(1000, 100, 10_000) == pytest.approx(0.1 + 0.05)
    assert wasted_fraction(1000, 100, 10_000, restart_time=500) == pytest.approx(0.2)


def test_young_interval_minimises_first_order_waste() -> None:
    delta, m = 100.0, 5 * HOUR
    best = young_interval(delta, m)
    assert wasted_fraction(best, delta, m) == pytest.approx((2 * delta / m) ** 0.5, rel=1e-9)
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert wasted_fraction(best * factor, delta, m) > wasted_fraction(best, delta, m)


def test_job_mtbf_shrinks_with_devices() -> None:
    """A 1024-device job whose devices each fail once in 50,000 h fails about every 49 h."""
    assert job_mtbf(50_000 * HOUR, 1024) == pytest.approx(48.83 * HOUR, rel=1e-3)


def test_plan_checkpoint_for_the_seed_example() -> None:
    plan = plan_checkpoint(1 * TB, write_bandwidth=10e9, mtbf_seconds=24 * HOUR, keep_last=3, jobs=100,
                           interval_seconds=30 * MINUTE, step_seconds=6.0)
    assert plan.write_seconds == 100.0
    assert plan.storage_bytes == 300 * TB
    assert plan.interval_steps == 300
    # 30 minutes is shorter than the optimum for a day's MTBF; the optimum wastes less.
    assert plan.daly_optimal_interval_seconds > 30 * MINUTE
    assert plan.recommended_wasted_fraction < plan.daly_wasted_fraction
    assert "writeSeconds" in plan.wire()


@settings(max_examples=80, deadline=None)
@given(st.floats(1, 3600), st.floats(600, 1e7), st.floats(0.2, 5))
def test_daly_optimum_minimises_daly_waste(delta: float, mtbf: float, factor: float) -> None:
    best = daly_optimal_interval(delta, mtbf)
    assert daly_wasted_fraction(best, delta, mtbf) <= daly_wasted_fraction(best * factor, delta, mtbf) + 1e-12


@settings(max_examples=80, deadline=None)
@given(st.floats(1, 600), st.floats(3600, 1e7))
def test_first_order_and_exact_agree_when_writes_are_short(delta: float, mtbf: float) -> None:
    """Young's sqrt(2 delta M) approaches the exact optimum as delta / M -> 0 (Daly 2006 §3)."""
    ratio = young_interval(delta, mtbf) / daly_optimal_interval(delta, mtbf)
    assert 1 <= ratio < 1 + 2 * (delta / mtbf) ** 0.5
