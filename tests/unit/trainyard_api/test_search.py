"""The experiments' pure decisions: points, rungs, and what the search does next (trainyard_api.search)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from trainyard_contract.experiments import ExperimentRecord, ExperimentSpec, ParamValue, Trial
from trainyard_api.search import Observation, decide, grid_points, rung_steps, sample_point, trial_body

NOW = datetime(2026, 12, 5, tzinfo=UTC)
BASE: dict[str, Any] = {"specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1",
                        "codeRevision": "local", "resources": {"gpuType": "cpu", "gpuCount": 1},
                        "training": {"sequenceLength": 16, "microBatchSize": 2, "globalBatchSize": 2,
                                     "learningRate": 0.001, "maxSteps": 80}}


def spec(**over: Any) -> ExperimentSpec:
    data: dict[str, Any] = {"name": "sweep", "base": BASE,
                            "space": {"training.learningRate": {"low": 1e-4, "high": 1e-1, "log": True}},
                            "budget": {"maxTrials": 4}, "maxConcurrentTrials": 4,
                            "earlyStopping": {"minSteps": 20, "reductionFactor": 2}}
    data.update(over)
    return ExperimentSpec.model_validate(data)


def sampler(n: int, finished: Sequence[tuple[Mapping[str, ParamValue], float]]) -> dict[str, ParamValue]:
    return {"training.learningRate": 0.001 * (n + 1)}


def step(record: ExperimentRecord, observed: dict[int, Observation]) -> tuple[ExperimentRecord, list[tuple[str, int]]]:
    rungs = rung_steps(record.spec, 80)
    d = decide(record, observed, rungs=rungs, sampler=sampler, now=NOW)
    trials = [t if t.job_id else t.model_copy(update={"job_id": f"job-{t.number}"}) for t in d.record.trials]
    return d.record.model_copy(update={"trials": trials}), [(a.kind, a.trial) for a in d.actions]


def running(values: dict[int, float] | None = None, state: str = "running", **kw: Any) -> Observation:
    return Observation(state=state, rung_values=values or {}, **kw)


def test_rungs_are_min_steps_times_eta_below_max_steps() -> None:
    assert rung_steps(spec(), 80) == [20, 40]
    assert rung_steps(spec(earlyStopping={"minSteps": 10, "reductionFactor": 3}), 100) == [10, 30]  # 4 → 2 → 1
    many = spec(earlyStopping={"minSteps": 10, "reductionFactor": 3}, budget={"maxTrials": 27})
    assert rung_steps(many, 1000) == [10, 30, 90]  # 27 → 9 → 3 → 1: no rung for the last one
    assert rung_steps(spec(earlyStopping=None), 80) == []


def test_a_trial_spec_is_the_base_with_its_point_and_a_name() -> None:
    body = trial_body(spec(), Trial(number=3, params={"training.learningRate": 0.02,
                                                      "training.optimizer.weightDecay": 0.0}))
    assert body["training"]["learningRate"] == 0.02
    assert body["training"]["optimizer"] == {"weightDecay": 0.0}
    assert body["name"] == "sweep-t3"
    assert BASE["training"]["learningRate"] == 0.001  # the base is not touched


def test_random_points_are_deterministic_in_range_and_differ_by_trial() -> None:
    s = spec(search={"algorithm": "random", "seed": 5})
    points = [sample_point(s, n, [])["training.learningRate"] for n in range(6)]
    assert points == [sample_point(s, n, [])["training.learningRate"] for n in range(6)]
    assert len(set(points)) == 6
    assert all(1e-4 <= float(p) <= 1e-1 for p in points)


def test_tpe_draws_from_the_finished_trials() -> None:
    s = spec(search={"algorithm": "tpe", "seed": 1},
             space={"training.learningRate": {"low": 1e-4, "high": 1e-1, "log": True}})
    finished = [({"training.learningRate": 10 ** -(1 + i / 2)}, float(i)) for i in range(6)]
    point = sample_point(s, 6, finished)
    assert 1e-4 <= float(point["training.learningRate"]) <= 1e-1


def test_grid_walks_every_point_once() -> None:
    s = spec(search={"algorithm": "grid"}, budget={"maxTrials": 6},
             space={"training.learningRate": {"type": "categorical", "values": [0.001, 0.01, 0.1]},
                    "training.microBatchSize": {"type": "categorical", "values": [1, 2]}})
    points = grid_points(s)
    assert len({tuple(sorted(p.items())) for p in points}) == 6
    assert [sample_point(s, n, []) for n in range(6)] == points


def test_bad_spaces_are_refused_naming_the_problem() -> None:
    with pytest.raises(ValidationError, match="may not vary dataset"):
        spec(space={"dataset": {"type": "categorical", "values": ["a@v1"]}})
    with pytest.raises(ValidationError, match="exceeds the grid's 2 points"):
        spec(search={"algorithm": "grid"}, space={"training.seed": {"type": "categorical", "values": [1, 2]}})
    with pytest.raises(ValidationError, match="log-scale range needs low > 0"):
        spec(space={"training.learningRate": {"low": 0, "high": 1, "log": True}})


def test_first_tick_submits_up_to_the_concurrency_limit() -> None:
    record = ExperimentRecord(experiment_id="exp-1", tenant="t", spec=spec(maxConcurrentTrials=2))
    record, actions = step(record, {})
    assert actions == [("submit", 0), ("submit", 1)]
    assert [t.state for t in record.trials] == ["pending", "pending"]
    again, actions = step(record, {})  # the jobs are not there yet: submitted again (idempotent by key)
    assert actions == [("submit", 0), ("submit", 1)] and len(again.trials) == 2


def test_successive_halving_pauses_at_the_rung_then_stops_the_worst_half() -> None:
    record = ExperimentRecord(experiment_id="exp-1", tenant="t", spec=spec())
    record, _ = step(record, {})
    losses = {0: 3.0, 1: 1.0, 2: 4.0, 3: 2.0}
    # trials 0 and 1 reach rung 0 first: they wait (paused), nothing is decided while 2 and 3 have not
    obs = {0: running({0: losses[0]}), 1: running({0: losses[1]}), 2: running(), 3: running()}
    record, actions = step(record, obs)
    assert sorted(actions) == [("pause", 0), ("pause", 1)]
    assert [t.state for t in record.trials] == ["waiting", "waiting", "running", "running"]
    assert record.rung_decisions == []
    # all four at rung 0 (0 and 1 paused): the best half (1, 3) go on, 0 and 2 stop
    obs = {0: running(state="paused"), 1: running(state="paused"), 2: running({0: losses[2]}),
           3: running({0: losses[3]})}
    record, actions = step(record, obs)
    assert record.rung_decisions[0].promoted == [1, 3] and record.rung_decisions[0].stopped == [0, 2]
    assert ("cancel", 0) in actions and ("pause", 2) in actions and ("resume", 1) in actions
    assert ("pause", 3) not in actions  # promoted while still running: it runs on
    stopped = {t.number: t for t in record.trials}
    assert stopped[0].state == stopped[2].state == "stopping"
    assert "rung 0 (step 20)" in (stopped[2].reason or "") and "best 2 of 4" in (stopped[2].reason or "")
    # 2's pause lands: it is cancelled; 0's cancel landed: stopped with the rung's reason
    obs = {0: running(state="cancelled"), 1: running(), 2: running(state="paused"), 3: running()}
    record, actions = step(record, obs)
    assert ("cancel", 2) in actions
    assert record.trials[0].state == "stopped" and "rung 0" in (record.trials[0].reason or "")


def test_the_experiment_completes_with_the_best_finished_trial() -> None:
    s = spec(earlyStopping=None, budget={"maxTrials": 2}, maxConcurrentTrials=2)
    record, _ = step(ExperimentRecord(experiment_id="exp-1", tenant="t", spec=s), {})
    record, _ = step(record, {0: running(state="succeeded", last_value=2.5),
                              1: running(state="succeeded", last_value=1.5)})
    assert record.state == "completed" and record.best_trial == 1


def test_a_spent_budget_stops_every_trial_and_no_new_one_starts() -> None:
    s = spec(earlyStopping=None, budget={"maxTrials": 4, "maxDeviceHours": 1.0}, maxConcurrentTrials=2)
    record, _ = step(ExperimentRecord(experiment_id="exp-1", tenant="t", spec=s), {})
    record, actions = step(record, {0: running(device_hours=0.6), 1: running(device_hours=0.5)})
    assert sorted(actions) == [("pause", 0), ("pause", 1)] and len(record.trials) == 2
    record, actions = step(record, {0: running(state="paused", device_hours=0.6),
                                    1: running(state="paused", device_hours=0.5)})
    assert sorted(actions) == [("cancel", 0), ("cancel", 1)]
    record, _ = step(record, {0: running(state="cancelled", device_hours=0.6),
                              1: running(state="cancelled", device_hours=0.5)})
    assert record.state == "stopped" and "device-hour budget" in (record.reason or "")


def test_a_failed_trial_leaves_the_race_and_the_rung_is_decided_without_it() -> None:
    record, _ = step(ExperimentRecord(experiment_id="exp-1", tenant="t", spec=spec()), {})
    obs = {0: running({0: 1.0}), 1: running(state="failed", reason="oom"), 2: running({0: 2.0}),
           3: running({0: 3.0})}
    record, actions = step(record, obs)
    decision = record.rung_decisions[0]
    assert decision.promoted == [0, 2]
    assert decision.stopped == [3]
    assert record.trials[1].state == "failed" and record.trials[1].reason == "oom"
