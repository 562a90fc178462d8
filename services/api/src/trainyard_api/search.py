"""An experiment's decisions, pure: which point a trial gets, where its rungs are, and what the search does next.

:func:`decide` takes the experiment's record, what its trials' jobs look like now (:class:`Observation`: the
job's state, its metric at each rung step it passed, its last value, its device-hours) and returns the record
as it should be and the actions that get it there (:class:`Action`: submit, pause, resume, cancel). The
driver (``experiment_driver``) loads, decides and applies; a decision applied twice changes nothing, so a
restarted API takes the search up where the record says it is.

Early stopping is successive halving with synchronous rungs: a trial that reaches a rung is paused (its
checkpoint written, its devices released) until every trial still in the race has reached that rung; then
the best 1/η go on and the others are stopped. Asynchronous ASHA promotes the first trials to reach a rung for
lack of competitors (measured: with six trials reporting in lock-step, it stopped one); waiting for the rung is
what makes "the worst trials stop" hold. Points are drawn by optuna's samplers (random, TPE) over an in-memory
study rebuilt from the record, seeded by (seed, trial number), so the same record draws the same point.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from trainyard_contract.experiments import (
    ExperimentRecord,
    ExperimentSpec,
    ParamValue,
    Parameter,
    RungDecision,
    Trial,
)

ACTIVE = frozenset({"running", "stopping"})
ENDED = frozenset({"completed", "stopped", "failed"})


# ----------------------------------------------------------------------------- points


def grid_points(spec: ExperimentSpec) -> list[dict[str, ParamValue]]:
    """Every point of the grid, in an order shuffled by the seed (so fewer trials than points still spread)."""
    names = sorted(spec.space)
    points = [dict(zip(names, values, strict=True))
              for values in itertools.product(*(spec.space[n].grid() for n in names))]
    random.Random(spec.search.seed).shuffle(points)
    return points


def _distribution(param: Parameter) -> Any:
    import optuna

    if param.type == "categorical":
        return optuna.distributions.CategoricalDistribution(list(param.values or []))
    assert param.low is not None and param.high is not None
    if param.type == "int":
        return optuna.distributions.IntDistribution(int(param.low), int(param.high), log=param.log)
    return optuna.distributions.FloatDistribution(param.low, param.high, log=param.log)


def sample_point(spec: ExperimentSpec, number: int, finished: Sequence[tuple[Mapping[str, ParamValue], float]]
                 ) -> dict[str, ParamValue]:
    """Trial ``number``'s point: the grid's ``number``-th, or optuna's sampler asked over a study holding the
    ``finished`` trials (point, value). Deterministic in (spec, number, finished)."""
    if spec.search.algorithm == "grid":
        return grid_points(spec)[number]
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seed = (spec.search.seed * 100_003 + number) % 2**32  # numpy seeds are 32 bits
    sampler = (optuna.samplers.TPESampler(seed=seed, n_startup_trials=4) if spec.search.algorithm == "tpe"
               else optuna.samplers.RandomSampler(seed=seed))
    study = optuna.create_study(direction=spec.metric.goal, sampler=sampler)
    dists = {name: _distribution(p) for name, p in sorted(spec.space.items())}
    for params, value in finished:
        if math.isfinite(value) and set(params) == set(dists):
            study.add_trial(optuna.trial.create_trial(params=dict(params), distributions=dists, value=value))
    return dict(study.ask(dists).params)


def trial_body(spec: ExperimentSpec, trial: Trial) -> dict[str, Any]:
    """The spec a trial submits: the base with its point written in, named after the experiment and trial."""
    body = copy.deepcopy(spec.base)
    for path, value in trial.params.items():
        node = body
        *parents, leaf = path.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value
    body["name"] = f"{spec.name}-t{trial.number}"
    return body


def rung_steps(spec: ExperimentSpec, max_steps: int) -> list[int]:
    """The steps of the rungs: minSteps·η^k below ``max_steps``, while more than one trial races there (the
    trials reaching rung k are ⌈maxTrials/η^k⌉: a rung of one would pause it for nothing)."""
    es = spec.early_stopping
    if es is None:
        return []
    out, step, racing = [], es.min_steps, spec.budget.max_trials
    while step < max_steps and racing > 1:
        out.append(step)
        step *= es.reduction_factor
        racing = math.ceil(racing / es.reduction_factor)
    return out


# ----------------------------------------------------------------------------- the search's decision


@dataclass(frozen=True)
class Observation:
    """A trial's job as the driver found it."""

    state: str  # the job's state
    rung_values: Mapping[int, float]  # rung index → its metric at that rung's step (the rungs it passed)
    last_step: int = 0
    last_value: float | None = None
    device_hours: float = 0.0
    reason: str | None = None
    control: str | None = None  # a control request the scheduler has not acted on yet


