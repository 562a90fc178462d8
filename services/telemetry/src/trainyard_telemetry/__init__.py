"""trainyard_telemetry: the StepMetrics read models and the service that keeps them (docs/design.md, Telemetry).

``TelemetryService(settings)`` runs the ingest (python -m trainyard_telemetry); :mod:`.readmodels` gives the
readers the API and the checkpoint coordinator use, without consuming anything; :class:`TrackingExporter` sends
the metric history to the tenants' MLflow servers and TensorBoard files (docs/tracking.md).
"""

from trainyard_telemetry.calibrator import CalibrationStore, Calibrator
from trainyard_telemetry.progress import ProgressProjector, advance_progress
from trainyard_telemetry.service import TelemetryService
from trainyard_telemetry.settings import TelemetrySettings
from trainyard_telemetry.steps import StepTime, step_time
from trainyard_telemetry.tracking import TrackingExporter

__all__ = [
    "CalibrationStore",
    "Calibrator",
    "ProgressProjector",
    "StepTime",
    "TelemetryService",
    "TelemetrySettings",
    "TrackingExporter",
    "advance_progress",
    "step_time",
]
