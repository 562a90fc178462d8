"""The progress read model only moves forward, by (attempt, step), and only from rank 0."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from trainyard_telemetry.progress import advance_progress
from trainyard_contract.events import StepMetrics
from trainyard_contract.records import Progress

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def m(step: int, *, attempt: int = 1, rank: int = 0, max_steps: int | None = 40) -> StepMetrics:
    return StepMetrics(job_id="job-1", attempt=attempt, rank=rank, step=step, max_steps=max_steps,
                       loss=1.0 / (step + 1), consumed_tokens=step * 100, tokens_per_second=10.0)


def at(step: int, attempt: int = 1) -> Progress:
    return Progress(attempt=attempt, global_step=step, max_steps=40)


@pytest.mark.parametrize(("current", "metrics", "expected_step"), [
    (None, m(1), 1),
    (at(5), m(6), 6),
    (at(5), m(5), None),                 # duplicate
    (at(5), m(4), None),                 # late delivery
    (at(5), m(9, rank=1), None),         # not rank 0
    (at(30), m(21, attempt=2), 21),      # a resumed attempt restarts from its checkpoint
    (at(21, attempt=2), m(35, attempt=1), None),  # the old attempt's stragglers
    (Progress(global_step=3), m(4), 4),  # a record without an attempt counts as attempt 0
])
def test_advance(current: Progress | None, metrics: StepMetrics, expected_step: int | None) -> None:
    new = advance_progress(current, metrics, NOW)
    if expected_step is None:
        assert new is None
    else:
        assert new is not None and new.global_step == expected_step
        assert new.attempt == metrics.attempt and new.updated_at == NOW
        assert new.consumed_tokens == metrics.consumed_tokens and new.last_loss == metrics.loss


def test_max_steps_is_kept_when_a_rank_omits_it() -> None:
    new = advance_progress(at(5), m(6, max_steps=None), NOW)
    assert new is not None and new.max_steps == 40


def timed(step: int, seconds: float, *, stall: float = 0.0, attempt: int = 1, tokens: int = 1000,
          peak_share: float | None = None) -> StepMetrics:
    """A step as the SDK reports it: tokens/s over the whole step window (checkpoint stall included)."""
    tps = tokens / seconds
    return StepMetrics(job_id="job-1", attempt=attempt, rank=0, step=step, max_steps=40, loss=1.0,
                       consumed_tokens=step * tokens, tokens_per_second=tps, step_seconds=seconds,
                       checkpoint_seconds=stall, mfu=None if peak_share is None else tps * peak_share)


def replay(steps: list[StepMetrics]) -> Progress:
    progress = None
    for s in steps:
        progress = advance_progress(progress, s, NOW) or progress
    assert progress is not None
    return progress


@pytest.mark.parametrize(("case", "steps", "tokens_per_second"), [
    ("one step: its own, without its stall", [timed(1, 2.0, stall=1.0)], 1000.0),
    # the first step's window holds the launch and warm-up; the last one the final save
    ("a run ending on a checkpointing step", [timed(1, 10.0), timed(2, 1.0), timed(3, 1.0), timed(4, 5.0, stall=4.0)],
     1000.0),
    ("steps of different speeds: tokens over time", [timed(1, 9.0), timed(2, 1.0), timed(3, 3.0)], 500.0),
    ("stalls are taken out of every step", [timed(1, 1.0), timed(2, 3.0, stall=1.0), timed(3, 1.0)], 2000 / 3),
    ("a new attempt starts its own figure", [timed(1, 1.0), timed(2, 1.0), timed(3, 1.0, attempt=2),
                                             timed(4, 4.0, attempt=2), timed(5, 2.0, attempt=2)], 2000 / 6),
    ("a stale step changes nothing", [timed(1, 1.0), timed(3, 2.0), timed(2, 0.1)], 500.0),
])
def test_tokens_per_second_is_the_attempts_figure_not_the_last_steps(
        case: str, steps: list[StepMetrics], tokens_per_second: float) -> None:
    assert replay(steps).tokens_per_second == pytest.approx(tokens_per_second)


def test_mfu_follows_the_same_figure() -> None:
    got = replay([timed(1, 10.0, peak_share=1e-4), timed(2, 1.0, peak_share=1e-4),
                  timed(3, 5.0, stall=4.0, peak_share=1e-4)])
    assert got.tokens_per_second == pytest.approx(1000.0)
    assert got.mfu == pytest.approx(0.1)


def test_a_step_without_a_rate_keeps_the_figure() -> None:
    unrated = StepMetrics(job_id="job-1", attempt=1, rank=0, step=3, loss=1.0, consumed_tokens=3000)
    got = replay([timed(1, 1.0), timed(2, 2.0), unrated])
    assert got.global_step == 3 and got.tokens_per_second == pytest.approx(500.0)


def test_a_rate_without_a_step_time_is_taken_as_reported() -> None:
    got = replay([StepMetrics(job_id="job-1", attempt=1, rank=0, step=1, loss=1.0, consumed_tokens=10,
                              tokens_per_second=4000.0)])
    assert got.tokens_per_second == 4000.0
