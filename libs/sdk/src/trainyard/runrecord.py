"""The run record: what one attempt actually did, as ``<attempt dir>/run-record.json``.

Written by rank 0, atomically (temporary file, fsync, rename), when training starts, after each
checkpoint and at the end (also when the attempt fails). It answers what the spec alone
cannot: the tokens really consumed, the loss curve, the environment (Python, torch, CUDA,
NCCL, the host of every rank, the code revision), the batch layout this world size ran (and
whether it differs from the spec's), the parallel layout, and which checkpoint was restored and
why (including every checkpoint that was refused on the way).
"""

from __future__ import annotations

import platform
import socket
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_contract.events import utcnow
from trainyard_contract.storage import atomic_write_bytes

RUN_RECORD_FILE = "run-record.json"


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore",
                              protected_namespaces=())


class Environment(_Wire):
    python: str
    torch: str
    cuda: str | None = None
    cudnn: int | None = None
    nccl: str | None = None
    platform: str
    backend: str
    device: str
    hostnames: list[str] = Field(description="host of each rank, by rank")
    cpu_threads: list[int] = Field(
        default=[], description="intra-op CPU threads of each rank, by rank: on CPU, part of what a bitwise "
                                "resume needs to match (reductions are chunked by the thread count)")
    code_revision: str


class BatchRecord(_Wire):
    micro_batch_size: int
    data_parallel: int
    grad_accumulation: int
    global_batch_size: int
    sequence_length: int
    tokens_per_step: int
    spec_data_parallel: int
    statement: str


class ParallelRecord(_Wire):
    dp: int
    tp: int
    pp: int
    sharding: str
    zero_stage: int
    activation_checkpointing: bool
    precision: str
    checkpoint_mode: str
    notes: list[str] = []


class RefusedCheckpoint(_Wire):
    manifest_uri: str
    global_step: int | None = None
    problems: list[str]


class RestoreRecord(_Wire):
    manifest_uri: str | None = Field(description="the checkpoint loaded; None when training started fresh")
    global_step: int = 0
    world_size: int | None = Field(default=None, description="ranks that wrote it")
    reason: str
    requested_manifest_uri: str | None = Field(default=None, description="the allocation's start checkpoint")
    refused: list[RefusedCheckpoint] = []
    rng: str = Field(default="restored", description="restored | reseeded (different world size) | fresh")
    seconds: float = 0.0
    cpu_threads: list[int] | None = Field(
        default=None, description="CPU threads of each rank of the attempt that wrote the checkpoint (from its "
                                  "run record); None when unknown")
    cpu_threads_note: str | None = Field(
        default=None, description="set when this attempt runs other CPU thread counts than the checkpoint's "
                                  "writer: it resumes anyway, but not bitwise identically")
    hugging_face_uri: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the Hugging Face directory (initFrom.huggingFace) whose weights the model started from")


class CheckpointRecord(_Wire):
    global_step: int
    directory: str
    mode: str
    stall_seconds: float
    write_seconds: float | None = None
    shard_bytes: int | None = None


class CheckpointPolicyRecord(_Wire):
    """When this attempt saves: the spec's policy, or the coordinator's advice (``checkpointPolicy.auto``)."""

    every_steps: int | None = None
    every_minutes: float | None = None
    source: str = Field(description="spec | auto: the allocation's checkpointEverySteps (Young/Daly advice)")


class StopRecord(_Wire):
    """A stop on request (CheckpointRequested): at which step, and whether this attempt saved it."""

    global_step: int
    saved: bool
    signalled: bool = Field(description="the request came as a signal (else as the request file)")


class ProgressRecord(_Wire):
    start_step: int
    global_step: int
    consumed_tokens: int = Field(description="tokens consumed by the whole job, this attempt included")
    consumed_samples: int
    tokens_this_attempt: int = Field(description="tokens this attempt trained on (nothing counted twice)")
    sampler_start_position: int
    sampler_position: int


class ThroughputRecord(_Wire):
    flops_per_token: float
    peak_flops_per_device: float | None = None
    peak_flops_source: str | None = None
    mean_tokens_per_second: float | None = None
    mean_mfu: float | None = None
    mean_step_seconds: float | None = None


class ReplicasRecord(_Wire):
    """A fault-tolerant job's replica (``faultTolerance``): its steps, those run with fewer replicas, its heal."""

    replicas: int
    min_replicas: int
    batch: str = Field(description="reduced | accumulate: what a step with fewer replicas trains on")
    committed: int = Field(default=0, description="steps this replica committed in this attempt")
    degraded_total: int = Field(default=0, description="of them, steps committed with fewer replicas than replicas")
    degraded_steps: list[int] = Field(default=[], description="those steps (the first 1000)")
    not_committed: int = Field(default=0, description="steps a quorum abandoned (a replica failed during them)")
    healed_at: int | None = Field(default=None, description="the step this replica joined at, healed from a peer")


class RunRecord(_Wire):
    record_version: int = 1
    job_id: str
    tenant: str
    attempt: int
    allocation_id: str
    world_size: int
    spec_hash: str | None
    model: str
    num_parameters: int
    dataset: str
    status: str = "running"  # running | succeeded | failed | preempted
    exit_code: int | None = None
    error: str | None = None
    failed_step: int | None = Field(default=None, description="the global step that failed (a NaN), when known")
    stopped: StopRecord | None = None
    checkpoint_policy: CheckpointPolicyRecord | None = None
    started_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    environment: Environment
    batch: BatchRecord
    parallelism: ParallelRecord
    restore: RestoreRecord
    progress: ProgressRecord
    throughput: ThroughputRecord
    loss_curve: list[tuple[int, float]] = Field(default=[], description="(global step, global-batch mean loss)")
    checkpoints: list[CheckpointRecord] = []
    replicas: ReplicasRecord | None = Field(default=None, exclude_if=lambda v: v is None,
                                            description="faultTolerance: this replica's steps and heal")

    def write(self, path: Path) -> None:
        """Atomically replace ``path`` with this record (updated_at set now)."""
        self.updated_at = utcnow()
        atomic_write_bytes(path, self.model_dump_json(by_alias=True, indent=2).encode())


def written_cpu_threads(record_path: Path) -> list[int] | None:
    """The CPU threads of each rank that the run record at ``record_path`` says (the attempt that
    wrote a checkpoint); None when there is no record, it does not parse, or it predates the field."""
    try:
        threads = RunRecord.model_validate_json(record_path.read_bytes()).environment.cpu_threads
    except (OSError, ValueError):
        return None
    return threads or None


def cpu_threads_change(written: list[int] | None, now: list[int]) -> str | None:
    """What a resume should say when its ranks run other CPU thread counts than the checkpoint's
    writer (None when they match or the writer's are unknown). Pure.

    The policy is the world size's: a difference is no reason to refuse a checkpoint (a job may
    move to a node with other cores), but the resumed run then sums in another order and is not
    bitwise identical to an uninterrupted one; the run record says so."""
    same = written == now if len(written or []) == len(now) else set(written or []) == set(now)  # elastic: by count
    if not written or same:
        return None
    return (f"the checkpoint was written with {_threads(written)} CPU threads per rank, this attempt runs "
            f"{_threads(now)}: training continues, but not bitwise identically to an uninterrupted run")


def _threads(counts: list[int]) -> str:
    return str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))


def local_environment() -> dict[str, Any]:
    """This process's versions and host (the part of :class:`Environment` each rank knows alone)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            nccl = None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_threads": torch.get_num_threads(),
    }