@dataclass(frozen=True)
class Action:
    kind: Literal["submit", "pause", "resume", "cancel"]
    trial: int
    reason: str = ""


@dataclass
class Decision:
    record: ExperimentRecord
    actions: list[Action] = field(default_factory=list)


Sampler = Callable[[int, Sequence[tuple[Mapping[str, ParamValue], float]]], dict[str, ParamValue]]


def decide(record: ExperimentRecord, observed: Mapping[int, Observation], *, rungs: Sequence[int],
           sampler: Sampler, now: datetime) -> Decision:
    """The experiment's next state and actions, in phases: 1. fold in what the jobs did 2. stop everything on a
    stop request or a spent budget 3. decide the rungs every trial in the race has reached 4. pause the trials
    that wait at an undecided rung 5. fill the free slots (promoted trials first, then new points) 6. finish."""
    trials = {t.number: _folded(t, observed.get(t.number), len(rungs)) for t in record.trials}
    spec = record.spec
    decisions = list(record.rung_decisions)
    actions: list[Action] = []
    halt = record.stop_requested or _budget_spent(spec, trials.values())
    if halt:
        for t in list(trials.values()):
            if t.state not in ENDED:
                trials[t.number] = _stop(t, actions, f"the experiment stopped: {halt}", observed.get(t.number))
    else:
        _decide_rungs(spec, trials, decisions, rungs, actions, observed)
        _pause_at_rungs(trials, decisions, actions, observed)
        _fill_slots(spec, trials, decisions, actions, sampler, observed)
    out = record.model_copy(update={"trials": [trials[n] for n in sorted(trials)], "rung_decisions": decisions,
                                    "updated_at": now})
    return Decision(_finished(out, halt), actions)


def _folded(t: Trial, o: Observation | None, n_rungs: int) -> Trial:
    if o is None or t.job_id is None:
        return t
    rungs = list(t.rungs)
    while len(rungs) < n_rungs and len(rungs) in o.rung_values:
        rungs.append(o.rung_values[len(rungs)])
    update: dict[str, Any] = {"rungs": rungs, "last_step": max(t.last_step, o.last_step),
                              "device_hours": o.device_hours}
    if o.last_value is not None:
        update["value"] = o.last_value
    if o.state == "succeeded":
        update["state"] = "completed"
    elif o.state == "failed":
        update |= {"state": "failed", "reason": o.reason or "its job failed"}
    elif o.state == "cancelled":
        update |= {"state": "stopped", "reason": t.reason or o.reason or "its job was cancelled"}
    elif t.state == "pending":
        update["state"] = "running"
    return t.model_copy(update=update)


def _budget_spent(spec: ExperimentSpec, trials: Any) -> str | None:
    limit = spec.budget.max_device_hours
    used = sum(t.device_hours for t in trials)
    if limit is not None and used >= limit:
        return f"its device-hour budget is spent ({used:.3f} of {limit:g} device-hours)"
    return None


def _stop(t: Trial, actions: list[Action], reason: str, o: Observation | None) -> Trial:
    """Stop a trial with a checkpoint: a running job is paused first (it checkpoints), then cancelled."""
    if t.job_id is None:
        return t.model_copy(update={"state": "stopped", "reason": reason})
    job_state = o.state if o is not None else "queued"
    if job_state == "running":
        if o is None or o.control is None:
            actions.append(Action("pause", t.number, reason))
        return t.model_copy(update={"state": "stopping", "reason": t.reason or reason})
    if job_state in ("queued", "paused") and (o is None or o.control is None):
        actions.append(Action("cancel", t.number, t.reason or reason))
    return t.model_copy(update={"state": "stopping", "reason": t.reason or reason})


def _better(spec: ExperimentSpec) -> Callable[[float], float]:
    return (lambda v: v) if spec.metric.goal == "minimize" else (lambda v: -v)


