"""The coordinator's settings: ``TRAINYARD_*`` variables, parsed once in ``main()``."""

from __future__ import annotations

from pydantic import Field

from trainyard_common.settings import ServiceSettings


class CoordinatorSettings(ServiceSettings):
    """Where the broker, Redis and artifacts are, plus how long shards may take."""

    shard_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="a checkpoint whose shards have not all arrived after this many seconds becomes FAILED",
    )
    sweep_interval_s: float = Field(
        default=10.0, gt=0, description="how often pending checkpoints are checked for the timeout"
    )
