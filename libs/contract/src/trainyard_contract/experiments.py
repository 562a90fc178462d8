"""Experiments: a search over a base training spec, each trial an ordinary job (``POST /v1/experiments``).

The wire form (camelCase, like the spec) and the records the API keeps (``ty:experiment:<id>``). An
experiment names a complete base spec, a search space over its fields (dotted camelCase paths such as
``training.learningRate``), how points are drawn (``grid``, ``random`` or ``tpe``), the metric that ranks
trials, optional early stopping (successive halving over rungs of steps), a budget and how many trials may
hold devices at once. Every trial's spec is the base with its point written in, checked and stored as any
submitted spec is; the job records its origin (:class:`ExperimentOrigin`).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainyard_contract.events import utcnow
from trainyard_contract.spec import _Wire

FIELD_PATH = r"^[a-z][A-Za-z0-9]*(\.[a-z][A-Za-z0-9]*){0,4}$"
"""A spec field a search space may set: ``training.learningRate``, ``training.optimizer.weightDecay``."""

#: The spec fields a search may not vary: what the job is (dataset, code, model identity is allowed), what
#: the platform fills in, and the device shape (a sweep over devices is a sweep over placements).
FROZEN_FIELDS = frozenset({"specVersion", "dataset", "code", "resources", "parallelism", "initFrom", "name",
                           "priority", "faultTolerance", "export"})
MAX_TRIALS = 256

ParamValue = float | int | str | bool


class Parameter(_Wire):
    """One dimension of the search space: a range (``low``..``high``, ``log`` for a log scale, ``int`` for
    integers) or a list of ``values``. Grid search needs ``values`` (or an int range)."""

    type: Literal["float", "int", "categorical"] = Field(
        default="float", description="float or int (a range low..high), categorical (one of values)")
    low: float | None = Field(default=None, description="smallest value of a range")
    high: float | None = Field(default=None, description="largest value of a range")
    log: bool = Field(default=False, description="draw the range on a log scale (learning rates)")
    values: list[ParamValue] | None = Field(default=None, min_length=1, max_length=256,
                                            description="the values a categorical dimension takes")

    @model_validator(mode="after")
    def _shape(self) -> Parameter:
        if self.type == "categorical":
            if not self.values or self.low is not None or self.high is not None:
                raise ValueError("a categorical parameter has values (and no low/high)")
            return self
        if self.values is not None:
            raise ValueError(f"a {self.type} parameter is a range low..high; use type: categorical for values")
        if self.low is None or self.high is None or not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError(f"a {self.type} parameter needs finite low and high")
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError("a log-scale range needs low > 0")
        if self.type == "int" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError("an int range has whole-number bounds")
        return self

    def grid(self) -> list[ParamValue]:
        """The values grid search walks (categorical values, or every integer of an int range)."""
        if self.values is not None:
            return list(self.values)
        if self.type == "int" and self.low is not None and self.high is not None and self.high - self.low <= 256:
            return list(range(int(self.low), int(self.high) + 1))
        raise ValueError("grid search needs values (or an int range of at most 257 values)")


class Metric(_Wire):
    """The series that ranks trials: a built-in one (``loss``) or one the code reports (``run.log``)."""

    name: str = Field(default="loss", pattern=r"^[A-Za-z0-9_.:/-]{1,64}$",
                      description="the metric series (as GET /v1/training-jobs/{id}/metrics names it)")
    goal: Literal["minimize", "maximize"] = "minimize"


class EarlyStopping(_Wire):
    """Successive halving: rungs at ``minSteps``·η^k steps; at each rung, once every trial still in the race
    has reached it, the best 1/η go on and the others stop (checkpointed, with the reason)."""

    kind: Literal["successiveHalving"] = "successiveHalving"
    min_steps: int = Field(ge=1, le=10_000_000, description="the first rung, in steps")
    reduction_factor: int = Field(default=2, ge=2, le=10, description="η: 1/η of the trials go on at each rung")


class Search(_Wire):
    algorithm: Literal["grid", "random", "tpe"] = Field(
        default="random", description="grid (every point of the values' product), random, or tpe (optuna's "
                                      "tree-structured Parzen estimator, guided by the finished trials)")
    seed: int = Field(default=0, ge=0, lt=2**31, description="the same seed draws the same points")


class Budget(_Wire):
    max_trials: int = Field(ge=1, le=MAX_TRIALS, description="trials to run (grid: at most the grid's size)")
    max_device_hours: float | None = Field(
        default=None, gt=0, exclude_if=lambda v: v is None,
        description="stop every trial and start none once the trials have held this many device-hours")


class ExperimentSpec(_Wire):
    """What a researcher submits to ``POST /v1/experiments``."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    base: dict[str, Any] = Field(description="a complete training spec (POST /v1/training-jobs body)")
    space: dict[Annotated[str, Field(pattern=FIELD_PATH)], Parameter] = Field(
        min_length=1, max_length=16, description="spec field (dotted camelCase path) → its range or values",
        json_schema_extra={"additionalProperties": False})  # every key is a field path: patternProperties only
    search: Search = Search()
    metric: Metric = Metric()
    early_stopping: EarlyStopping | None = Field(default=None, description="successive halving on the metric")
    budget: Budget
    max_concurrent_trials: int = Field(default=2, ge=1, le=64, description="trials holding devices at once")

    @field_validator("space")
    @classmethod
    def _not_frozen(cls, space: dict[str, Parameter]) -> dict[str, Parameter]:
        frozen = sorted(p for p in space if p.split(".")[0] in FROZEN_FIELDS)
        if frozen:
            raise ValueError(f"the search may not vary {', '.join(frozen)}: an experiment varies the training, "
                             f"not what the job is or where it runs ({', '.join(sorted(FROZEN_FIELDS))})")
        return space

    @field_validator("search")
    @classmethod
    def _gridable(cls, search: Search, info: ValidationInfo) -> Search:
        space = info.data.get("space") or {}
        if search.algorithm == "grid":
            ranges = sorted(path for path, p in space.items() if not _has_grid(p))
            if ranges:
                raise ValueError(f"grid search walks listed values: {', '.join(ranges)} is a range (give values, "
                                 "an int range of at most 257 values, or use algorithm random or tpe)")
        return search

    @field_validator("budget")
    @classmethod
    def _within_grid(cls, budget: Budget, info: ValidationInfo) -> Budget:
        search, space = info.data.get("search"), info.data.get("space")
        if search is not None and search.algorithm == "grid" and space:
            size = grid_size(space)
            if budget.max_trials > size:
                raise ValueError(f"maxTrials ({budget.max_trials}) exceeds the grid's {size} points")
        return budget


