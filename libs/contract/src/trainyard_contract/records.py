"""Durable records kept in Redis (the system of record; the broker is not).

One JSON document per key; camelCase like the API. Who writes what:

* ``JobRecord``        api creates (SET NX); afterwards only the scheduler changes it.
* ``TriggerRecord``    api (``POST /v1/triggers``; its jobs and last error beside it, see ``Keys``).
* ``Progress``         api, from StepMetrics.
* ``CheckpointRecord`` checkpoint-coordinator.
* ``ArtifactRecord``   registry.  ``DatasetRecord`` registry (from DatasetVersionPublished).
* ``NodeRecord``       scheduler, from NodeHeartbeat.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_contract.events import (
    CheckpointRef,
    DeviceInfo,
    JobState,
    NodeAssignment,
    PlacementDetail,
    dataset_key,
    utcnow,
)
from trainyard_contract.spec import DatasetRef, TrainingSpec
from trainyard_contract.wirebase import CheckpointState  # PENDING → READY | FAILED; READY → DELETED


class Record(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", protected_namespaces=()
    )

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True)


AttemptState = Literal["starting", "running", "succeeded", "failed", "revoked"]


class NodeEnvironment(Record):
    """Where a node is with the attempt's environment (from its latest EnvironmentPreparing)."""

    environment: str
    state: Literal["building", "ready", "failed"]
    cached: bool = False
    packages: int = 0
    elapsed_seconds: float = 0.0
    detail: str | None = None
    at: datetime = Field(default_factory=utcnow)


class ReplicaReplacement(Record):
    """One failed replica of a fault-tolerant attempt, replaced while the others trained on."""

    rank: int
    node_id: str
    generation: int = Field(description="the newcomer's generation")
    reason: str
    detail: str | None = None
    global_step: int | None = Field(default=None, description="the last step the failed replica completed")
    at: datetime
    started_at: datetime | None = Field(default=None, description="when the newcomer's rank started")


class AttemptRecord(Record):
    attempt: int
    allocation_id: str
    epoch: int
    state: AttemptState = "starting"
    nodes: list[str] = []
    devices: list[str] = Field(default=[], description="node:index of every leased device")
    world_size: int
    start_checkpoint: CheckpointRef | None = None
    started_at: datetime = Field(default_factory=utcnow)
    ended_at: datetime | None = None
    failure_reason: str | None = None
    exited_ranks: dict[str, int] = Field(default={}, description="rank -> exit code")
    started_ranks: list[int] = []
    placement_score: float | None = None
    master_addr: str | None = None
    master_port: int | None = None
    lighthouse_port: int | None = Field(default=None, exclude_if=lambda v: v is None,
                                        description="faultTolerance: the job's Lighthouse, at master_addr")
    placement_detail: PlacementDetail | None = None
    preempted_by: str | None = Field(default=None, description="job this attempt is being preempted for")
    preempt_requested_at: datetime | None = None
    preempt_after_step: int | None = Field(
        default=None, description="latest READY step when a stop (pause, drain, preemption) was asked (-1: none); "
                                  "raised to the ranks' stop step - 1 as they exit 7: only a READY checkpoint past it "
                                  "ends the stop (transitions.stop_checkpoint)"
    )
    # checkpoint-then-stop (pause uses preempt_requested_at / preempt_after_step too; JobRecord.control says which)
    ranks_stopped_at: datetime | None = Field(
        default=None, description="when a rank exited 'preempted' (checkpointed on request); waiting for READY"
    )
    assignments: list[NodeAssignment] = Field(default=[], description="node → ranks, as in GangAllocated")
    checkpoint_every_steps: int | None = Field(default=None, description="as in GangAllocated")
    starts: dict[str, int] = Field(default={}, exclude_if=lambda v: not v,
                                   description="how its ranks started: warm | cold → how many (WorkerStarted.start)")
    start_detail: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                     description="why the latest rank to start cold did")
    environment: dict[str, NodeEnvironment] = Field(
        default={}, exclude_if=lambda v: not v,
        description="node → its preparation of the job's environment (code.environment), while and after it ran")
    republished: int = Field(default=0, description="times GangAllocated was published again (ranks not started)")
    republished_at: datetime | None = None
    nan_step: int | None = Field(default=None, description="global step of a NaN failure, when known")
    final_saved: bool = Field(
        default=False, description="a rank reported its shard of the checkpoint at maxSteps (user code: success "
                                   "then waits for it to be READY; without one, every rank exiting 0 is success)",
    )
    ready_step_at_end: int | None = Field(
        default=None, description="latest READY step when the attempt ended (progress = newer than its start)"
    )
    generations: dict[str, int] = Field(
        default={}, exclude_if=lambda v: not v,
        description="faultTolerance: rank -> its replica generation, for ranks replaced during the attempt")
    replacements: list[ReplicaReplacement] = Field(
        default=[], exclude_if=lambda v: not v,
        description="faultTolerance: each failed replica replaced while the others trained on")
    interruption: str | None = Field(
        default=None,
        description="why the platform stopped it without a failure: 'maintenance: …' (a node drain) or "
                    "'control-plane: …' (most nodes went silent together); no failure budget, no blame",
    )


