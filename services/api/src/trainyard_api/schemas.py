"""Response bodies of the REST API (camelCase on the wire, like the spec and the events)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_common.events import CheckpointRef, JobState
from trainyard_common.records import ArtifactRecord, CheckpointState, DatasetRecord
from trainyard_common.spec import TrainingSpec

# The tiny example job (examples/tiny.yaml; a unit test keeps the two equal).
EXAMPLE_SPEC: dict[str, Any] = {
    "specVersion": "v1",
    "name": "tiny-example",
    "modelConfig": "gpt-tiny@v1",
    "dataset": "tinycorpus@v1",
    "codeRevision": "local",
    "resources": {"gpuType": "cpu", "gpuCount": 2, "topology": "4-device-nodes"},
    "parallelism": {"data": 2, "tensor": 1, "pipeline": 1},
    "checkpointPolicy": {"everySteps": 20, "keepLast": 3},
    "training": {
        "seed": 1234,
        "sequenceLength": 64,
        "microBatchSize": 8,
        "globalBatchSize": 32,
        "learningRate": 0.003,
        "lrSchedule": {"name": "cosine", "warmupSteps": 5},
        "maxSteps": 40,
    },
}


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, protected_namespaces=())


class SubmitResponse(_Out):
    job_id: str = Field(examples=["job-3f2a9c1b7e4d"])
    state: JobState = Field(examples=["queued"])
    spec_hash: str = Field(examples=["sha256:9b1c…"])
    warnings: list[str] | None = Field(
        default=None, description="present only when the planner has something to say, e.g. a model that "
                                  "fits the device's memory only inside the 15 % headroom")


class ControlResponse(_Out):
    job_id: str
    action: Literal["cancel", "pause", "resume"]
    state: JobState = Field(description="the job's state when the request was accepted")
    accepted: bool = True


class AttemptView(_Out):
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
    placement_score: float | None


class ProgressView(_Out):
    global_step: int = 0
    max_steps: int | None = None
    consumed_tokens: int = 0
    last_loss: float | None = None
    lr: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    attempt: int | None = None
    updated_at: datetime | None = None


class CheckpointView(_Out):
    checkpoint_id: str = Field(examples=["step-000000040-a1"])
    state: CheckpointState
    global_step: int
    attempt: int
    world_size: int
    manifest_uri: str | None
    content_hash: str | None
    consumed_tokens: int
    reason: str | None
    created_at: datetime
    ready_at: datetime | None


class JobView(_Out):
    job_id: str
    tenant: str
    name: str | None
    state: JobState
    spec_hash: str
    spec: TrainingSpec
    submitted_by: str | None
    created_at: datetime
    updated_at: datetime
    reason: str | None = Field(description="why it failed or was cancelled")
    queued_reason: str | None = Field(description="why it is waiting (only while queued)")
    attempts: list[AttemptView]
    max_attempts: int
    progress: ProgressView
    checkpoints: list[CheckpointView]


class JobSummary(_Out):
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


class JobPage(_Out):
    jobs: list[JobSummary]
    next_offset: int | None = Field(description="pass as offset for the next page; null at the end")


class CheckpointList(_Out):
    job_id: str
    checkpoints: list[CheckpointView]


class ArtifactList(_Out):
    job_id: str
    artifacts: list[ArtifactRecord]


class DatasetList(_Out):
    datasets: list[DatasetRecord]


class Health(_Out):
    status: Literal["ok", "degraded"]
    redis: bool
    broker: bool
    outbox_pending: int | None = None


class FieldErrorItem(_Out):
    field: str = Field(examples=["training.globalBatchSize"])
    message: str


class FieldErrors(_Out):
    detail: list[FieldErrorItem]


class ErrorMessage(_Out):
    detail: str
