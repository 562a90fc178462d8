"""Rank 0's step time split once into work and checkpoint stall (trainyard_telemetry.steps)."""

from __future__ import annotations

import pytest

from trainyard_contract import events as ev
from trainyard_telemetry.steps import step_time


def metrics(step_seconds: float, checkpoint_seconds: float) -> ev.StepMetrics:
    return ev.StepMetrics(job_id="job-1", attempt=1, rank=0, step=3, loss=1.0, consumed_tokens=0,
                          step_seconds=step_seconds, checkpoint_seconds=checkpoint_seconds)


@pytest.mark.parametrize(("step_s", "stall_s", "work", "stall", "saved"), [
    (0.5, 0.0, 0.5, 0.0, False),      # a plain step: all work
    (2.5, 2.0, 0.5, 2.0, True),       # a save step: the stall is not work
    (0.0, 0.0, 0.0, 0.0, False),      # no time reported
    (1.0, 3.0, 0.0, 3.0, True),       # a stall longer than the step (clock skew): no negative work
    (-1.0, -0.5, 0.0, 0.0, False),    # negative figures count as zero
])
def test_a_step_splits_into_work_and_stall(step_s: float, stall_s: float, work: float, stall: float,
                                           saved: bool) -> None:
    t = step_time(metrics(step_s, stall_s))
    assert (t.work_seconds, t.stall_seconds, t.saved) == (pytest.approx(work), pytest.approx(stall), saved)