class TriggerOrigin(Record):
    """A job's lineage when a trigger submitted it: which trigger, for which new dataset version (or, for a
    ``checkpointReady`` trigger, which READY checkpoint it evaluates)."""

    trigger_id: str
    trigger_name: str
    dataset: str | None = Field(default=None, description="the qualified ref of the version that started it")
    event_id: str = Field(description="the ArtifactRegistered event that announced that version or checkpoint")
    checkpoint: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                   description="a checkpointReady trigger's: the checkpoint artifact it evaluates")


class ExperimentOrigin(Record):
    """A job's lineage when an experiment submitted it: which experiment, which trial, at which point."""

    experiment_id: str
    experiment_name: str
    trial: int
    params: dict[str, float | int | str | bool]


class HuggingFaceStart(Record):
    """The Hugging Face directory a job starts from (``initFrom.huggingFace``), as the API found it at
    submission: enough to tell later whether the directory the job loaded is still that one."""

    directory: str = Field(description="as the spec names it, relative to the tenant's prefix")
    uri: str = Field(description="file:// URI of the directory, symlinks resolved")
    config_sha256: str = Field(description="sha256 of its config.json")
    weight_files: dict[str, int] = Field(description="safetensors file -> size in bytes")
    index_sha256: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                     description="sha256 of model.safetensors.index.json, when sharded")
    export_sha256: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                      description="sha256 of trainyard-export.json (the export artifact's hash), "
                                                  "when the directory is a trainyard export")


