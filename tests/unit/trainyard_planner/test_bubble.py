"""Pipeline bubbles: Narayanan et al. 2021 §2.2 (GPipe / 1F1B (p-1)/m, interleaved (p-1)/(v m))."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainyard_planner import (
    Layout, Schedule, bubble_fraction, bubble_ratio, inflight_microbatches, layout_bubble_ratio,
)

MEGATRON = [
    # (schedule, p, m, v, bubble time / ideal time)
    # Narayanan et al. 2021 §2.2.1: GPipe and PipeDream-Flush (1F1B) both have (p-1)/m.
    (Schedule.GPIPE, 4, 8, 1, 3 / 8),
    (Schedule.ONE_F_ONE_B, 4, 8, 1, 3 / 8),
    (Schedule.ONE_F_ONE_B, 8, 64, 1, 7 / 64),
    (Schedule.ONE_F_ONE_B, 1, 1, 1, 0.0),
    # The seed: 4 stages and 1 micro-batch leave most devices waiting, a bubble 3x the work.
    (Schedule.GPIPE, 4, 1, 1, 3.0),
    # §2.2.2: the interleaved schedule with v chunks per device cuts it by v: (p-1)/(v m).
    (Schedule.INTERLEAVED, 4, 8, 2, 3 / 16),
    (Schedule.INTERLEAVED, 8, 64, 4, 7 / 256),
    # Virtual stages mean nothing to the other schedules.
    (Schedule.ONE_F_ONE_B, 8, 64, 4, 7 / 64),
]


@pytest.mark.parametrize(("schedule", "p", "m", "v", "expected"), MEGATRON)
def test_megatron_bubble_formulas(schedule: Schedule, p: int, m: int, v: int, expected: float) -> None:
    """Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", §2.2: bubble fraction (p-1)/m, interleaved (p-1)/(v m)."""
    assert bubble_ratio(schedule, p, m, v) == pytest.approx(expected)
    assert bubble_fraction(schedule, p, m, v) == pytest.approx(expected / (1 + expected))


def test_layout_uses_its_schedule() -> None:
    layout = Layout(pp=4, microbatches=8, schedule=Schedule.INTERLEAVED, virtual_stages=2)
    assert layout_bubble_ratio(layout) == pytest.approx(3 / 16)


def test_inflight_micro_batches() -> None:
    assert inflight_microbatches(Schedule.GPIPE, 4, 16) == 16
    assert inflight_microbatches(Schedule.ONE_F_ONE_B, 4, 16) == 4
    assert inflight_microbatches(Schedule.ONE_F_ONE_B, 4, 2) == 2


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        bubble_ratio(Schedule.ONE_F_ONE_B, 0, 4)


@given(st.sampled_from(list(Schedule)), st.integers(1, 64), st.integers(1, 512), st.integers(1, 8))
def test_bubble_decreases_with_more_micro_batches(schedule: Schedule, p: int, m: int, v: int) -> None:
    assert bubble_ratio(schedule, p, m + 1, v) <= bubble_ratio(schedule, p, m, v)
    assert bubble_ratio(Schedule.INTERLEAVED, p, m, v) <= bubble_ratio(Schedule.ONE_F_ONE_B, p, m)


@given(st.sampled_from(list(Schedule)), st.integers(1, 64), st.integers(1, 512))
def test_bubble_grows_with_more_stages(schedule: Schedule, p: int, m: int) -> None:
    assert bubble_ratio(schedule, p + 1, m) >= bubble_ratio(schedule, p, m)
