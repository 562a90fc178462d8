"""The telemetry service's settings: ``TRAINYARD_*`` variables, parsed once in ``main()``.

The calibration and goodput variables keep the names they had when the API ran the ingest
(``TRAINYARD_CALIBRATION_*``, ``TRAINYARD_GOODPUT_*``), so an existing configuration means the same."""

from __future__ import annotations

from typing import Protocol

from pydantic import Field

from trainyard_contract.settings import ServiceSettings
from trainyard_planner.platform import DEFAULT_CPU_PEAK_FLOPS, DEFAULT_WRITE_BANDWIDTH, Assumptions


class CalibrationSettings(Protocol):
    """What the :class:`~trainyard_telemetry.calibrator.Calibrator` reads of a service's settings."""

    calibration_max_samples: int
    calibration_min_samples: int
    calibration_warmup_steps: int
    calibration_sample_every: int
    calibration_scan_jobs: int

    @property
    def assumptions(self) -> Assumptions: ...


class ReadModelSettings(ServiceSettings):
    """What the writer (this service) and the readers (the API's queries) of the read models must agree on:
    one definition, so the same ``TRAINYARD_*`` variable means the same thing in both."""

    cpu_peak_flops: float = Field(
        default=DEFAULT_CPU_PEAK_FLOPS, gt=0,
        description="FLOP/s the planner assumes for one CPU rank (device type cpu); deliberately conservative: "
                    "calibration corrects it from measured steps")
    calibration_write_bandwidth: float = Field(
        default=DEFAULT_WRITE_BANDWIDTH, gt=0,
        description="bytes/s checkpoint predictions assume for the artifact store; calibration corrects it from "
                    "measured checkpoint stalls")
    calibration_max_samples: int = Field(default=200, gt=0,
                                         description="newest samples kept per device type and kind")
    calibration_min_samples: int = Field(default=3, gt=0,
                                         description="samples a kind needs before its factor is fitted")
    goodput_history_bucket_s: int = Field(
        default=300, gt=0, description="width of a goodput history bucket: each refresh overwrites its tenant's "
                                       "sample of the current bucket (GET /v1/goodput/history)")
    goodput_history_retention_s: float = Field(default=30 * 86400.0, gt=0,
                                               description="how long goodput history samples are kept")


class TelemetrySettings(ReadModelSettings):
    """How the read models are kept: calibration sampling and refit, goodput refresh and history."""

    calibration_refresh_s: float = Field(default=30.0, gt=0, description="how often the calibration is refitted")
    calibration_warmup_steps: int = Field(default=2, ge=0,
                                          description="first steps of an attempt not sampled (warm-up)")
    calibration_sample_every: int = Field(default=5, gt=0, description="sample every n-th step time of an attempt")
    calibration_scan_jobs: int = Field(default=1000, gt=0,
                                       description="newest jobs whose failed attempts each refit samples")
    goodput_refresh_s: float = Field(default=30.0, gt=0,
                                     description="how often the trainyard_goodput_device_seconds gauges are refreshed")
    job_metrics_linger_s: float = Field(
        default=900.0, ge=0, description="how long a finished job's Prometheus series (trainyard_job_step_seconds, "
                                         "trainyard_job_goodput_ratio, …) are still served before they are removed")
    goodput_max_points: int = Field(
        default=4096, gt=1, description="newest steps per attempt whose cumulative step time is kept (older steps "
                                        "are interpolated); bounds the goodput read model's memory per attempt")

    tracking_refresh_s: float = Field(
        default=30.0, gt=0, description="how often the tracking exporter sends new points to the tenants' MLflow "
                                        "servers and TensorBoard files (docs/tracking.md)")
    tracking_span_steps: int = Field(default=5000, gt=0, le=1_000_000,
                                     description="steps the exporter reads and sends as one piece (one TensorBoard "
                                                 "file; MLflow log-batches of at most 1000 points each)")
    tracking_spans_per_pass: int = Field(default=20, gt=0,
                                         description="pieces one job sends per pass (the rest waits for the next)")
    tracking_concurrency: int = Field(default=8, gt=0, description="jobs exported at once")
    tracking_timeout_s: float = Field(default=10.0, gt=0, description="timeout of one call to an MLflow server")
    tracking_linger_s: float = Field(
        default=3600.0, ge=0, description="how long after a job ended the exporter still looks for its late points "
                                          "and evaluations")

    @property
    def assumptions(self) -> Assumptions:
        """What the planner assumes for this platform (the calibration's predictions)."""
        return Assumptions(cpu_peak_flops=self.cpu_peak_flops, write_bandwidth=self.calibration_write_bandwidth)