class JobRecord(Record):
    job_id: str
    tenant: str
    spec: TrainingSpec
    spec_hash: str
    state: JobState = "queued"
    priority: int = 0
    submitted_by: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    reason: str | None = Field(default=None, description="why it failed or was cancelled")
    queued_reason: str | None = Field(default=None, description="why it waits, while queued")
    queued_reason_kind: str | None = Field(
        default=None, description="quota | capacity | topology | priority | preemption | backoff | quarantine | "
                                  "maintenance | interrupted | checkpoint, while queued"
    )
    attempts: list[AttemptRecord] = []
    max_attempts: int = 3
    traceparent: str | None = None
    control: Literal["cancel", "pause"] | None = Field(default=None, description="pending control action")
    triggered_by: TriggerOrigin | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came with triggers: absent from earlier records
        description="the trigger that submitted the job, and the dataset version that set it off")
    hugging_face_start: HuggingFaceStart | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came with initFrom.huggingFace (issue #16)
        description="the Hugging Face directory it starts from (initFrom.huggingFace), as found at submission")
    experiment: ExperimentOrigin | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came with experiments (issue #36)
        description="the experiment that submitted the job as one of its trials, and the trial's point")

    @property
    def current(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None


def expects_final_checkpoint(job: JobRecord) -> bool:
    """Whether the job's success comes with a READY checkpoint at ``maxSteps`` (its final model).

    The built-in trainer always saves the last step. User code (``spec.code``) does when one of its
    ranks reported a shard of that step in the attempt that completed (the SDK saves the last step
    too); a script that saved none (one without the SDK) succeeds on its exit codes alone, and has
    no final model. An evaluation (``spec.evaluation``) trains nothing and saves none."""
    current = job.current
    if job.spec.evaluation is not None:
        return False
    return job.spec.code is None or (current is not None and current.final_saved)


class Progress(Record):
    attempt: int | None = None
    global_step: int = 0
    max_steps: int | None = None
    consumed_tokens: int = 0
    consumed_samples: int = 0
    last_loss: float | None = None
    lr: float | None = None
    tokens_per_second: float | None = Field(default=None, description="the attempt's throughput: attempt_tokens ÷ "
                                                                      "attempt_work_seconds (see progress.py)")
    mfu: float | None = None
    step_seconds: float | None = None
    attempt_tokens: float = Field(default=0.0, description="tokens of the attempt's steps after its first")
    attempt_work_seconds: float = Field(default=0.0, description="their step seconds without checkpoint stalls")
    updated_at: datetime | None = None


class CheckpointRecord(Record):
    job_id: str
    tenant: str
    attempt: int
    epoch: int
    global_step: int
    world_size: int
    state: CheckpointState = "PENDING"
    manifest_uri: str | None = None
    content_hash: str | None = Field(default=None, description="the manifest's contentHash: its files as written, "
                                                               "verified by the coordinator")
    tensors_hash: str | None = Field(default=None, description="the manifest's tensorsHash: the saved values, "
                                                               "as the ranks reported them (null: not reported)")
    consumed_tokens: int = 0
    reason: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    ready_at: datetime | None = None
    first_shard_at: datetime | None = Field(default=None, description="when the first rank wrote its shard report")
    last_shard_at: datetime | None = Field(default=None, description="when the last rank wrote its shard report")
    write_seconds: float | None = Field(
        default=None, description="slowest rank's save time (start to durable rename), when the ranks report it"
    )
    deleted_at: datetime | None = Field(
        default=None, description="when its files were removed (retention of a READY one, GC of a FAILED one)"
    )
    size_bytes: int | None = Field(
        default=None, ge=0, description="bytes of its manifest's shards and shared files, set when it became READY "
                                        "(null on records older than the field, and before READY)"
    )

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id(self.global_step, self.attempt)


def checkpoint_id(global_step: int, attempt: int) -> str:
    return f"step-{global_step:09d}-a{attempt}"


class Lineage(Record):
    spec_hash: str
    code_revision: str
    dataset: str
    dataset_manifest_uri: str | None = None
    dataset_sha256: str | None = None
    tokenizer: str | None = None
    model_config_ref: str | None = Field(default=None, alias="modelConfig")
    parent_checkpoint: str | None = Field(default=None, description="manifest the producing attempt started from")
    # came with user code (issue #13): absent from the JSON when the job ran the built-in trainer
    code_archive: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                     description="sha256:<hex> of the code archive the job ran")
    code_commit: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                    description="the git commit of that code, when known")
    # came with initFrom.huggingFace (issue #16): absent unless the job started from a Hugging Face directory
    parent_hugging_face: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="file:// URI of the Hugging Face directory the job's weights started from")
    # came with code.environment (issue #32): absent unless the job ran in its own environment
    environment: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="sha256:<hex> of the environment lock (code.environment) the job ran with")


class ArtifactRecord(Record):
    artifact_id: str
    job_id: str
    tenant: str
    type: Literal["checkpoint", "model", "export"]
    uri: str
    hash: str
    tensors_hash: str | None = Field(
        default=None, description="a checkpoint's or model's tensorsHash (its values, independent of DCP's metadata; "
                                  "as the ranks reported it): equal for runs that ended bitwise identical")
    producer_attempt: int
    global_step: int
    consumed_tokens: int = 0
    lineage: Lineage
    created_at: datetime = Field(default_factory=utcnow)
    retired_at: datetime | None = Field(
        default=None,
        description="when its checkpoint stopped being loadable (deleted by retention, refused at restore)"
    )
    retired_reason: str | None = Field(default=None, description="why it was retired")


ExportState = Literal["requested", "ready", "failed"]


class ExportRecord(Record):
    """An export's progress (``ty:export:<id>``); once ``ready`` its ``ArtifactRecord`` (type export)
    holds the directory and hash, like any artifact."""

    export_id: str
    checkpoint_artifact_id: str
    job_id: str
    tenant: str
    format: str
    state: ExportState = "requested"
    requested_by: str
    requested_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
    uri: str | None = Field(default=None, description="the export directory, once ready")
    hash: str | None = Field(default=None, description="sha256 of its file listing, once ready")
    reason: str | None = Field(default=None, description="why it failed")
    problems: list[str] = []


