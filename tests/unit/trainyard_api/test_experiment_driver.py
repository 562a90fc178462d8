"""The experiments driver's pure helpers: device-hours of a job, the smoothed metric, whose job a trial's is."""

from __future__ import annotations

import math
import struct
from datetime import UTC, datetime, timedelta

from trainyard_api.experiment_driver import SMOOTHING, device_hours, is_trial_job, smoothed
from trainyard_contract.records import AttemptRecord, ExperimentOrigin, JobRecord
from trainyard_contract.spec import TrainingSpec
from tests.support.api import spec_with

T0 = datetime(2026, 12, 5, 10, tzinfo=UTC)


def job(**over: object) -> JobRecord:
    spec = TrainingSpec.model_validate(spec_with())
    return JobRecord(job_id="job-1", tenant="t", spec=spec, spec_hash=spec.spec_hash(), **over)  # type: ignore[arg-type]


def test_device_hours_count_every_attempt_times_its_devices_a_running_one_up_to_now() -> None:
    attempts = [AttemptRecord(attempt=1, allocation_id="a", epoch=1, world_size=2, state="failed", started_at=T0,
                              ended_at=T0 + timedelta(minutes=30)),
                AttemptRecord(attempt=2, allocation_id="b", epoch=1, world_size=2, state="running",
                              started_at=T0 + timedelta(hours=1))]
    j = job(attempts=attempts)
    gpus = j.spec.resources.gpu_count
    assert math.isclose(device_hours(j, T0 + timedelta(hours=2)), 1.5 * gpus)


def test_smoothed_is_the_mean_of_the_last_values_present() -> None:
    values = [float("nan"), 9.0, *[1.0] * (SMOOTHING - 1), float("nan"), 3.0]
    raw = b"".join(struct.pack("<f", v) for v in values)
    assert math.isclose(smoothed(raw) or 0, (1.0 * (SMOOTHING - 1) + 3.0) / SMOOTHING)
    assert smoothed(struct.pack("<f", float("nan"))) is None and smoothed(b"") is None
    assert smoothed(raw + b"\x00") is not None  # a torn tail is ignored


def test_a_job_is_a_trials_only_when_it_names_the_experiment_and_the_trial() -> None:
    origin = ExperimentOrigin(experiment_id="exp-1", experiment_name="lr", trial=2, params={"x": 1})
    assert is_trial_job(job(experiment=origin), "exp-1", 2)
    assert not is_trial_job(job(experiment=origin), "exp-1", 3)
    assert not is_trial_job(job(experiment=origin), "exp-2", 2)
    assert not is_trial_job(job(), "exp-1", 2)