def _decide_rungs(spec: ExperimentSpec, trials: dict[int, Trial], decisions: list[RungDecision],
                  rungs: Sequence[int], actions: list[Action], observed: Mapping[int, Observation]) -> None:
    es = spec.early_stopping
    for k in range(len(decisions), len(rungs)):
        if es is None:
            return
        population = (sorted(trials) if k == 0 else decisions[k - 1].promoted)
        if k == 0 and len(trials) < spec.budget.max_trials:
            return  # trials not yet started will race at this rung too
        racing = [trials[n] for n in population if trials[n].state != "failed"]
        if any(len(t.rungs) <= k for t in racing if t.state != "stopped"):
            return
        ranked = sorted((t for t in racing if len(t.rungs) > k), key=lambda t: _better(spec)(t.rungs[k]))
        keep = max(1, math.ceil(len(ranked) / es.reduction_factor))
        promoted, losers = ranked[:keep], ranked[keep:]
        decisions.append(RungDecision(rung=k, steps=rungs[k], promoted=sorted(t.number for t in promoted),
                                      stopped=sorted(t.number for t in losers)))
        for t in losers:
            if t.state not in ENDED:
                why = (f"early stopping: at rung {k} (step {rungs[k]}) its {spec.metric.name} "
                       f"{t.rungs[k]:.4g} was not in the best {keep} of {len(ranked)}")
                trials[t.number] = _stop(t, actions, why, observed.get(t.number))


def _cleared(number: int, decisions: Sequence[RungDecision]) -> int:
    """How many rungs the trial has been promoted past."""
    return sum(1 for d in decisions if number in d.promoted)


def _pause_at_rungs(trials: dict[int, Trial], decisions: list[RungDecision], actions: list[Action],
                    observed: Mapping[int, Observation]) -> None:
    for t in list(trials.values()):
        if t.state != "running" or len(t.rungs) <= _cleared(t.number, decisions):
            continue
        o = observed.get(t.number)
        if o is not None and o.state == "running" and o.control is None:
            actions.append(Action("pause", t.number, f"waiting at rung {len(t.rungs) - 1} for the other trials"))
        if o is None or o.state in ("running", "paused"):
            trials[t.number] = t.model_copy(update={"state": "waiting"})


def _fill_slots(spec: ExperimentSpec, trials: dict[int, Trial], decisions: list[RungDecision],
                actions: list[Action], sampler: Sampler, observed: Mapping[int, Observation]) -> None:
    for t in list(trials.values()):  # a stopping trial's cancel, once its pause has landed
        o = observed.get(t.number)
        if t.state == "stopping" and o is not None and o.state == "paused" and o.control is None:
            actions.append(Action("cancel", t.number, t.reason or "stopped"))
        if t.state == "pending":  # recorded, its submission not known to have happened: submitted again (idempotent)
            actions.append(Action("submit", t.number))
    free = spec.max_concurrent_trials - sum(1 for t in trials.values() if t.state in ACTIVE or t.state == "pending")
    promoted = sorted((t for t in trials.values() if t.state == "waiting"
                       and _cleared(t.number, decisions) >= len(t.rungs)),
                      key=lambda t: _better(spec)(t.rungs[-1]) if t.rungs else 0.0)
    for t in promoted:
        if free <= 0:
            break
        o = observed.get(t.number)
        if o is not None and o.state == "paused" and o.control is None:
            actions.append(Action("resume", t.number))
            trials[t.number] = t.model_copy(update={"state": "running"})
            free -= 1
    while free > 0 and len(trials) < spec.budget.max_trials:
        number = len(trials)
        finished = [(t.params, t.value) for t in trials.values() if t.state in ("completed", "stopped")
                    and t.value is not None]
        trials[number] = Trial(number=number, params=sampler(number, finished))
        actions.append(Action("submit", number))
        free -= 1


def _finished(record: ExperimentRecord, halt: str | None) -> ExperimentRecord:
    if len(record.trials) < record.spec.budget.max_trials and not halt:
        return record
    if any(t.state not in ENDED for t in record.trials):
        return record
    done = [t for t in record.trials if t.state == "completed" and t.value is not None]
    best = min(done, key=lambda t: _better(record.spec)(t.value or 0.0)) if done else None
    reason: str | None = halt
    if best is None:
        state, reason = ("stopped" if halt else "failed"), (halt or "no trial ran to the end")
    else:
        state = "stopped" if record.stop_requested else "completed"
    return record.model_copy(update={"state": state, "reason": reason,
                                     "best_trial": best.number if best else None})