class DatasetRecord(Record):
    """A verified dataset version (the registry writes it only after its manifest and shards check out)."""

    name: str
    version: str
    tenant: str | None = Field(default=None, description="the owner; null: the platform's (every tenant may use it)")
    shared_with: list[str] = Field(default=[], description='other tenants that may train on it; ["*"]: every tenant')
    manifest_uri: str
    sha256: str
    tokenizer: str | None = None
    num_tokens: int | None = None
    vocab_size: int | None = Field(default=None, description="its tokenizer's vocabulary, from the verified manifest")
    dtype: str | None = Field(default=None, description="how its token ids are stored (uint16, uint32)")
    published_at: datetime = Field(default_factory=utcnow)

    @property
    def ref(self) -> str:
        """The qualified reference: ``tenant/name@version``, or ``name@version`` for the platform's."""
        return dataset_key(self.tenant, self.name, self.version)


class DatasetRejection(Record):
    """A published version the registry refused (kept apart from verified ones, so it never shadows one)."""

    name: str
    version: str
    tenant: str | None = None
    manifest_uri: str
    sha256: str
    reason: str
    problems: list[str] = []
    published_event_id: str | None = None
    rejected_at: datetime = Field(default_factory=utcnow)

    @property
    def ref(self) -> str:
        return dataset_key(self.tenant, self.name, self.version)


def dataset_visible(record: DatasetRecord, tenant: str | None) -> bool:
    """May ``tenant`` see and train on ``record``: the platform's, its own, or shared with it (or with "*")."""
    if record.tenant is None or "*" in record.shared_with:
        return True
    return tenant is not None and (record.tenant == tenant or tenant in record.shared_with)


def dataset_conflict(existing: DatasetRecord, sha256: str) -> str | None:
    """Why a publish of ``existing``'s ref with content ``sha256`` is refused (None: the same content, an
    idempotent re-publish). A dataset version is immutable: the same ref with other content is refused —
    by the API when it already knows the version (409), by the registry for what reaches it anyway."""
    if existing.sha256 != sha256:
        return (
            f"dataset {existing.ref} was already published with sha256 {existing.sha256}; "
            f"a re-publish with sha256 {sha256} is refused (a new version needs a new name@version)"
        )
    return None


def dataset_candidates(ref: str, tenant: str | None) -> list[str]:
    """The qualified refs ``ref`` may mean for ``tenant``, in order: an unqualified ``n@v`` is the
    tenant's own ``tenant/n@v``, else the platform's ``n@v``; a qualified one is itself."""
    parsed = DatasetRef.parse(ref)
    if parsed.tenant is not None:
        return [str(parsed)]
    own = [dataset_key(tenant, parsed.name, parsed.version)] if tenant else []
    return [*own, str(parsed)]


def resolve_dataset(
    ref: str, tenant: str | None, records: Mapping[str, DatasetRecord]
) -> DatasetRecord | None:
    """The dataset ``ref`` names for ``tenant`` among ``records`` (by qualified ref); None when it is
    unknown or not visible to it (the same answer, so another tenant's names do not leak)."""
    for candidate in dataset_candidates(ref, tenant):
        record = records.get(candidate)
        if record is not None and dataset_visible(record, tenant):
            return record
    return None


class NodeRecord(Record):
    node_id: str
    host: str
    rack: str | None = None
    nvlink_domain: str | None = None
    devices: list[DeviceInfo]
    healthy: bool = True
    last_seen: datetime = Field(default_factory=utcnow)
    quarantined: str | None = None
    network_tier: str | None = None
    drained: str | None = Field(default=None, description="why it takes no new work (a drain), while drained")
    boot_id: str | None = Field(default=None, description="its node agent's incarnation (a restart changes it)")
    sandbox: str | None = Field(default=None, description="how its agent confines ranks (NodeHeartbeat.sandbox)")
    warm_interpreters: int | None = Field(default=None, description="NodeHeartbeat.warmInterpreters")


