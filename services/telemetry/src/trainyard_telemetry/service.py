"""The telemetry process: a ServiceRuntime running the ingest and the two refresh loops.

    ServiceRuntime("telemetry")
      ├─ Ingest            trainyard.metrics (StepMetrics), trainyard.workers (StragglerDetected)
      ├─ loop calibration  Calibrator.refresh: failed attempts → samples, refit, Keys.calibration
      ├─ loop goodput      GoodputAccountant.refresh: tenant gauges, goodput history, per-job series
      └─ loop tracking     TrackingExporter.refresh: metric history and evaluations → MLflow, TensorBoard files

Replicas may run side by side: the consumers share the ``telemetry`` group (Kafka splits the partitions,
and per-job order holds within one), the read models' writes are idempotent, and two refreshes of one
bucket or one fit write the same thing. The metrics port (TRAINYARD_METRICS_PORT) serves the gauges the
refresh sets (``trainyard_goodput_device_seconds``, ``trainyard_job_*``).
"""

from __future__ import annotations

import asyncio

from trainyard_contract.storage import ArtifactLayout
from trainyard_runtime.service import ServiceRuntime, serve_until_signalled
from trainyard_telemetry.accounting import GoodputAccountant
from trainyard_telemetry.calibrator import Calibrator
from trainyard_telemetry.ingest import Ingest
from trainyard_telemetry.jobmetrics import JobSeries
from trainyard_telemetry.metrics_history import MetricHistory
from trainyard_telemetry.progress import ProgressProjector
from trainyard_telemetry.settings import TelemetrySettings
from trainyard_telemetry.steptiming import StepTimingStore
from trainyard_telemetry.tracking import TrackingExporter

SERVICE_NAME = "telemetry"


class TelemetryService:
    """The read models' writers wired into a runtime; ``start``/``run``/``aclose`` are the runtime's."""

    def __init__(self, settings: TelemetrySettings) -> None:
        self.settings = settings
        self.runtime = ServiceRuntime(SERVICE_NAME, settings)
        redis, store = self.runtime.redis, self.runtime.store
        self.calibrator = Calibrator(store, settings)
        self.timing = StepTimingStore(redis, max_points=settings.goodput_max_points)
        self.history = MetricHistory(redis)
        self.series = JobSeries(linger_s=settings.job_metrics_linger_s)
        self.ingest = Ingest(self.timing, self.history, ProgressProjector(redis, calibrator=self.calibrator),
                             self.series)
        self.accounting = GoodputAccountant(store, self.timing, history_bucket_s=settings.goodput_history_bucket_s,
                                            history_retention_s=settings.goodput_history_retention_s,
                                            series=self.series)
        self.ingest.install(self.runtime)
        self.runtime.add_loop("calibration", self._refit, every_s=settings.calibration_refresh_s)
        self.runtime.add_loop("goodput", self._account, every_s=settings.goodput_refresh_s)
        self.tracking = TrackingExporter(redis, self.history, ArtifactLayout(settings.artifact_root_abs), settings,
                                         timeout_s=settings.tracking_timeout_s)
        self.runtime.add_loop("tracking", self._track, every_s=settings.tracking_refresh_s)
        self._stop = asyncio.Event()
        self._closed = False

    async def _refit(self) -> None:
        await self.calibrator.refresh()

    async def _account(self) -> None:
        await self.accounting.refresh()

    async def _track(self) -> None:
        await self.tracking.refresh()

    async def start(self) -> None:
        await self.runtime.start()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then close (the services' one lifecycle)."""
        await serve_until_signalled(self, SERVICE_NAME, self._stop)

    async def aclose(self) -> None:
        """Idempotent: the runtime (the consumers finish in-flight events and the loops stop), then the tracking
        exporter's HTTP client and the history's own client."""
        if self._closed:
            return
        self._closed = True
        await self.runtime.aclose()
        await self.tracking.aclose()
        await self.history.aclose()

    async def __aenter__(self) -> TelemetryService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
