"""The registry's settings: ``TRAINYARD_*`` variables, parsed once in ``main()``."""

from __future__ import annotations

import sys

from pydantic import Field

from trainyard_contract.settings import ServiceSettings


class RegistrySettings(ServiceSettings):
    """Where the broker, Redis and artifacts are, how long to wait for missing records, and how exports run."""

    missing_retry_limit: int = Field(
        default=30,
        gt=0,
        description=(
            "how many times an event whose job record or READY checkpoint is not there yet is "
            "retried (with back-off up to 10 s) before it is dead-lettered"
        ),
    )
    retire_interval_s: float = Field(
        default=15.0, gt=0,
        description="how often artifacts whose checkpoint was deleted by retention or refused are marked retired",
    )
    export_command: list[str] = Field(
        default_factory=lambda: [sys.executable, "-m", "trainyard_trainer.export_cli"],
        min_length=1,
        description="the conversion command (trainyard-export), run as a subprocess for each ExportRequested; "
                    "a JSON list (TRAINYARD_EXPORT_COMMAND='[\"trainyard-export\"]')",
    )
    export_timeout_s: float = Field(
        default=300.0, gt=0, le=540,
        description="how long one conversion may run before it is killed and the export fails (below the "
                    "consumer's 600 s poll interval, so a long one never costs the group its member)",
    )
