"""Rank 0's step timing, derived once: what every read model of the telemetry service (and, through the
step-timing read model, the checkpoint coordinator's interval advice) means by a step's time.

A StepMetrics reports the step's wall time (``stepSeconds``) and the part of it training stood still for a
checkpoint (``checkpointSeconds``: the whole write when saving blocks, the wait when it runs in the
background). The *work* of a step is the difference: what the planner's step estimate predicts, what
goodput counts as productive, what the checkpoint interval advice weighs a save against (docs/design.md,
Telemetry). Negative or missing figures count as zero. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard_contract.events import StepMetrics

__all__ = ["StepTime", "step_time"]


@dataclass(frozen=True)
class StepTime:
    """One step's wall time split into work and checkpoint stall (seconds, never negative)."""

    seconds: float
    stall_seconds: float

    @property
    def work_seconds(self) -> float:
        return max(self.seconds - self.stall_seconds, 0.0)

    @property
    def saved(self) -> bool:
        """Whether training stood still for a checkpoint in this step."""
        return self.stall_seconds > 0


def step_time(m: StepMetrics) -> StepTime:
    """The split of ``m``'s step time (any rank's; rank 0's is the job's)."""
    return StepTime(seconds=max(m.step_seconds, 0.0), stall_seconds=max(m.checkpoint_seconds, 0.0))
