"""Learning-rate schedules: linear warmup, then cosine / linear decay to ``minLrRatio``, or constant.

:func:`lr_multiplier` is the pure rule; :func:`build_lr_scheduler` wraps it in a torch
``LambdaLR`` so the schedule position is ``Stateful`` and resumes with the global step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainyard_contract.spec import LrSchedule


def lr_multiplier(step: int, *, schedule: LrSchedule, max_steps: int) -> float:
    """Factor on the base learning rate for optimizer step ``step`` (0-based).

    Warmup ramps linearly to 1 over ``warmupSteps`` steps (step 0 already trains, at
    ``1/warmup``); the decay then runs from 1 at the end of warmup down to ``minLrRatio`` at
    ``maxSteps``, and stays there if a run goes on past ``maxSteps``.
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    floor = schedule.min_lr_ratio
    if schedule.name == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` that re-applies the learning rate of its restored position on load.

    Plain ``LambdaLR.load_state_dict`` restores the position but leaves the optimizer's
    learning rates as they are, so the result would depend on whether the optimizer was
    restored before or after the scheduler was built.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group, base_lr, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
            group["lr"] = base_lr * factor(self.last_epoch)  # the expression LambdaLR.step uses
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, schedule: LrSchedule, max_steps: int) -> ScheduledLR:
    """The scheduler of ``schedule``; its position is the number of optimizer steps taken."""

    def factor(step: int) -> float:
        return lr_multiplier(step, schedule=schedule, max_steps=max_steps)

    return ScheduledLR(optimizer, factor)
