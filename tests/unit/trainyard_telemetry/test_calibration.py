"""The planner's calibration from platform measurements, as pure functions: which StepMetrics and
attempts become samples, what the planner predicted for them, the fit, the predicted-vs-measured
report, and ``POST /v1/plan`` answering raw and calibrated estimates."""

from __future__ import annotations

import copy
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from trainyard_telemetry.calibration import (
    JobPrediction,
    Measurement,
    StoredCalibration,
    attempt_start_step,
    failure_measurements,
    fit_measurements,
    predict_job,
    report,
    saves_after,
    step_measurements,
)
from trainyard_api.planning import PlanRequest, plan, transformer_for
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_contract.errors import SpecError
from trainyard_contract.events import CheckpointRef, StepMetrics
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_planner import (
    FP32_ADAM,
    Calibration,
    DeviceCalibration,
    Sample,
    SampleKind,
    Topology,
    cpu_device,
    estimate_step,
)
from trainyard_planner.platform import (
    DEFAULT_DEVICE_MTBF_HOURS,
    Assumptions,
    device_type_of,
    trainer_bytes_per_parameter,
    trainer_layout,
)

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
ASSUME = Assumptions(cpu_peak_flops=10e9, cpu_memory_bytes=64e9, write_bandwidth=500e6)
TINY = MODEL_CATALOG["gpt-tiny@v1"]
PREDICTED = JobPrediction("cpu", "gpt-tiny@v1, dp 2", step_seconds=0.2, checkpoint_write_seconds=0.01)


def spec(**changes: Any) -> TrainingSpec:
    data = copy.deepcopy(EXAMPLE_SPEC)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for p in parents:
            node = node[p]
        node[leaf] = value
    return TrainingSpec.model_validate(data)


def job(*attempts: AttemptRecord, tenant: str = "tenant-a", gpu: str = "cpu") -> JobRecord:
    return JobRecord(job_id="job-1", tenant=tenant, spec=spec(**{"resources.gpuType": gpu}), spec_hash="h",
                     attempts=list(attempts))


def attempt(n: int, *, state: str = "running", minutes: float | None = None, world: int = 2,
            start_step: int | None = None) -> AttemptRecord:
    started = NOW - timedelta(hours=n)
    ref = CheckpointRef(manifest_uri="file:///m.json", global_step=start_step, attempt=n - 1) if start_step else None
    return AttemptRecord(attempt=n, allocation_id=f"alloc-{n}", epoch=n, state=state, world_size=world,
                         started_at=started, ended_at=started + timedelta(minutes=minutes) if minutes else None,
                         start_checkpoint=ref, failure_reason="oom" if state == "failed" else None)


def metrics(step: int, *, seconds: float = 0.1, checkpoint: float = 0.0, rank: int = 0,
            attempt: int = 1) -> StepMetrics:
    return StepMetrics(job_id="job-1", attempt=attempt, rank=rank, step=step, loss=1.0, consumed_tokens=step,
                       step_seconds=seconds, checkpoint_seconds=checkpoint)


def measured(kind: SampleKind, value: float, predicted: float, *, device: str = "cpu", tenant: str = "tenant-a",
             step: int | None = 5) -> Measurement:
    return Measurement(sample=Sample(kind=kind, device_type=device, measured=value, predicted=predicted,
                                     label="gpt-tiny@v1"), job_id="job-1", tenant=tenant, attempt=1, step=step,
                       recorded_at=NOW)


# ----------------------------------------------------------------------------- predictions


def test_the_prediction_is_the_planners_step_for_the_job_as_the_trainer_runs_it() -> None:
    example = spec()
    got = predict_job(example, TINY, ASSUME)
    device = cpu_device(10e9, 64e9, devices_per_node=2)
    expected = estimate_step(transformer_for(TINY, 64), trainer_layout(example), device, Topology.for_device(device),
                             bytes_per_parameter=trainer_bytes_per_parameter(example))
    assert got.device_type == "cpu" and got.step_seconds == pytest.approx(expected.step_seconds, rel=1e-12)
    # weights and AdamW's m and v in fp32 (gradients are not saved): 12 B per parameter
    assert got.checkpoint_write_seconds == pytest.approx(12 * TINY.num_parameters / 500e6, rel=1e-12)
    assert FP32_ADAM.total - FP32_ADAM.gradients == 12
    assert got.label == "gpt-tiny@v1, dp 2 x tp 1 x pp 1, micro 8 x seq 64 x 2"


