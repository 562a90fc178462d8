"""The registry's settings: ``TRAINYARD_*`` variables, parsed once in ``main()``."""

from __future__ import annotations

from pydantic import Field

from trainyard_common.settings import ServiceSettings


class RegistrySettings(ServiceSettings):
    """Where the broker, Redis and artifacts are, plus how long to wait for missing records."""

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
