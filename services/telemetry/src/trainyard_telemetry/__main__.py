"""``python -m trainyard_telemetry`` / ``trainyard-telemetry``."""

from __future__ import annotations

from trainyard_runtime.service import service_main
from trainyard_telemetry.service import SERVICE_NAME, TelemetryService
from trainyard_telemetry.settings import TelemetrySettings

DESCRIPTION = """\
trainyard telemetry: consumes every rank's StepMetrics (trainyard.metrics) and StragglerDetected
(trainyard.workers) into the read models the API serves — metric history with down-sampled levels,
per-attempt step timing (rank 0's step time split into work and checkpoint stall, once), progress,
the planner's calibration samples and fit, goodput ledgers and history — and exports the goodput and
per-job Prometheus series. Runs until SIGTERM or SIGINT."""


def main(argv: list[str] | None = None) -> None:
    """Parse the settings once, then serve until SIGTERM."""

    async def serve(settings: TelemetrySettings) -> None:
        await TelemetryService(settings).run()

    service_main(argv, prog="trainyard-telemetry", description=DESCRIPTION, settings_cls=TelemetrySettings,
                 serve=serve, service=SERVICE_NAME)


if __name__ == "__main__":
    main()