def _has_grid(param: Parameter) -> bool:
    try:
        param.grid()
    except ValueError:
        return False
    return True


def grid_size(space: dict[str, Parameter]) -> int:
    size = 1
    for param in space.values():
        size *= len(param.grid())
    return size


TrialState = Literal["pending", "running", "waiting", "stopping", "completed", "stopped", "failed"]
"""pending: its point drawn, no job yet; running: its job is queued or running; waiting: paused at a rung until
the rung is decided; stopping: stopped by the search, its checkpoint being written; completed: its job ran to the
end; stopped: the search stopped it (early stopping, the budget, the experiment stopped); failed: its job failed."""
ExperimentState = Literal["running", "completed", "stopped", "failed"]


class Trial(_Wire):
    """One point of the search and its job (``model_config`` of _Wire: frozen, replaced on change)."""

    number: int = Field(ge=0)
    params: dict[str, ParamValue]
    job_id: str | None = None
    state: TrialState = "pending"
    rungs: list[float] = Field(default=[], description="the metric at each rung this trial reached")
    value: float | None = Field(default=None, description="its last metric value (the final one once completed)")
    last_step: int = Field(default=0, description="the last step its metric was seen at")
    device_hours: float = 0.0
    reason: str | None = Field(default=None, description="why it stopped or failed")


class RungDecision(_Wire):
    rung: int
    steps: int
    promoted: list[int]
    stopped: list[int]


class ExperimentRecord(_Wire):
    """The experiment as the API keeps it: its spec, its trials and the decisions taken (``ty:experiment:<id>``).
    One writer: the API process that holds the experiment's driver lease."""

    experiment_id: str
    tenant: str
    spec: ExperimentSpec
    state: ExperimentState = "running"
    reason: str | None = None
    trials: list[Trial] = []
    rung_decisions: list[RungDecision] = []
    best_trial: int | None = None
    created_by: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    stop_requested: str | None = Field(default=None, description="why a stop was asked for (by whom)")

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True)
