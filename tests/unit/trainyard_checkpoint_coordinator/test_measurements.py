"""The interval advice reads rank 0's step time from the telemetry service's step-timing read model."""

from __future__ import annotations

from trainyard_checkpoint_coordinator.measurements import recent_step_seconds
from trainyard_telemetry.readmodels import StepTiming


def test_the_newest_attempt_with_a_step_gives_the_step_time() -> None:
    assert recent_step_seconds({}) is None
    assert recent_step_seconds({1: StepTiming(attempt=1)}) is None
    older, newer = StepTiming(attempt=1, recent_work_seconds=0.5), StepTiming(attempt=2, recent_work_seconds=0.8)
    assert recent_step_seconds({1: older, 2: newer}) == 0.8
    # a new attempt without a step yet: the previous attempt's figure is the better guess
    assert recent_step_seconds({1: older, 2: StepTiming(attempt=2)}) == 0.5
