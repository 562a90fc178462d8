"""Calibration: correction factors per device type, predicted vs measured."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_planner import Calibration, Sample, SampleKind, compare, fit, within

STEP, WRITE, FAIL = SampleKind.STEP_TIME, SampleKind.CHECKPOINT_WRITE, SampleKind.FAILURE_INTERVAL


def samples() -> list[Sample]:
    return [
        Sample(kind=STEP, device_type="cpu", predicted=1.0, measured=1.2, label="gpt-tiny 2 ranks"),
        Sample(kind=STEP, device_type="cpu", predicted=2.0, measured=2.4, label="gpt-small 2 ranks"),
        Sample(kind=WRITE, device_type="cpu", predicted=4.0, measured=2.0, label="gpt-small ckpt"),
        Sample(kind=FAIL, device_type="cpu", measured=3600.0),
        Sample(kind=FAIL, device_type="cpu", measured=7200.0),
        Sample(kind=STEP, device_type="h100-80gb", predicted=1.0, measured=0.9),
    ]


def test_factors_per_device_type() -> None:
    calibration = fit(samples())
    cpu = calibration.for_device("cpu")
    assert cpu.step_time_factor == pytest.approx(1.2)
    assert cpu.step_time_samples == 2
    assert cpu.checkpoint_write_factor == pytest.approx(0.5)
    assert cpu.mtbf_seconds == pytest.approx(5400.0)
    assert calibration.for_device("h100-80gb").step_time_factor == pytest.approx(0.9)
    # Nothing measured: the identity.
    assert calibration.for_device("a100-80gb").step_time_factor == 1.0


def test_effective_efficiency_and_bandwidth() -> None:
    cpu = fit(samples()).for_device("cpu")
    assert cpu.effective_efficiency(0.6) == pytest.approx(0.5)  # 20 % slower than predicted
    assert cpu.effective_bandwidth(1e9) == pytest.approx(2e9)  # writes twice as fast
    ten_times_faster = fit([Sample(kind=STEP, device_type="x", predicted=1, measured=0.1)]).for_device("x")
    assert ten_times_faster.effective_efficiency(0.5) == 1.0  # capped at the peak


def test_geometric_mean_weighs_over_and_under_estimates_alike() -> None:
    calibration = fit([
        Sample(kind=STEP, device_type="cpu", predicted=1.0, measured=2.0),
        Sample(kind=STEP, device_type="cpu", predicted=1.0, measured=0.5),
    ])
    assert calibration.for_device("cpu").step_time_factor == pytest.approx(1.0)


def test_predicted_vs_measured_report() -> None:
    data = samples()
    calibration = fit(data)
    rows = compare(data, calibration)
    assert len(rows) == 4  # failure intervals carry no prediction
    first = rows[0]
    assert first.label == "gpt-tiny 2 ranks"
    assert first.error_pct == pytest.approx(-100 / 6)
    assert first.calibrated == pytest.approx(1.2)
    assert first.calibrated_error_pct == pytest.approx(0.0, abs=1e-9)
    assert not within(rows, 15.0)
    assert within(rows, 15.0, calibrated=True)
    assert "errorPct" in first.wire()


def test_round_trips_through_a_dict() -> None:
    calibration = fit(samples())
    data = calibration.to_dict()
    assert data["devices"]["cpu"]["stepTimeFactor"] == pytest.approx(1.2)
    assert Calibration.from_dict(data) == calibration


def test_prior_is_pooled_by_sample_count() -> None:
    first = fit([Sample(kind=STEP, device_type="cpu", predicted=1.0, measured=2.0),
                 Sample(kind=FAIL, device_type="cpu", measured=100.0)])
    pooled = fit([Sample(kind=STEP, device_type="cpu", predicted=1.0, measured=0.5),
                  Sample(kind=FAIL, device_type="cpu", measured=300.0)], prior=first)
    cpu = pooled.for_device("cpu")
    assert cpu.step_time_factor == pytest.approx(1.0)
    assert cpu.step_time_samples == 2
    assert cpu.mtbf_seconds == pytest.approx(200.0)
    assert cpu.failure_samples == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 100), st.floats(0.2, 5)), min_size=1, max_size=20))
def test_a_constant_bias_is_removed_exactly(pairs: list[tuple[float, float]]) -> None:
    """When every measurement is the prediction times the same factor, calibration recovers it."""
    bias = pairs[0][1]
    data = [Sample(kind=STEP, device_type="cpu", predicted=p, measured=p * bias) for p, _ in pairs]
    rows = compare(data, fit(data))
    assert all(math.isclose(r.calibrated, r.measured, rel_tol=1e-9) for r in rows)
