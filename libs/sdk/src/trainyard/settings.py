"""The rank environment contract (node agent → ``python -m trainyard_trainer`` or a user script using the SDK),
parsed once.

torch.distributed's own variables keep their usual names (``RANK``, ``WORLD_SIZE``, …);
trainyard's carry the ``TRAINYARD_`` prefix; ``TRACEPARENT`` is the W3C trace context of
the job. ``OTEL_*`` variables are read by OpenTelemetry itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainyard_contract.storage import root_setting


class RankSettings(BaseSettings):
    """One rank's view of its job, allocation and place in the world."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    rank: int = Field(ge=0, validation_alias="RANK", description="global rank")
    world_size: int = Field(ge=1, validation_alias="WORLD_SIZE")
    local_rank: int = Field(default=0, ge=0, validation_alias="LOCAL_RANK")
    local_world_size: int = Field(default=1, ge=1, validation_alias="LOCAL_WORLD_SIZE")
    master_addr: str = Field(default="127.0.0.1", validation_alias="MASTER_ADDR")
    master_port: int = Field(gt=0, lt=65536, validation_alias="MASTER_PORT")
    backend: Literal["gloo", "nccl"] | None = Field(
        default=None, validation_alias="TRAINYARD_BACKEND",
        description="collective backend; default nccl when CUDA is available, else gloo",
    )
    device_index: int | None = Field(
        default=None, ge=0, validation_alias="TRAINYARD_DEVICE_INDEX",
        description="accelerator index on this node (ignored on CPU)",
    )
    job_id: str = Field(min_length=1, validation_alias="TRAINYARD_JOB_ID")
    tenant: str = Field(min_length=1, validation_alias="TRAINYARD_TENANT")
    attempt: int = Field(ge=1, validation_alias="TRAINYARD_ATTEMPT")
    epoch: int = Field(ge=1, validation_alias="TRAINYARD_EPOCH", description="fencing epoch of the allocation")
    allocation_id: str = Field(min_length=1, validation_alias="TRAINYARD_ALLOCATION_ID")
    artifact_root: Path | str = Field(
        validation_alias="TRAINYARD_ARTIFACT_ROOT",
        description="checkpoints and datasets: a directory, or an object-store URL (s3://bucket/prefix)",
    )
    node_state_dir: Path | None = Field(
        default=None, validation_alias="TRAINYARD_NODE_STATE_DIR",
        description="this node's own files of the attempt (logs, spool, run record, metrics, checkpoint request); "
                    "required when the artifact root is an object store, else default the artifact root",
    )
    shard_cache_dir: Path | None = Field(
        default=None, validation_alias="TRAINYARD_SHARD_CACHE_DIR",
        description="node-local cache of dataset shards read from an object store (default "
                    "<node state dir>/shard-cache)",
    )
    shard_cache_max_gb: float | None = Field(
        default=None, gt=0, validation_alias="TRAINYARD_SHARD_CACHE_MAX_GB",
        description="the shard cache's size budget in GB (1e9 bytes): least recently used shards are deleted to "
                    "stay within it (default: no budget, only the free-disk floor)",
    )
    shard_cache_min_free_gb: float = Field(
        default=1.0, ge=0, validation_alias="TRAINYARD_SHARD_CACHE_MIN_FREE_GB",
        description="free disk the shard cache leaves on its filesystem, in GB: least recently used shards are "
                    "deleted before a fetch would go below it",
    )
    allocation_file: Path = Field(
        validation_alias="TRAINYARD_ALLOCATION_FILE",
        description="the GangAllocated event as camelCase JSON (spec, spec hash, start checkpoint)",
    )
    events_file: Path = Field(validation_alias="TRAINYARD_EVENTS_FILE", description="this rank's event spool")
    traceparent: str | None = Field(
        default=None, validation_alias="TRACEPARENT",
        description="W3C trace context of the job; this rank's spans join it",
    )
    collective_timeout_s: float = Field(
        default=600.0, gt=0, validation_alias="TRAINYARD_COLLECTIVE_TIMEOUT_S",
        description="a collective that takes longer fails the rank instead of hanging",
    )
    checkpoint_request_file: Path | None = Field(
        default=None, validation_alias="TRAINYARD_CHECKPOINT_REQUEST_FILE",
        description="where the node agent writes a checkpoint request (CheckpointRequested); SIGUSR1 says the "
                    "same sooner. Default: checkpoint-request.json in the attempt directory",
    )
    exit_note_file: Path | None = Field(
        default=None, validation_alias="TRAINYARD_EXIT_NOTE_FILE",
        description="where the rank writes how it ended (exit code, last or failing global step) for the agent",
    )
    log_level: str = Field(default="INFO", validation_alias="TRAINYARD_LOG_LEVEL")
    # How to train (until the spec has fields for these: see the README, "Parallel modes").
    sharding: Literal["ddp", "zero1", "zero2", "fsdp"] = Field(
        default="ddp", validation_alias="TRAINYARD_SHARDING",
        description="data-parallel sharding: ddp, zero1 (optimizer state), zero2 (+ gradients), fsdp (ZeRO-3)",
    )
    activation_checkpointing: bool = Field(
        default=False, validation_alias="TRAINYARD_ACTIVATION_CHECKPOINTING",
        description="recompute each transformer block's activations in the backward pass",
    )
    autocast: Literal["auto", "bf16", "off"] = Field(
        default="auto", validation_alias="TRAINYARD_AUTOCAST",
        description="bf16 autocast; auto = bf16 on CUDA devices that support it, fp32 on CPU",
    )
    checkpoint_mode: Literal["async", "sync"] = Field(
        default="async", validation_alias="TRAINYARD_CHECKPOINT_MODE",
        description="async: shards are written while training continues; sync: training waits",
    )
    cpu_threads: int | None = Field(
        default=None, ge=1, validation_alias="TRAINYARD_CPU_THREADS",
        description="intra-op CPU threads of this rank (the node agent gives each rank its share of the node's "
                    "cores); default OMP_NUM_THREADS, else the usable cores / LOCAL_WORLD_SIZE",
    )
    omp_num_threads: str | None = Field(
        default=None, validation_alias="OMP_NUM_THREADS",
        description="OpenMP's thread count, the fallback of TRAINYARD_CPU_THREADS",
    )
    peak_flops: float | None = Field(
        default=None, gt=0, validation_alias="TRAINYARD_PEAK_FLOPS",
        description="peak FLOP/s of one device for MFU; default from the device table or a CPU matmul probe",
    )

    @field_validator("artifact_root", mode="before")
    @classmethod
    def _root_is_a_path_or_a_url(cls, value: object) -> object:
        return root_setting(value)

    @model_validator(mode="after")
    def _rank_in_world(self) -> RankSettings:
        if self.rank >= self.world_size:
            raise ValueError(f"RANK {self.rank} is not below WORLD_SIZE {self.world_size}")
        if isinstance(self.artifact_root, str) and self.node_state_dir is None:
            raise ValueError(f"TRAINYARD_ARTIFACT_ROOT {self.artifact_root} is an object store: set "
                             "TRAINYARD_NODE_STATE_DIR to a directory on this node for the attempt's own files")
        return self

    @property
    def local_root(self) -> Path:
        """Where this node keeps the attempt's own files (the layout's ``attempt_dir``): the node state
        directory, else the artifact root (a directory)."""
        root = self.node_state_dir or self.artifact_root
        assert isinstance(root, Path)  # the validator requires a node state dir for an object-store root
        return root

    @property
    def shard_cache_path(self) -> Path:
        return self.shard_cache_dir or self.local_root / "shard-cache"

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def describe_environment() -> str:
    """The contract as help text: one line per variable."""
    lines = []
    for name, field in RankSettings.model_fields.items():
        alias = field.validation_alias or name.upper()
        need = "required" if field.is_required() else f"default {field.default!r}"
        lines.append(f"  {alias:<31} {field.description or name.replace('_', ' ')} ({need})")
    return "\n".join(lines)
