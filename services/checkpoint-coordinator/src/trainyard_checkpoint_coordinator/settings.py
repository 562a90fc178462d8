"""The coordinator's settings: ``TRAINYARD_*`` variables, parsed once in ``main()``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field

from trainyard_contract.settings import ServiceSettings
from trainyard_runtime.retry import RetryPolicy

from trainyard_checkpoint_coordinator.advice import PRIOR_DEVICE_MTBF_S


class CoordinatorSettings(ServiceSettings):
    """Where the broker, Redis and artifacts are, how long shards may take, and housekeeping."""

    # TRAINYARD_RETRY_BACKOFF_MAX_S is the scheduler's cap on a job's retry back-off (60 s); the coordinator's
    # setting of that name, a different cap, is now shard_report_retry_max_s.
    renamed_env: ClassVar[Mapping[str, str]] = {"TRAINYARD_RETRY_BACKOFF_MAX_S": "shard_report_retry_max_s"}

    shard_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="a checkpoint whose shards have not all arrived after this many seconds becomes FAILED; "
                    "an abandoned checkpoint directory or .tmp of an ended attempt is removed once this old",
    )
    shard_report_retry_max_s: float = Field(
        default=1.0, gt=0,
        description="the longest wait before a shard report that failed (Redis away) is tried again: the "
                    "checkpoints written during an outage settle within about this long after it ends",
    )
    stall_intervals: int = Field(
        default=3, gt=0,
        description="a running job this many checkpoint intervals past its newest READY checkpoint is flagged "
                    "CheckpointsStalled (ty:job:<id>:ckpt-protection, trainyard_checkpoint_unprotected_intervals)",
    )
    sweep_interval_s: float = Field(
        default=10.0, gt=0, description="how often pending checkpoints are checked for the timeout"
    )
    gc_interval_s: float = Field(
        default=30.0, gt=0,
        description="how often retention (keepLast) and garbage collection of failed/abandoned checkpoints run",
    )
    advice_interval_s: float = Field(
        default=15.0, gt=0, description="how often each running job's checkpoint-interval advice is refreshed"
    )
    advice_window: int = Field(
        default=5, gt=0, description="the advice uses the median over this many most recent READY checkpoints"
    )
    prior_device_mtbf_s: float = Field(
        default=PRIOR_DEVICE_MTBF_S, gt=0,
        description="device MTBF assumed until a device type has failed once (default: Llama 3's 466 "
                    "interruptions in 54 days on 16,384 GPUs)",
    )

    def shard_report_retry(self) -> RetryPolicy:
        """A shard report that failed is tried again after 0.4 s (less under a smaller cap), doubling up to
        ``shard_report_retry_max_s``."""
        cap = self.shard_report_retry_max_s
        return RetryPolicy(initial_interval_s=min(0.4, cap), maximum_interval_s=cap)
