"""Bodies of the REST API that both sides use: the API publishes them, the CLI reads them.

One class per shape, camelCase on the wire like the spec and the events. The API's
``trainyard_api.schemas`` re-exports them under these names (so the OpenAPI components keep
them) and ``trainyard_cli.client`` parses its answers into them: a field added here is added to
both. Readers ignore fields they do not know, so an older CLI reads a newer API's additions.
A changed type or a newly required field is a breaking change of the published document.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_contract.wirebase import CheckpointRef, CheckpointState, JobState, PlacementDetail

__all__ = [
    "ApiModel",
    "AttemptView",
    "CheckpointList",
    "CheckpointView",
    "CodeArchiveView",
    "ControlResponse",
    "DatasetPublished",
    "ExportFile",
    "JobPage",
    "JobSummary",
    "ProgressView",
    "SubmitResponse",
    "TriggerJobView",
]


class ApiModel(BaseModel):
    """A body of the REST API: camelCase aliases, fields by name too, unknown fields ignored."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore",
                              protected_namespaces=())


# ----------------------------------------------------------------------------- jobs


class SubmitResponse(ApiModel):
    job_id: str = Field(examples=["job-3f2a9c1b7e4d"])
    state: JobState = Field(examples=["queued"])
    spec_hash: str = Field(examples=["sha256:9b1c…"])
    warnings: list[str] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="present only when the planner has something to say, e.g. a model that fits the device's "
                    "memory only inside the 15 % headroom")


class ControlResponse(ApiModel):
    job_id: str
    action: Literal["cancel", "pause", "resume"]
    state: JobState = Field(description="the job's state when the request was accepted")
    accepted: bool = True


class NodeEnvironmentView(ApiModel):
    """A node's preparation of the job's environment (``code.environment``) for this attempt."""

    environment: str = Field(description="sha256:<hex> of the lock")
    state: Literal["building", "ready", "failed"]
    cached: bool = Field(default=False, description="found built in the node's cache (nothing built)")
    packages: int = 0
    elapsed_seconds: float = 0.0
    detail: str | None = Field(default=None, description="the installer's latest line, or why it failed")
    at: datetime


class ReplicaReplacementView(ApiModel):
    """A failed replica of a fault-tolerant attempt, replaced while the others trained on."""

    rank: int
    node_id: str
    generation: int = Field(description="the newcomer's generation")
    reason: str
    detail: str | None = None
    global_step: int | None = Field(default=None, description="the last step the failed replica completed")
    at: datetime = Field(description="when it was replaced")
    started_at: datetime | None = Field(default=None, description="when the newcomer's rank started")


class AttemptView(ApiModel):
    attempt: int
    allocation_id: str
    epoch: int
    state: str
    nodes: list[str]
    world_size: int
    start_checkpoint: CheckpointRef | None
    started_at: datetime
    ended_at: datetime | None
    failure_reason: str | None
    interruption: str | None = Field(
        default=None, description="why the platform stopped it without a failure: 'maintenance: …' (a drain) or "
                                  "'control-plane: …' (most nodes silent together); no failure budget, no blame")
    placement_score: float | None
    placement_detail: PlacementDetail | None = Field(
        default=None, description="how local the gang's placement is: domains, racks, tiers and the links "
                                  "crossing them (the placement score explained)")
    starts: dict[str, int] = Field(default={}, description="how its ranks started: warm (forked from an interpreter "
                                                           "that had imported torch) | cold → how many")
    start_detail: str | None = Field(default=None, description="why the latest rank to start cold did")
    environment: dict[str, NodeEnvironmentView] = Field(
        default={}, description="node → its preparation of the job's environment (preparing environment: building "
                                "with the installer's progress, ready, cached or failed)")
    generations: dict[str, int] = Field(
        default={}, description="faultTolerance: rank → its replica generation, for ranks replaced in this attempt")
    replacements: list[ReplicaReplacementView] = Field(
        default=[], description="faultTolerance: each failed replica replaced while the others trained on")


