"""Calibration from the platform's own measurements: what to sample, what the planner predicted
for it, the fit, and the predicted-vs-measured report. Pure: no Redis, no clock (times come in).

One measurement is a :class:`~trainyard_planner.Sample` (device type, measured, predicted) plus
where it came from. Three kinds, per device type (``resources.gpuType``, canonical):

- **step time**: rank 0's StepMetrics, ``stepSeconds - checkpointSeconds``, against
  ``estimate_step`` of the job as the trainer runs it (the submission check's layout and bytes per
  parameter, see :mod:`trainyard_planner.platform`) on the device (``cpu``: :class:`Assumptions`).
  Skipped: the first ``warmup_steps`` steps of an attempt (allocator, first collectives, caches),
  steps that included a checkpoint, and all but every ``every``-th step, so that one long job does
  not fill the window alone.
- **checkpoint write**: a save step's ``checkpointSeconds`` when above zero (the stall training
  saw: the whole write when saving blocks, the wait when it runs in the background), against
  ``write_seconds(checkpoint_bytes(N, bytes per parameter), assumed bandwidth)``. A save step is
  one the spec's ``everySteps`` (or ``maxSteps``) names: with background saves the steps between
  also report a small stall (the ranks agreeing whether the write is done), which is not a
  save. With ``everyMinutes`` or ``auto`` the spec cannot say, and any stall counts. The warm-up
  steps are skipped here too: a first save pays one-off set-up.
- **failure interval**: an attempt that ended ``failed``, whatever the reason (every interruption
  costs the redo work a checkpoint interval trades against): ``(ended - started) x world size``
  in device-seconds, so jobs of any size pool, against the assumed per-device MTBF. Their mean
  is the per-device MTBF (the maximum-likelihood estimate for exponential failures given failed
  attempts only; attempts that ended otherwise add exposure that is not counted, so it errs short).

The fit is :func:`trainyard_planner.calibrate.fit` over the stored window (the newest samples per
kind and device type), a kind with fewer than ``min_samples`` left out (its factor stays 1).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.events import StepMetrics
from trainyard_contract.records import JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_planner import (
    Calibration,
    DeviceCalibration,
    Sample,
    SampleKind,
    Topology,
    checkpoint_bytes,
    compare,
    estimate_step,
    fit,
    transformer_for,
    write_seconds,
)
from trainyard_planner.platform import (
    DEFAULT_DEVICE_MTBF_HOURS,
    Assumptions,
    device_type_of,
    trainer_bytes_per_parameter,
    trainer_layout,
)
from trainyard_telemetry.steps import step_time

KINDS = tuple(SampleKind)
UNITS = {SampleKind.STEP_TIME: "seconds", SampleKind.CHECKPOINT_WRITE: "seconds",
         SampleKind.FAILURE_INTERVAL: "device-seconds"}


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, protected_namespaces=())

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True)


class Measurement(_Wire):
    """One stored sample and where it came from (the report hides other tenants' job ids)."""

    sample: Sample
    job_id: str
    tenant: str
    attempt: int
    step: int | None = None
    recorded_at: datetime


class StoredCalibration(_Wire):
    """The fitted calibration as kept in Redis (``Calibration.to_dict()`` inside)."""

    calibration: dict = Field(description="Calibration.to_dict()")
    fitted_at: datetime
    min_samples: int

    @property
    def fitted(self) -> Calibration:
        return Calibration.from_dict(self.calibration)


# ----------------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class JobPrediction:
    """What the planner predicts for one job's configuration (None where it cannot: unknown device)."""

    device_type: str
    label: str
    step_seconds: float | None = None
    checkpoint_write_seconds: float | None = None


def describe(spec: TrainingSpec) -> str:
    """The configuration a sample measured: model, layout and batch shape."""
    p, t = spec.parallelism, spec.training
    model = spec.model_config_ref if isinstance(spec.model_config_ref, str) else "inline model"
    return (f"{model}, dp {p.data} x tp {p.tensor} x pp {p.pipeline}, micro {t.micro_batch_size} x seq "
            f"{t.sequence_length} x {spec.grad_accumulation}")


def predict_job(spec: TrainingSpec, config: ModelConfig, assumptions: Assumptions) -> JobPrediction:
    """The planner's step time and checkpoint write time for ``spec`` as the trainer runs it."""
    device_type, label = device_type_of(spec.resources.gpu_type), describe(spec)
    try:
        device = assumptions.device(spec.resources.gpu_type, devices=spec.parallelism.world_size)
        model = transformer_for(config, spec.training.sequence_length)
        bpp = trainer_bytes_per_parameter(spec)
        step = estimate_step(model, trainer_layout(spec), device, Topology.for_device(device),
                             efficiency=assumptions.efficiency, bytes_per_parameter=bpp)
    except (KeyError, ValueError):
        return JobPrediction(device_type, label)  # a device or layout the planner cannot estimate
    write = write_seconds(checkpoint_bytes(model.parameters, bpp), assumptions.write_bandwidth)
    return JobPrediction(device_type, label, step.step_seconds, write)


def attempt_start_step(job: JobRecord, attempt: int) -> int | None:
    """The global step ``attempt`` started from (its checkpoint's), or None when it is not recorded
    (the first attempt starts at 0 even before the scheduler's record is read)."""
    for record in job.attempts:
        if record.attempt == attempt:
            return record.start_checkpoint.global_step if record.start_checkpoint else 0
    return 0 if attempt == 1 else None


# ----------------------------------------------------------------------------- sampling


def step_measurements(
    m: StepMetrics,
    job: JobRecord,
    prediction: JobPrediction,
    start_step: int,
    *,
    now: datetime,
    warmup_steps: int = 2,
    every: int = 1,
) -> list[Measurement]:
    """The samples one rank-0 StepMetrics gives: a step time, a checkpoint write, both or neither."""
    steps_in = m.step - start_step
    if m.rank != 0 or steps_in <= warmup_steps:
        return []
    samples = []
    t = step_time(m)
    if not t.saved and t.work_seconds > 0 and prediction.step_seconds and steps_in % every == 0:
        samples.append(Sample(kind=SampleKind.STEP_TIME, device_type=prediction.device_type,
                              measured=t.work_seconds, predicted=prediction.step_seconds, label=prediction.label))
    save = saves_after(job.spec, m.step)
    if t.saved and save is not False and prediction.checkpoint_write_seconds:
        samples.append(Sample(kind=SampleKind.CHECKPOINT_WRITE, device_type=prediction.device_type,
                              measured=t.stall_seconds, predicted=prediction.checkpoint_write_seconds,
                              label=prediction.label))
    return [Measurement(sample=s, job_id=job.job_id, tenant=job.tenant, attempt=m.attempt, step=m.step,
                        recorded_at=now) for s in samples]


def saves_after(spec: TrainingSpec, step: int) -> bool | None:
    """Whether the trainer checkpoints after ``step`` (as its CheckpointSchedule decides), or None
    when the spec cannot say (``everyMinutes``: the clock decides; ``auto``: the platform's advice)."""
    policy = spec.checkpoint_policy
    if step >= spec.training.max_steps:
        return True
    if policy.every_steps is not None and not policy.auto:
        return step % policy.every_steps == 0
    return None


def failure_measurements(
    job: JobRecord, *, device_mtbf_seconds: float = DEFAULT_DEVICE_MTBF_HOURS * 3600
) -> list[tuple[str, Measurement]]:
    """(``job:attempt``, sample) for every attempt of ``job`` that ended failed."""
    device_type, label = device_type_of(job.spec.resources.gpu_type), describe(job.spec)
    out = []
    for a in job.attempts:
        if a.state != "failed" or a.ended_at is None:
            continue
        seconds = (a.ended_at - a.started_at).total_seconds()
        if seconds <= 0:
            continue
        sample = Sample(kind=SampleKind.FAILURE_INTERVAL, device_type=device_type, measured=seconds * a.world_size,
                        predicted=device_mtbf_seconds,
                        label=f"{label}: failed ({a.failure_reason or 'no reason'}) after {seconds:.0f} s "
                              f"on {a.world_size} devices")
        out.append((f"{job.job_id}:{a.attempt}", Measurement(
            sample=sample, job_id=job.job_id, tenant=job.tenant, attempt=a.attempt, recorded_at=a.ended_at)))
    return out


# ----------------------------------------------------------------------------- fit


def fit_measurements(measurements: Iterable[Measurement], *, min_samples: int = 1) -> Calibration:
    """Per device type, the factors and MTBF of every kind with at least ``min_samples`` samples."""
    groups: dict[tuple[str, SampleKind], list[Sample]] = defaultdict(list)
    for m in measurements:
        groups[(m.sample.device_type, m.sample.kind)].append(m.sample)
    return fit(s for group in groups.values() if len(group) >= min_samples for s in group)


# ----------------------------------------------------------------------------- report


class Row(_Wire):
    """One measurement: measured, the raw prediction, the calibrated one, and their errors."""

    label: str
    job_id: str | None = Field(default=None, description="absent for another tenant's job")
    attempt: int | None = None
    step: int | None = None
    recorded_at: datetime
    measured: float
    predicted: float = Field(description="the planner's raw prediction")
    calibrated: float = Field(description="the prediction corrected by the stored calibration")
    error_pct: float = Field(description="(predicted - measured) / measured x 100")
    calibrated_error_pct: float


class KindReport(_Wire):
    kind: SampleKind
    unit: str
    stored_samples: int = Field(description="samples in the window, newest first below")
    fitted_samples: int = Field(description="samples behind the stored fit (0: not enough yet, factor 1)")
    factor: float | None = Field(default=None, description="measured / predicted (step time, checkpoint write)")
    mtbf_seconds: float | None = Field(default=None, description="per device (failure interval)")
    mean_abs_error_pct: float | None = Field(default=None, description="raw predictions, over the stored samples")
    calibrated_mean_abs_error_pct: float | None = None
    rows: list[Row]


class DeviceReport(_Wire):
    device_type: str
    factors: DeviceCalibration | None = Field(default=None, description="the stored fit; absent before one")
    effective_efficiency: float | None = Field(
        default=None, description="share of the assumed peak the measured steps imply (above 1: the assumed peak "
                                  "is too low, as the cpu default deliberately is)")
    effective_write_bandwidth: float | None = Field(default=None, description="bytes/s the writes imply")
    kinds: list[KindReport]


class AssumptionsView(_Wire):
    cpu_peak_flops: float
    write_bandwidth: float = Field(description="bytes/s checkpoint predictions assume")
    efficiency: float | None = Field(description="the matmuls' share of peak predictions assume; null: each "
                                                 "device's own, by matmul shape (the planner's kernel model)")
    device_mtbf_hours: float


class CalibrationReport(_Wire):
    """``GET /v1/plan/calibration``: per device type, the factors and predicted vs measured."""

    fitted_at: datetime | None
    min_samples: int
    max_samples: int = Field(description="samples kept per device type and kind (the newest)")
    assumptions: AssumptionsView
    devices: list[DeviceReport]


def report(
    measurements: Mapping[str, Sequence[Measurement]],
    stored: StoredCalibration | None,
    *,
    tenant: str,
    assumptions: Assumptions,
    min_samples: int,
    max_samples: int,
    limit: int = 20,
    only: Collection[str] | None = None,
) -> CalibrationReport:
    """The report over ``measurements`` (per device type, newest first) and the stored fit, for
    every device type or ``only`` those."""
    calibration = stored.fitted if stored else Calibration()
    devices = []
    for device_type in sorted(set(measurements) | set(calibration.devices)):
        if only is not None and device_type not in only:
            continue
        fitted = calibration.devices.get(device_type)
        current = calibration.for_device(device_type)
        group = measurements.get(device_type, ())
        kinds = [_kind_report(kind, [m for m in group if m.sample.kind is kind], current, fitted is not None,
                              tenant=tenant, limit=limit) for kind in KINDS]
        devices.append(DeviceReport(
            device_type=device_type, factors=fitted, kinds=kinds,
            effective_efficiency=assumed / current.step_time_factor
            if fitted and (assumed := assumed_share(assumptions, device_type)) else None,
            effective_write_bandwidth=current.effective_bandwidth(assumptions.write_bandwidth) if fitted else None,
        ))
    view = AssumptionsView(cpu_peak_flops=assumptions.cpu_peak_flops, write_bandwidth=assumptions.write_bandwidth,
                           efficiency=assumptions.efficiency, device_mtbf_hours=DEFAULT_DEVICE_MTBF_HOURS)
    return CalibrationReport(fitted_at=stored.fitted_at if stored else None, min_samples=min_samples,
                             max_samples=max_samples, assumptions=view, devices=devices)


def assumed_share(assumptions: Assumptions, device_type: str) -> float | None:
    """The matmuls' share of peak predictions assume for a device type: the configured one, else the device's
    (the planner's kernel model); None for a type the planner does not know."""
    if assumptions.efficiency is not None:
        return assumptions.efficiency
    try:
        return assumptions.device(device_type).matmul_efficiency
    except KeyError:
        return None


def _kind_report(kind: SampleKind, group: list[Measurement], current: DeviceCalibration, fitted: bool, *,
                 tenant: str, limit: int) -> KindReport:
    rows = rows_for(group, current, tenant=tenant)
    failures = kind is SampleKind.FAILURE_INTERVAL
    counts = {SampleKind.STEP_TIME: current.step_time_samples,
              SampleKind.CHECKPOINT_WRITE: current.checkpoint_write_samples,
              SampleKind.FAILURE_INTERVAL: current.failure_samples}
    return KindReport(
        kind=kind, unit=UNITS[kind], stored_samples=len(group), fitted_samples=counts[kind] if fitted else 0,
        factor=None if failures or not fitted else current.factor(kind),
        mtbf_seconds=current.mtbf_seconds if failures else None,
        mean_abs_error_pct=_mean_abs(r.error_pct for r in rows),
        calibrated_mean_abs_error_pct=_mean_abs(r.calibrated_error_pct for r in rows),
        rows=rows[:limit],
    )


def rows_for(group: Sequence[Measurement], current: DeviceCalibration, *, tenant: str) -> list[Row]:
    """Predicted vs measured per measurement; a failure interval's calibrated figure is the fitted MTBF."""
    rows = []
    for m in group:
        if m.sample.predicted is None:
            continue
        if m.sample.kind is SampleKind.FAILURE_INTERVAL:
            calibrated = current.mtbf_seconds or m.sample.predicted
            predicted, errors = m.sample.predicted, (_pct(m.sample.predicted, m.sample.measured),
                                                      _pct(calibrated, m.sample.measured))
        else:
            c = compare([m.sample], Calibration(devices={current.device_type: current}))[0]
            predicted, calibrated, errors = c.predicted, c.calibrated, (c.error_pct, c.calibrated_error_pct)
        own = m.tenant == tenant
        rows.append(Row(
            label=m.sample.label if own else f"another tenant's job ({m.sample.label})",
            job_id=m.job_id if own else None, attempt=m.attempt if own else None, step=m.step,
            recorded_at=m.recorded_at, measured=m.sample.measured, predicted=predicted, calibrated=calibrated,
            error_pct=errors[0], calibrated_error_pct=errors[1],
        ))
    return rows


def _pct(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured * 100.0


def _mean_abs(values: Iterable[float]) -> float | None:
    values = [abs(v) for v in values]
    return math.fsum(values) / len(values) if values else None