def test_the_cpu_peak_is_an_assumption_and_a_gpu_uses_its_datasheet() -> None:
    slow = predict_job(spec(), TINY, ASSUME)
    fast = predict_job(spec(), TINY, Assumptions(cpu_peak_flops=40e9, cpu_memory_bytes=64e9))
    assert fast.step_seconds is not None and slow.step_seconds is not None and fast.step_seconds < slow.step_seconds
    h100 = predict_job(spec(**{"resources.gpuType": "H100"}), TINY, ASSUME)
    assert h100.device_type == "h100-80gb" and h100.step_seconds is not None and h100.step_seconds < fast.step_seconds


def test_an_unknown_device_type_has_no_prediction_but_keeps_its_name() -> None:
    got = predict_job(spec(**{"resources.gpuType": "TPU-v9"}), TINY, ASSUME)
    assert got == JobPrediction("tpu-v9", got.label)
    assert device_type_of(" CPU ") == "cpu" and device_type_of("a100") == "a100-80gb"


@pytest.mark.parametrize(("attempts", "number", "expected"), [
    ((), 1, 0),                                         # the scheduler's record not read yet: step 0
    ((), 2, None),                                      # a later attempt without a record: unknown
    ((attempt(1),), 1, 0),
    ((attempt(1, state="failed", minutes=5), attempt(2, start_step=20)), 2, 20),
])
def test_an_attempt_starts_at_its_checkpoint(attempts: tuple[AttemptRecord, ...], number: int,
                                             expected: int | None) -> None:
    assert attempt_start_step(job(*attempts), number) == expected


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize(("m", "start", "every", "kinds"), [
    (metrics(1), 0, 1, []),                                        # warm-up
    (metrics(2), 0, 1, []),                                        # warm-up
    (metrics(3), 0, 1, ["step_time"]),
    (metrics(22), 20, 1, []),                                      # warm-up of a resumed attempt
    (metrics(23), 20, 1, ["step_time"]),
    (metrics(9, rank=1), 0, 1, []),                                # rank 0 only
    (metrics(20, seconds=0.5, checkpoint=0.4), 0, 1, ["checkpoint_write"]),  # everySteps 20: no step time
    (metrics(40, seconds=0.5, checkpoint=0.4), 0, 1, ["checkpoint_write"]),  # the save at maxSteps
    (metrics(21, seconds=0.1, checkpoint=0.002), 0, 1, []),        # a background save's agreement: neither
    (metrics(2, seconds=0.5, checkpoint=0.4), 0, 1, []),           # a warm-up checkpoint pays set-up
    (metrics(7), 0, 5, []),                                        # every 5th step only
    (metrics(10), 0, 5, ["step_time"]),
    (metrics(5, seconds=0.0), 0, 1, []),                           # nothing measured
])
def test_which_steps_become_samples(m: StepMetrics, start: int, every: int, kinds: list[str]) -> None:
    got = step_measurements(m, job(), PREDICTED, start, now=NOW, warmup_steps=2, every=every)
    assert [x.sample.kind.value for x in got] == kinds
    for x in got:
        assert (x.job_id, x.tenant, x.attempt, x.step, x.recorded_at) == ("job-1", "tenant-a", 1, m.step, NOW)


def test_a_step_sample_is_the_step_without_its_checkpoint_against_the_prediction() -> None:
    step = step_measurements(metrics(3, seconds=0.06), job(), PREDICTED, 0, now=NOW)[0].sample
    assert (step.kind, step.device_type, step.measured, step.predicted) == (SampleKind.STEP_TIME, "cpu", 0.06, 0.2)
    write = step_measurements(metrics(20, seconds=0.5, checkpoint=0.4), job(), PREDICTED, 0, now=NOW)[0].sample
    assert (write.kind, write.measured, write.predicted) == (SampleKind.CHECKPOINT_WRITE, 0.4, 0.01)


