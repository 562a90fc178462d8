"""Calibration: correct the planner's estimates per device type from what the platform measured.

Samples are (predicted, measured) pairs of step time and checkpoint write time, and measured
intervals between failures. Per device type:

- a correction factor per kind, the geometric mean of ``measured / predicted`` (a least-squares
  fit in log space, so one slow outlier does not dominate and over- and under-estimates weigh the
  same); the step-time factor turns the assumed compute efficiency into an effective one, the
  write-time factor the assumed write bandwidth into an effective one;
- the MTBF, the mean of the measured intervals (the maximum-likelihood estimate for exponentially
  distributed failures).

Fitting again with a ``prior`` pools the old fit and the new samples, weighted by sample counts.
This module only computes; storing the result (:meth:`Calibration.to_dict`) is the caller's job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import StrEnum

from pydantic import Field

from trainyard_planner._private import Model


class SampleKind(StrEnum):
    STEP_TIME = "step_time"
    CHECKPOINT_WRITE = "checkpoint_write"
    FAILURE_INTERVAL = "failure_interval"


class Sample(Model):
    """One measurement, in seconds, with the planner's prediction for it when there is one."""

    kind: SampleKind
    device_type: str
    measured: float = Field(gt=0)
    predicted: float | None = Field(default=None, gt=0)
    label: str = ""


class DeviceCalibration(Model):
    device_type: str
    step_time_factor: float = Field(default=1.0, gt=0, description="measured / predicted step time")
    step_time_samples: int = 0
    checkpoint_write_factor: float = Field(default=1.0, gt=0, description="measured / predicted write time")
    checkpoint_write_samples: int = 0
    mtbf_seconds: float | None = None
    failure_samples: int = 0

    def factor(self, kind: SampleKind | str) -> float:
        kind = SampleKind(kind)
        if kind is SampleKind.STEP_TIME:
            return self.step_time_factor
        if kind is SampleKind.CHECKPOINT_WRITE:
            return self.checkpoint_write_factor
        return 1.0

    def correct(self, kind: SampleKind | str, predicted: float) -> float:
        """A prediction corrected by this device type's factor for ``kind``."""
        return predicted * self.factor(kind)

    def effective_efficiency(self, assumed: float) -> float:
        """The compute efficiency (share of peak) that reproduces the measured step times."""
        return min(1.0, assumed / self.step_time_factor)

    def effective_bandwidth(self, assumed: float) -> float:
        """The checkpoint write bandwidth that reproduces the measured write times."""
        return assumed / self.checkpoint_write_factor


class Calibration(Model):
    devices: dict[str, DeviceCalibration] = Field(default_factory=dict)

    def for_device(self, device_type: str) -> DeviceCalibration:
        """The device type's calibration, or the identity when nothing was measured on it."""
        return self.devices.get(device_type) or DeviceCalibration(device_type=device_type)

    def to_dict(self) -> dict:
        return self.wire()

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        return cls.model_validate(data)


class Comparison(Model):
    """Predicted against measured for one sample, before and after calibration."""

    label: str
    kind: SampleKind
    device_type: str
    predicted: float
    measured: float
    error_pct: float = Field(description="(predicted - measured) / measured x 100")
    calibrated: float
    calibrated_error_pct: float


def fit(samples: Iterable[Sample], *, prior: Calibration | None = None) -> Calibration:
    """Correction factors and MTBF per device type from ``samples`` (pooled with ``prior``)."""
    by_device: dict[str, list[Sample]] = {}
    for sample in samples:
        by_device.setdefault(sample.device_type, []).append(sample)
    devices = dict(prior.devices) if prior else {}
    for device_type, group in by_device.items():
        start = devices.get(device_type) or DeviceCalibration(device_type=device_type)
        devices[device_type] = _fit_device(group, start)
    return Calibration(devices=devices)


def compare(samples: Iterable[Sample], calibration: Calibration | None = None) -> list[Comparison]:
    """Predicted vs measured (and calibrated vs measured) for every sample with a prediction."""
    calibration = calibration or Calibration()
    rows = []
    for s in samples:
        if s.predicted is None:
            continue
        calibrated = calibration.for_device(s.device_type).correct(s.kind, s.predicted)
        rows.append(Comparison(
            label=s.label, kind=s.kind, device_type=s.device_type, predicted=s.predicted,
            measured=s.measured, error_pct=_error_pct(s.predicted, s.measured), calibrated=calibrated,
            calibrated_error_pct=_error_pct(calibrated, s.measured),
        ))
    return rows


def within(comparisons: Iterable[Comparison], tolerance_pct: float = 15.0, *, calibrated: bool = False) -> bool:
    """Whether every comparison is within ``±tolerance_pct`` (raw predictions unless ``calibrated``)."""
    return all(abs(c.calibrated_error_pct if calibrated else c.error_pct) <= tolerance_pct for c in comparisons)


def _fit_device(samples: list[Sample], prior: DeviceCalibration) -> DeviceCalibration:
    step_factor, step_n = _pooled_factor(samples, SampleKind.STEP_TIME, prior.step_time_factor, prior.step_time_samples)
    write_factor, write_n = _pooled_factor(
        samples, SampleKind.CHECKPOINT_WRITE, prior.checkpoint_write_factor, prior.checkpoint_write_samples)
    intervals = [s.measured for s in samples if s.kind is SampleKind.FAILURE_INTERVAL]
    failures = prior.failure_samples + len(intervals)
    mtbf = prior.mtbf_seconds
    if intervals:
        prior_total = (prior.mtbf_seconds or 0.0) * prior.failure_samples
        mtbf = (prior_total + sum(intervals)) / failures
    return DeviceCalibration(
        device_type=prior.device_type, step_time_factor=step_factor, step_time_samples=step_n,
        checkpoint_write_factor=write_factor, checkpoint_write_samples=write_n,
        mtbf_seconds=mtbf, failure_samples=failures,
    )


def _pooled_factor(samples: list[Sample], kind: SampleKind, prior_factor: float, prior_n: int) -> tuple[float, int]:
    logs = [math.log(s.measured / s.predicted) for s in samples if s.kind is kind and s.predicted]
    n = prior_n + len(logs)
    if not logs:
        return prior_factor, prior_n
    return math.exp((prior_n * math.log(prior_factor) + sum(logs)) / n), n


def _error_pct(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured * 100.0
