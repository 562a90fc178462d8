"""trainyard_telemetry: the StepMetrics read models and the service that keeps them (docs/design.md, Telemetry).

``TelemetryService(settings)`` runs the ingest (python -m trainyard_telemetry); :mod:`.readmodels` gives the
readers the API and the checkpoint coordinator use, without consuming anything.
"""

from trainyard_telemetry.calibrator import CalibrationStore, Calibrator
from trainyard_telemetry.progress import ProgressProjector, advance_progress
from trainyard_telemetry.service import TelemetryService
from trainyard_telemetry.settings import TelemetrySettings
from trainyard_telemetry.steps import StepTime, step_time

__all__ = [
    "CalibrationStore",
    "Calibrator",
    "ProgressProjector",
    "StepTime",
    "TelemetryService",
    "TelemetrySettings",
    "advance_progress",
    "step_time",
]