@pytest.mark.parametrize(("policy", "step", "expected"), [
    ({"everySteps": 20}, 20, True),
    ({"everySteps": 20}, 30, False),
    ({"everySteps": 20}, 40, True),                 # maxSteps
    ({"everyMinutes": 5}, 30, None),                # the clock decides
    ({"auto": True, "everySteps": 20}, 30, None),   # the platform's advice decides
    ({"everyMinutes": 5}, 40, True),
])
def test_a_save_step_is_what_the_spec_names_or_unknown(policy: dict, step: int, expected: bool | None) -> None:
    assert saves_after(spec(checkpointPolicy=policy), step) is expected


def test_when_the_spec_cannot_say_any_stall_is_a_save() -> None:
    timed = JobRecord(job_id="job-1", tenant="t", spec=spec(checkpointPolicy={"everyMinutes": 5}), spec_hash="h")
    got = step_measurements(metrics(21, checkpoint=0.002), timed, PREDICTED, 0, now=NOW)
    assert [m.sample.kind for m in got] == [SampleKind.CHECKPOINT_WRITE]


def test_without_a_prediction_nothing_is_sampled() -> None:
    unknown = JobPrediction("tpu-v9", "x")
    assert step_measurements(metrics(5), job(), unknown, 0, now=NOW) == []
    assert step_measurements(metrics(20, seconds=1, checkpoint=0.5), job(), unknown, 0, now=NOW) == []


def test_failed_attempts_give_device_time_between_failures() -> None:
    record = job(attempt(1, state="failed", minutes=30, world=8), attempt(2, state="revoked", minutes=10),
                 attempt(3, state="failed", minutes=90, world=8), attempt(4, state="running"), gpu="h100")
    got = failure_measurements(record)
    assert [i for i, _ in got] == ["job-1:1", "job-1:3"]
    samples = [m.sample for _, m in got]
    assert [s.measured for s in samples] == [30 * 60 * 8, 90 * 60 * 8]
    assert {s.device_type for s in samples} == {"h100-80gb"}
    assert {s.predicted for s in samples} == {DEFAULT_DEVICE_MTBF_HOURS * 3600}
    assert "failed (oom) after 1800 s on 8 devices" in samples[0].label
    assert got[0][1].recorded_at == record.attempts[0].ended_at


# ----------------------------------------------------------------------------- fit


def test_the_fit_is_the_geometric_mean_per_kind_once_a_kind_has_enough_samples() -> None:
    data = [measured(SampleKind.STEP_TIME, v, 0.2) for v in (0.05, 0.1, 0.2)]
    data += [measured(SampleKind.CHECKPOINT_WRITE, 0.4, 0.01)] * 2                       # too few
    data += [measured(SampleKind.FAILURE_INTERVAL, v, 1e8) for v in (100.0, 200.0, 600.0)]
    data += [measured(SampleKind.STEP_TIME, 1.0, 0.5, device="h100-80gb")]               # too few
    cal = fit_measurements(data, min_samples=3)
    cpu = cal.devices["cpu"]
    assert cpu.step_time_factor == pytest.approx(math.exp(math.log(0.25 * 0.5 * 1.0) / 3))
    assert (cpu.step_time_samples, cpu.checkpoint_write_samples, cpu.checkpoint_write_factor) == (3, 0, 1.0)
    assert (cpu.mtbf_seconds, cpu.failure_samples) == (300.0, 3)
    assert set(cal.devices) == {"cpu"}
    assert fit_measurements(data, min_samples=1).devices["h100-80gb"].step_time_factor == pytest.approx(2.0)


# ----------------------------------------------------------------------------- report


def stored(cal: Calibration) -> StoredCalibration:
    return StoredCalibration(calibration=cal.to_dict(), fitted_at=NOW, min_samples=3)