TokenRole = Literal["viewer", "submitter", "tenant-admin", "platform-admin"]


class TenantToken(Record):
    """An API token (stored under the sha256 of its secret). ``role`` None is a token written before roles:
    ``admin`` true reads as platform-admin, false as submitter (see :attr:`effective_role`)."""

    tenant: str
    name: str = "default"
    admin: bool = Field(default=False, description="may use the /v1/admin routes (nodes) and see every tenant")
    created_at: datetime = Field(default_factory=utcnow)
    token_id: str | None = Field(default=None, description="public id (listing, revocation); never the secret")
    role: TokenRole | None = Field(default=None, description="what it may do; None: from ``admin`` (old records)")
    expires_at: datetime | None = Field(default=None, description="refused from then on; None: never expires")
    revoked_at: datetime | None = Field(default=None, description="refused since then (kept to say so)")
    created_by: str | None = Field(default=None, description="token id of whoever created it")

    @property
    def effective_role(self) -> TokenRole:
        if self.role is not None:
            return self.role
        return "platform-admin" if self.admin else "submitter"


DELETED_TENANT_SETTINGS = '{"deleted": true}'  # in ty:sched:tenant-config: deleted through the API, never re-seeded


def is_deleted_tenant(raw: str | bytes | None) -> bool:
    """Whether a ``ty:sched:tenant-config`` entry is the tombstone of a tenant deleted through the API."""
    if raw is None:
        return False
    try:
        value = json.loads(raw)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("deleted") is True


class TenantRecord(Record):
    """A tenant created through the API (``ty:tenants``); its queue settings live with the scheduler's
    (``ty:sched:tenant-config``)."""

    tenant: str
    created_at: datetime = Field(default_factory=utcnow)
    created_by: str | None = Field(default=None, description="token id of the platform admin who created it")


TriggerSource = Literal["own", "platform", "shared"]
TriggerOn = Literal["datasetVersion", "checkpointReady"]
"""Whose datasets a trigger watches: its tenant's own, the platform's (no tenant), or other tenants' that
are shared with its tenant."""


class TriggerRecord(Record):
    """A tenant's trigger: each new verified version of a dataset whose name matches ``dataset`` (a glob)
    and whose owner is one of ``sources`` submits a job from ``template`` with that version.

    ``template`` is a training spec without ``dataset`` (camelCase, as submitted), validated at creation.

    ``on: checkpointReady``: each READY checkpoint of the job ``job`` (or of a job of the experiment
    ``experiment``) whose step is a multiple of ``every_steps`` submits ``template`` (an evaluation, without
    ``initFrom``) with ``initFrom`` set to that checkpoint and ``dataset`` to the trained job's."""

    trigger_id: str
    tenant: str
    name: str
    on: TriggerOn = "datasetVersion"
    dataset: str = Field(default="", description="a glob over dataset names (fnmatch, case-sensitive): wiki-*, "
                                                 "tinycorpus; empty for a checkpointReady trigger")
    job: str | None = Field(default=None, description="checkpointReady: the watched job")
    experiment: str | None = Field(default=None, description="checkpointReady: the watched experiment's jobs")
    every_steps: int | None = Field(default=None, ge=1, description="checkpointReady: only steps that are "
                                                                      "multiples of it (unset: every READY)")
    sources: list[TriggerSource] = ["own"]
    template: dict[str, object]
    enabled: bool = True
    created_by: str | None = None
    created_at: datetime = Field(default_factory=utcnow)


class TriggerFailure(Record):
    """The last time a trigger could not submit its job (the template no longer validates, …)."""

    at: datetime
    dataset: str = Field(description="the dataset version, or (checkpointReady) the checkpoint artifact")
    event_id: str
    message: str
    problems: list[dict[str, str]] = []


class EvaluationResult(Record):
    """One evaluation of a READY checkpoint, attached by the registry (``ty:evals:<job>``, field: the
    evaluation job's id): the checkpoint is the one the evaluation job's spec names (``initFrom``, as the API
    stored it), never what the rank claimed; ``metrics`` as the rank reported them, bounded."""

    evaluation_job_id: str
    checkpoint_id: str = Field(description="the checkpoint's artifact id in the registry")
    global_step: int
    metrics: dict[str, float]
    finished_at: datetime

