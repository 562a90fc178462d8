"""The progress read model only moves forward, by (attempt, step), and only from rank 0."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from trainyard_api.progress import advance_progress
from trainyard_common.events import StepMetrics
from trainyard_common.records import Progress

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