def test_the_report_shows_predicted_raw_and_calibrated_against_measured() -> None:
    data = {"cpu": [measured(SampleKind.STEP_TIME, v, 0.2, step=s) for s, v in ((9, 0.1), (8, 0.1), (7, 0.1))]
            + [measured(SampleKind.FAILURE_INTERVAL, 3600.0, 7200.0, step=None)]}
    cal = Calibration(devices={"cpu": DeviceCalibration(device_type="cpu", step_time_factor=0.5,
                                                        step_time_samples=3, mtbf_seconds=4000.0, failure_samples=1)})
    got = report(data, stored(cal), tenant="tenant-a", assumptions=ASSUME, min_samples=3, max_samples=200, limit=2)
    device = got.devices[0]
    assert got.fitted_at == NOW and device.device_type == "cpu" and device.factors is not None
    # the cpu device's own matmul share (1: its peak is what one rank's matmuls reach) over the step factor 0.5
    assert device.effective_efficiency == pytest.approx(2.0) and device.effective_write_bandwidth == 500e6
    steps, writes, failures = device.kinds
    assert (steps.stored_samples, steps.fitted_samples, steps.factor, len(steps.rows)) == (3, 3, 0.5, 2)
    row = steps.rows[0]
    assert (row.step, row.measured, row.predicted, row.calibrated) == (9, 0.1, 0.2, pytest.approx(0.1))
    assert (row.error_pct, row.calibrated_error_pct) == (pytest.approx(100.0), pytest.approx(0.0))
    assert steps.mean_abs_error_pct == pytest.approx(100.0) and steps.calibrated_mean_abs_error_pct == pytest.approx(0)
    assert writes.rows == [] and writes.mean_abs_error_pct is None
    assert failures.unit == "device-seconds" and failures.mtbf_seconds == 4000.0 and failures.factor is None
    only = failures.rows[0]
    assert (only.predicted, only.calibrated, only.error_pct) == (7200.0, 4000.0, pytest.approx(100.0))


def test_another_tenants_samples_count_but_their_job_ids_are_hidden() -> None:
    data = {"cpu": [measured(SampleKind.STEP_TIME, 0.1, 0.2, tenant="tenant-b")]}
    row = report(data, None, tenant="tenant-a", assumptions=ASSUME, min_samples=3, max_samples=200).devices[0]
    assert row.factors is None and row.effective_efficiency is None
    hidden = row.kinds[0].rows[0]
    assert hidden.job_id is None and hidden.attempt is None and hidden.label.startswith("another tenant's job")
    mine = report(data, None, tenant="tenant-b", assumptions=ASSUME, min_samples=3, max_samples=200)
    assert mine.devices[0].kinds[0].rows[0].job_id == "job-1"


def test_the_report_can_be_narrowed_to_one_device_type() -> None:
    data = {"cpu": [measured(SampleKind.STEP_TIME, 0.1, 0.2)],
            "h100-80gb": [measured(SampleKind.STEP_TIME, 0.1, 0.2, device="h100-80gb")]}
    got = report(data, None, tenant="t", assumptions=ASSUME, min_samples=3, max_samples=200, only=["h100-80gb"])
    assert [d.device_type for d in got.devices] == ["h100-80gb"]


# ----------------------------------------------------------------------------- POST /v1/plan


def cpu_plan(calibration: Calibration | None, **changes: Any) -> dict[str, Any]:
    body = {"model": "gpt-tiny@v1", "device": "cpu", "sequenceLength": 64, "precision": "fp32",
            "layout": {"dp": 2, "microBatch": 8, "microbatches": 2, "recompute": "selective"}, **changes}
    answer = plan(PlanRequest.model_validate(body), assumptions=ASSUME, calibration=calibration, fitted_at=NOW)
    return answer.model_dump(mode="json", by_alias=True, exclude_none=True)


CPU = Calibration(devices={"cpu": DeviceCalibration(
    device_type="cpu", step_time_factor=0.4, step_time_samples=12, checkpoint_write_factor=5.0,
    checkpoint_write_samples=4, mtbf_seconds=36_000.0, failure_samples=3)})