class ProgressView(ApiModel):
    global_step: int = 0
    max_steps: int | None = None
    consumed_tokens: int = 0
    last_loss: float | None = None
    lr: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    attempt: int | None = None
    updated_at: datetime | None = None


class CheckpointView(ApiModel):
    checkpoint_id: str = Field(examples=["step-000000040-a1"])
    state: CheckpointState
    global_step: int
    attempt: int
    world_size: int
    manifest_uri: str | None
    content_hash: str | None = Field(description="sha256 over the checkpoint's files as written (DCP's .metadata "
                                                 "included), each verified by the coordinator: it differs between "
                                                 "bitwise-identical checkpoints, so it names files, not values")
    tensors_hash: str | None = Field(
        default=None, description="sha256 over the saved tensors' content (keys, dtypes, shapes, values), independent "
                                  "of DCP's metadata: equal for bitwise-identical checkpoints, so it compares runs. "
                                  "As the ranks reported it (not recomputed by the platform); null when not reported")
    consumed_tokens: int
    reason: str | None
    created_at: datetime
    ready_at: datetime | None
    write_seconds: float | None = Field(default=None, description="slowest rank's save time, when reported")
    deleted_at: datetime | None = Field(
        default=None, description="when its files were removed (retention of a READY one: state DELETED; "
                                  "garbage collection of a FAILED one)")
    size_bytes: int | None = Field(
        default=None, description="bytes of its shards and shared files as its manifest lists them (known once "
                                  "READY; null for a checkpoint recorded before sizes were kept)")


class CheckpointList(ApiModel):
    job_id: str
    checkpoints: list[CheckpointView]


class JobSummary(ApiModel):
    job_id: str
    name: str | None
    state: JobState
    spec_hash: str
    model: str = Field(description="catalog reference, or 'inline'")
    dataset: str
    gpu_count: int
    attempts: int
    global_step: int
    max_steps: int
    last_loss: float | None
    created_at: datetime
    updated_at: datetime
    queued_reason: str | None
    reason: str | None
    tokens_per_second: float | None = Field(default=None, description="rank 0's latest tokens/s (whole job)")
    mfu: float | None = Field(default=None, description="rank 0's latest model FLOPs utilisation")
    eta_seconds: float | None = Field(
        default=None, description="while running: steps left x the latest step time; null when unknown")


class JobPage(ApiModel):
    jobs: list[JobSummary]
    next_offset: int | None = Field(description="pass as offset for the next page; null at the end")


# ----------------------------------------------------------------------------- code, exports, datasets, triggers


class CodeArchiveView(ApiModel):
    """A stored code archive."""

    archive: str = Field(description="`sha256:<hex>` of its bytes", examples=["sha256:" + "0" * 64])
    size: int = Field(ge=0, description="bytes of the archive (compressed)")
    files: int = Field(ge=0, description="files and symlinks in the tree")
    uploaded_at: datetime = Field(description="when it was first stored")


class ExportFile(ApiModel):
    name: str = Field(description="a file of the export directory", examples=["model.safetensors"])
    size: int = Field(ge=0, description="bytes")
    sha256: str = Field(description="hex sha256 of its bytes (trainyard-export.json's own: the export's hash)")


class DatasetPublished(ApiModel):
    dataset: str = Field(description="its qualified ref, tenant/name@version", examples=["acme/wiki-en@2026-12-01"])
    state: Literal["pending"] = "pending"
    manifest_uri: str = Field(description="where the registry reads and verifies its manifest")


class TriggerJobView(ApiModel):
    dataset: str = Field(description="the dataset version (qualified ref) the job trains on; for a "
                                     "checkpointReady trigger, the checkpoint artifact it evaluates",
                         examples=["acme/wiki-en@2026-12-01"])
    job_id: str = Field(examples=["job-3f2a9c1b7e4d"])
    checkpoint: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                   description="a checkpointReady trigger's: the checkpoint artifact the job evaluates")
