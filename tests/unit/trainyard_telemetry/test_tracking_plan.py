"""The tracking exporter's pure decisions, table-driven: targets, the next span from a cursor and the history fence
(a resumed attempt's rewrites send the exporter back), metric keys, MLflow batches, params and tags; and the event
files it encodes, read back by tensorboard's own EventAccumulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.api import spec_with
from trainyard_contract.records import ExperimentOrigin, JobRecord
from trainyard_contract.spec import TrainingSpec, Tracking
from trainyard_contract.tracking import TenantTracking, mlflow_uri_problem
from trainyard_telemetry.tfevents import by_step, crc32c, event_file
from trainyard_telemetry.tracking import metric_batches
from trainyard_telemetry.tracking_plan import (
    MLFLOW_BATCH, Cursor, Span, eval_points, experiment_name, metric_key, next_span, run_params, run_status, run_tags,
    series_keys, targets_of,
)

BOTH = TenantTracking(mlflow_uri="http://mlflow:5000", tensorboard=True)


@pytest.mark.parametrize(("tenant", "tracking", "expected"), [
    (None, None, ()),
    (TenantTracking(), None, ()),
    (BOTH, None, ("mlflow", "tensorboard")),
    (BOTH, Tracking(mlflow=False), ("tensorboard",)),
    (BOTH, Tracking(tensorboard=False), ("mlflow",)),
    (TenantTracking(tensorboard=True), Tracking(mlflow=True), ("tensorboard",)),
])
def test_targets_are_the_tenants_less_those_the_job_turned_off(tenant: TenantTracking | None,
                                                                tracking: Tracking | None,
                                                                expected: tuple[str, ...]) -> None:
    assert targets_of(tenant, tracking) == expected


def fence(*values: int) -> np.ndarray:
    return np.array(values, dtype="<u2")


@pytest.mark.parametrize(("cursor", "fence_", "base", "max_steps", "expected"), [
    (Cursor(), fence(), 0, 10, None),                                       # nothing stored
    (Cursor(), fence(1, 1, 1), 0, 10, Span(0, 2, False, 1)),                 # all of it
    (Cursor(), fence(1, 1, 1, 1, 1), 0, 2, Span(0, 1, False, 1)),            # a piece at a time
    (Cursor(step=3, attempt=1), fence(1, 1, 1), 0, 10, None),                # caught up
    (Cursor(step=3, attempt=1), fence(1, 1, 1, 0, 1), 0, 10, Span(3, 4, False, 1)),  # a gap is no stop
    (Cursor(step=4, attempt=1), fence(1, 1, 2, 2, 2), 0, 10, Span(2, 4, True, 2)),   # attempt 2 replayed from 2
    (Cursor(step=4, attempt=2), fence(1, 1, 2, 2, 2), 0, 10, Span(4, 4, False, 2)),  # … and was sent
    (Cursor(step=20, attempt=1), fence(1, 3, 3), 18, 10, Span(19, 20, True, 3)),     # a window from base
    # attempt 2 resumed at 2 and reached 3; 4 and 5 are attempt 1's stale tail: wait there while the job runs
    (Cursor(step=6, attempt=1), fence(1, 1, 2, 2, 1, 1), 0, 10, Span(2, 3, True, 2)),
    (Cursor(step=4, attempt=2), fence(1, 1, 2, 2, 1, 1), 0, 10, None),
    (Cursor(step=4, attempt=2), fence(1, 1, 2, 2, 2, 1), 0, 10, Span(4, 4, False, 2)),
])
def test_the_next_span_follows_the_cursor_and_goes_back_for_a_replay(cursor: Cursor, fence_: np.ndarray, base: int,
                                                                      max_steps: int, expected: Span | None) -> None:
    assert next_span(cursor, fence_, base, max_steps) == expected


def test_a_settled_jobs_stale_tail_goes_too() -> None:
    assert next_span(Cursor(step=4, attempt=2), fence(1, 1, 2, 2, 1, 1), 0, 10, settled=True) == Span(4, 5, False, 2)


def test_a_cursor_survives_its_json() -> None:
    cursor = Cursor(step=7, attempt=2, files=3, run_id="abc", evals=("job-e",), ended="failed")
    assert Cursor.loads(cursor.dumps()) == cursor
    assert Cursor.loads(None) == Cursor()


def test_series_keys_put_curves_under_train_and_timing_under_system() -> None:
    keys = series_keys(["gradNorm", "../x", "loss"])
    assert keys["loss"] == "train/loss" and keys["gradNorm"] == "train/gradNorm" and keys["../x"] == "train/__/x"
    assert keys["stepSeconds"] == "system/stepSeconds"
    assert metric_key("eval", "x" * 65) is None and metric_key("eval", "a b") is None


def test_mlflow_batches_hold_whole_steps_and_at_most_1000_points() -> None:
    steps = np.arange(10, 300)
    points = {f"train/s{i}": (steps, steps * 1.0) for i in range(7)}  # 7 points a step: 142 steps a batch
    batches = metric_batches(points, 10, 305)
    assert all(0 < len(b) <= MLFLOW_BATCH for b, _ in batches)
    assert sum(len(b) for b, _ in batches) == 7 * 290
    ends = [end for _, end in batches]
    assert ends[-1] == 305 and ends == sorted(ends)
    for (batch, end), (after, _) in zip(batches, batches[1:], strict=False):
        assert max(s for _, _, s in batch) <= end < min(s for _, _, s in after)
    assert metric_batches({}, 3, 9) == [([], 9)]


def _job(**spec: object) -> JobRecord:
    parsed = TrainingSpec.model_validate(spec_with(**spec))
    return JobRecord(job_id="job-1", tenant="team", spec=parsed, spec_hash=parsed.spec_hash(), state="running",
                     experiment=ExperimentOrigin(experiment_id="exp-9", experiment_name="sweep", trial=2,
                                                 params={"lr": 0.1}))


def test_the_run_carries_the_specs_training_fields_the_trial_and_the_job() -> None:
    job = _job(**{"code": None})
    params = run_params(job.spec.wire(), job.experiment)
    assert params["training.learningRate"] == str(job.spec.training.learning_rate)
    assert params["training.optimizer.name"] == "adamw" and params["dataset"] == job.spec.dataset
    assert params["trial.lr"] == "0.1" and not any(k.startswith("code.") for k in params)
    tags = run_tags(job)
    assert tags == {"trainyard.jobId": "job-1", "trainyard.tenant": "team", "trainyard.specHash": job.spec_hash,
                    "trainyard.state": "running", "trainyard.experimentId": "exp-9", "trainyard.trial": "2"}
    assert experiment_name(job) == "team/sweep"
    assert experiment_name(_job(tracking={"experimentName": "mine"})) == "team/mine"
    assert [run_status(s) for s in ("succeeded", "failed", "cancelled", "running")] == [
        "FINISHED", "FAILED", "KILLED", None]


def test_a_spec_without_tracking_keeps_its_hash() -> None:
    plain = TrainingSpec.model_validate(spec_with())
    assert "tracking" not in plain.wire()
    assert TrainingSpec.model_validate(spec_with(tracking={"mlflow": False})).spec_hash() != plain.spec_hash()


def test_evaluations_become_eval_points_in_step_order() -> None:
    raw = {"job-b": '{"globalStep": 20, "metrics": {"loss": 1.5, "../p": 2.0}}',
           "job-a": '{"globalStep": 10, "metrics": {"loss": 2.5, "bad\\nname": 1.0}}',
           "job-c": "not json", "job-d": '{"globalStep": 5, "metrics": {}}'}
    points = eval_points(raw)
    assert [(p.evaluation_job_id, p.step, p.values) for p in points] == [
        ("job-a", 10, {"eval/loss": 2.5}), ("job-b", 20, {"eval/loss": 1.5, "eval/__/p": 2.0})]


@pytest.mark.parametrize(("uri", "ok"), [
    ("http://mlflow:5000", True), ("https://mlflow.example.com/prefix", True), ("http://127.0.0.1:5000", True),
    ("http://10.0.0.5", True), ("http://169.254.169.254", False), ("http://[fd00:ec2::254]/", False),
    ("http://metadata.google.internal./", False), ("ftp://x", False), ("http://u:p@x", False), ("http://x:0", False),
    ("http://x:99999", False), ("//x", False),
])
def test_an_mlflow_uri_is_http_to_a_host_that_is_no_metadata_service(uri: str, ok: bool) -> None:
    assert (mlflow_uri_problem(uri) is None) == ok, mlflow_uri_problem(uri)


def test_event_files_read_back_with_tensorboards_reader_restart_included(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    run = tmp_path / "train"
    run.mkdir()
    steps = list(range(100))
    (run / "events.out.tfevents.0000000000.trainyard").write_bytes(
        event_file(1.0, by_step({"train/loss": (steps, [1.0 / (s + 1) for s in steps]), "train/x": ([5], [-2.0])})))
    (run / "events.out.tfevents.0000000001.trainyard").write_bytes(
        event_file(2.0, by_step({"train/loss": ([50, 51], [42.0, 43.0])}), restart_at=50))
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == list(range(52)) and loss[51] == 43.0 and loss[49] == pytest.approx(1 / 50)
    assert [(e.step, e.value) for e in acc.Scalars("train/x")] == [(5, -2.0)]