def test_cpu_is_a_device_type_from_the_assumed_peak_and_matches_the_job_prediction() -> None:
    body = cpu_plan(None)
    assert body["device"]["peakFlops"] == 10e9 and body["device"]["nvlinkDomain"] == 2
    assert body["step"]["stepSeconds"] == pytest.approx(predict_job(spec(), TINY, ASSUME).step_seconds, rel=1e-12)
    assert "calibrated" not in body
    with pytest.raises(SpecError, match="cpu; or give the device inline"):
        plan(PlanRequest.model_validate({"model": "gpt-tiny@v1", "device": "tpu-v9"}))


def test_the_answer_shows_raw_and_calibrated_estimates_and_which_calibration() -> None:
    body = cpu_plan(CPU, tokens=1e6, checkpoint={"writeBandwidth": 500e6})
    raw, got = body["step"], body["calibrated"]
    assert got["calibration"] == {"deviceType": "cpu", "fittedAt": "2025-03-01T12:00:00Z",
                                  "factors": CPU.devices["cpu"].wire()}
    assert got["rawStepSeconds"] == raw["stepSeconds"]
    assert got["calibratedStepSeconds"] == pytest.approx(0.4 * raw["stepSeconds"])
    assert got["calibratedTokensPerSecond"] == pytest.approx(raw["tokensPerSecond"] / 0.4)
    assert got["calibratedMfu"] == pytest.approx(raw["mfu"] / 0.4)
    # the share of peak the step's matmuls were assumed to reach (thin ones: gpt-tiny), over the step factor
    share = raw["stage"]["matmulEfficiency"]
    assert got["effectiveEfficiency"] == pytest.approx(share / 0.4)
    assert any("x the peak assumed for cpu" in n for n in got["notes"]) == (share / 0.4 > 1)
    assert got["trainingTime"]["seconds"] == pytest.approx(0.4 * body["compute"]["trainingTime"]["seconds"])
    # checkpoint: 5x the write time, and the measured MTBF (per device) since the request gave none
    assert got["rawCheckpointWriteSeconds"] == body["checkpoint"]["writeSeconds"]
    assert got["calibratedCheckpointWriteSeconds"] == pytest.approx(5 * body["checkpoint"]["writeSeconds"])
    assert got["checkpoint"]["writeSeconds"] == pytest.approx(5 * body["checkpoint"]["writeSeconds"])
    assert got["checkpoint"]["mtbfSeconds"] == pytest.approx(36_000.0 / 2)
    assert body["checkpoint"]["mtbfSeconds"] == pytest.approx(DEFAULT_DEVICE_MTBF_HOURS * 3600 / 2)
    assert any("step time x 0.4" in n and "12 samples on cpu" in n for n in got["notes"])
    assert any(n.startswith("MTBF: measured 10 device-hours") for n in got["notes"])


def test_a_given_mtbf_or_mfu_is_kept_and_calibrate_false_leaves_the_answer_raw() -> None:
    got = cpu_plan(CPU, tokens=1e6, mfu=0.3, checkpoint={"writeBandwidth": 500e6, "mtbfSeconds": 999.0})
    assert got["calibrated"]["checkpoint"]["mtbfSeconds"] == 999.0 and "trainingTime" not in got["calibrated"]
    assert "calibrated" not in cpu_plan(CPU, calibrate=False)
    h100 = plan(PlanRequest.model_validate({"model": "gpt-tiny@v1", "device": "h100"}), calibration=CPU)
    assert h100.calibrated is None  # measured on cpu only


def test_a_device_without_step_samples_is_left_as_predicted_and_says_so() -> None:
    only_writes = Calibration(devices={"cpu": DeviceCalibration(device_type="cpu", checkpoint_write_factor=2.0,
                                                                checkpoint_write_samples=3)})
    got = cpu_plan(only_writes)["calibrated"]
    assert got["calibratedStepSeconds"] == got["rawStepSeconds"]
    assert "step time: not measured on cpu yet, left as predicted" in got["notes"]
