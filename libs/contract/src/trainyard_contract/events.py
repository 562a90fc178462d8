"""Event models and topics: the public contract of trainyard (docs/design.md §4).

Every event carries ``eventId`` (uuid, for idempotent consumers), ``eventType``,
``schemaVersion`` and ``occurredAt``; it travels as camelCase JSON, keyed by job id
(or node id) so per-job order holds, with the W3C trace context in Kafka headers.

Rules for changing this module: changes are additive (new optional fields); unknown
fields are ignored on read so older consumers keep working; a breaking change is a
new event name.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, TypeAlias, Union
from uuid import UUID, uuid4

from pydantic import Field, TypeAdapter

from trainyard_contract.spec import TrainingSpec
from trainyard_contract.wirebase import CheckpointRef, JobState, PlacementDetail
from trainyard_contract.wirebase import FrozenWire as _Wire

# ----------------------------------------------------------------------------- topics

JOBS = "trainyard.jobs"
NODES = "trainyard.nodes"
ALLOCATIONS = "trainyard.allocations"
WORKERS = "trainyard.workers"
CHECKPOINTS = "trainyard.checkpoints"
METRICS = "trainyard.metrics"
DATASETS = "trainyard.datasets"
REGISTRY = "trainyard.registry"
EXPORTS = "trainyard.exports"
DEADLETTER = "trainyard.deadletter"

ALL_TOPICS: tuple[str, ...] = (
    JOBS, NODES, ALLOCATIONS, WORKERS, CHECKPOINTS, METRICS, DATASETS, REGISTRY, EXPORTS, DEADLETTER,
)

TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


def utcnow() -> datetime:
    return datetime.now(UTC)


class Event(_Wire):
    """Common envelope fields. Subclasses pin ``event_type`` and declare ``topic``."""

    topic: ClassVar[str]

    event_id: UUID = Field(default_factory=uuid4)
    event_type: str
    schema_version: int = 1
    occurred_at: datetime = Field(default_factory=utcnow)

    def key(self) -> str:
        """Partition key: the job id, or the node id for node events."""
        return getattr(self, "job_id", None) or getattr(self, "node_id")  # noqa: B009 - not every Event has one

    def to_bytes(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


# ----------------------------------------------------------------------------- jobs


class JobSubmitted(Event):
    topic: ClassVar[str] = JOBS
    event_type: Literal["JobSubmitted"] = "JobSubmitted"
    job_id: str = Field(min_length=1, max_length=128)
    tenant: str = Field(min_length=1, max_length=128)
    spec: TrainingSpec
    spec_hash: str
    submitted_by: str | None = None


class JobControlRequested(Event):
    topic: ClassVar[str] = JOBS
    event_type: Literal["JobControlRequested"] = "JobControlRequested"
    job_id: str
    tenant: str
    action: Literal["cancel", "pause", "resume"]
    reason: str | None = None


class JobStateChanged(Event):
    topic: ClassVar[str] = JOBS
    event_type: Literal["JobStateChanged"] = "JobStateChanged"
    job_id: str
    tenant: str
    state: JobState
    previous_state: JobState | None = None
    attempt: int | None = None
    reason: str | None = None


# ----------------------------------------------------------------------------- nodes


class DeviceInfo(_Wire):
    index: int = Field(ge=0)
    type: str
    memory_bytes: int = Field(ge=0)
    healthy: bool = True


class NodeHeartbeat(Event):
    topic: ClassVar[str] = NODES
    event_type: Literal["NodeHeartbeat"] = "NodeHeartbeat"
    node_id: str
    host: str
    rack: str | None = None
    nvlink_domain: str | None = None
    devices: list[DeviceInfo]
    healthy: bool = True
    running_allocations: list[str] = []
    seq: int = 0
    network_tier: str | None = Field(
        default=None, description="network block above the rack (pod / spine group); racks of one tier are closer"
    )
    draining: bool = Field(default=False, description="the node is stopping on purpose: its attempts checkpoint "
                                                      "and stop, nothing new is placed there")
    boot_id: str | None = Field(default=None, description="the node agent's incarnation; a new one ends a drain")
    sandbox: str | None = Field(
        default=None, description="how the node confines ranks: 'enforce' (each job's ranks as their own user, in a "
                                  "mount namespace showing only their own paths) or 'trusted-single-tenant' "
                                  "(unsandboxed); None from agents older than the field")
    warm_interpreters: int | None = Field(
        default=None, ge=0,
        description="interpreters the agent keeps with the trainer imported, so a new attempt's ranks start in "
                    "them instead of a cold python (TRAINYARD_WARM_RANKS; by default sized to the node's devices "
                    "and memory); None from agents older than the field")


class NodeQuarantined(Event):
    """A node the scheduler stops placing on: repeated failures or straggling (or an admin)."""

    topic: ClassVar[str] = NODES
    event_type: Literal["NodeQuarantined"] = "NodeQuarantined"
    node_id: str
    reason: str
    score: float | None = Field(default=None, description="the node's decayed failure score when quarantined")
    until: datetime | None = Field(
        default=None, description="when it returns on its own if nothing new happens (None: only an admin clears it)"
    )
    by: str | None = Field(default=None, description="who quarantined it: 'reputation' or an admin's name")


class NodeReinstated(Event):
    """A quarantined node is placeable again: an admin cleared it, or its score decayed."""

    topic: ClassVar[str] = NODES
    event_type: Literal["NodeReinstated"] = "NodeReinstated"
    node_id: str
    reason: str
    by: str | None = None


class NodeDrained(Event):
    """A node taken out of service on purpose (maintenance): nothing new is placed there, and the attempts
    running there checkpoint at an agreed step and stop, interrupted by maintenance (no failure, no blame).
    It ends with NodeUndrained or when the node's agent restarts."""

    topic: ClassVar[str] = NODES
    event_type: Literal["NodeDrained"] = "NodeDrained"
    node_id: str
    reason: str
    by: str | None = Field(default=None, description="an admin's name, or 'node-agent'")


class NodeUndrained(Event):
    """A drained node takes new work again."""

    topic: ClassVar[str] = NODES
    event_type: Literal["NodeUndrained"] = "NodeUndrained"
    node_id: str
    reason: str
    by: str | None = None


# ----------------------------------------------------------------------------- allocations


class RankAssignment(_Wire):
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    device_index: int = Field(ge=0)


class NodeAssignment(_Wire):
    node_id: str
    host: str
    ranks: list[RankAssignment]


class GangAllocated(Event):
    topic: ClassVar[str] = ALLOCATIONS
    event_type: Literal["GangAllocated"] = "GangAllocated"
    job_id: str
    tenant: str
    attempt: int = Field(ge=1)
    allocation_id: str
    epoch: int = Field(ge=1)
    world_size: int = Field(ge=1)
    nodes: list[NodeAssignment]
    master_addr: str
    master_port: int = Field(gt=0, lt=65536)
    start_checkpoint: CheckpointRef | None = None
    spec: TrainingSpec
    spec_hash: str
    placement_score: float | None = None
    placement_detail: PlacementDetail | None = None
    checkpoint_every_steps: int | None = Field(
        default=None, gt=0,
        description="checkpoint interval for this attempt when the spec says checkpointPolicy.auto "
                    "(the coordinator's Young/Daly advice); overrides everySteps/everyMinutes",
    )
    lighthouse_port: int | None = Field(
        default=None, gt=0, lt=65536,
        description="faultTolerance: the port of the job's torchft Lighthouse, which the node of rank 0 runs at "
                    "master_addr for the attempt (drawn like master_port)",
    )


class ReplicaReplaced(Event):
    """The scheduler replaces one failed replica of a running fault-tolerant attempt (``faultTolerance``): the node
    that holds its devices starts the rank again, as ``generation``, into the same allocation; it heals from a
    healthy peer and joins the next quorum. The attempt, its epoch and the other replicas go on."""

    topic: ClassVar[str] = ALLOCATIONS
    event_type: Literal["ReplicaReplaced"] = "ReplicaReplaced"
    job_id: str
    attempt: int
    allocation_id: str
    epoch: int
    node_id: str
    rank: int = Field(ge=0)
    generation: int = Field(ge=1, description="the newcomer's generation (the failed one's + 1)")
    reason: str = Field(description="why the replica failed, as its WorkerExited said")


class CheckpointRequested(Event):
    """The scheduler asks a running attempt to checkpoint soon and stop: preemption, pause, or a drain of one
    of its nodes (a stopping node agent also hands one to its own ranks).

    Additive: ranks that do not act on it still checkpoint every ``everySteps``; the scheduler
    revokes the allocation once a newer checkpoint is READY or at ``deadline``, whichever is first.
    """

    topic: ClassVar[str] = ALLOCATIONS
    event_type: Literal["CheckpointRequested"] = "CheckpointRequested"
    job_id: str
    attempt: int
    allocation_id: str
    epoch: int
    reason: str
    requested_by: str | None = Field(default=None, description="the job the devices are wanted for")
    deadline: datetime | None = None


class AllocationRevoked(Event):
    topic: ClassVar[str] = ALLOCATIONS
    event_type: Literal["AllocationRevoked"] = "AllocationRevoked"
    job_id: str
    attempt: int
    allocation_id: str
    epoch: int
    reason: str


# ----------------------------------------------------------------------------- workers


class WorkerStarted(Event):
    topic: ClassVar[str] = WORKERS
    event_type: Literal["WorkerStarted"] = "WorkerStarted"
    job_id: str
    attempt: int
    allocation_id: str
    epoch: int
    node_id: str
    rank: int
    pid: int
    log_uri: str
    start: Literal["warm", "cold"] | None = Field(
        default=None, description="warm: forked from an interpreter that had imported torch and the trainer; "
                                  "cold: a new interpreter (user code, or no warm interpreter free)")
    start_detail: str | None = Field(default=None, description="why it started warm or cold")
    generation: int = Field(
        default=0, ge=0, description="the rank's replica generation: 0 as launched with the gang, n after its n-th "
                                     "replacement (faultTolerance); an event of an older generation is stale")


class EnvironmentPreparing(Event):
    """A node prepares a job's environment (``code.environment``) before its ranks there start: building it
    (sent again as it progresses), ready (built now, or found in the node's cache), or failed (the ranks then
    exit with the same detail: ``config`` for the lock's fault, ``error`` for the node's). Every one restarts the
    attempt's start time-out."""

    topic: ClassVar[str] = WORKERS
    event_type: Literal["EnvironmentPreparing"] = "EnvironmentPreparing"
    job_id: str
    attempt: int
    allocation_id: str
    epoch: int
    node_id: str
    environment: str = Field(description="sha256:<hex> of the lock")
    state: Literal["building", "ready", "failed"]
    cached: bool = Field(default=False, description="ready from the node's cache, not built for this attempt")
    packages: int = Field(default=0, description="distributions the lock pins for this node's Python")
    elapsed_seconds: float = 0.0
    detail: str | None = Field(default=None, description="the installer's latest line, or why it failed")


class WorkerExited(Event):
    topic: ClassVar[str] = WORKERS
    event_type: Literal["WorkerExited"] = "WorkerExited"
    job_id: str
    attempt: int
    allocation_id: str
    epoch: int
    node_id: str
    rank: int
    exit_code: int
    reason: str = Field(
        description="ok | error | config | nan | oom | checkpoint | data | nccl | hang | killed | "
                    "signal-<n> | revoked | preempted | lost | security"
    )
    detail: str | None = None
    global_step: int | None = Field(
        default=None, description="the last global step the rank completed (or failed at, for nan), when known"
    )
    saved_step: int | None = Field(
        default=None, description="the last global step this rank reported a checkpoint shard of in this attempt "
                                  "(relayed before this exit); None: it reported none",
    )
    generation: int = Field(
        default=0, ge=0, description="the rank's replica generation: 0 as launched with the gang, n after its n-th "
                                     "replacement (faultTolerance); an event of an older generation is stale")


class AttemptEnded(Event):
    topic: ClassVar[str] = WORKERS
    event_type: Literal["AttemptEnded"] = "AttemptEnded"
    job_id: str
    attempt: int
    allocation_id: str
    epoch: int
    outcome: Literal["succeeded", "failed", "revoked"]
    reason: str | None = None


class StragglerDetected(Event):
    topic: ClassVar[str] = WORKERS
    event_type: Literal["StragglerDetected"] = "StragglerDetected"
    job_id: str
    attempt: int
    rank: int
    node_id: str
    slowdown: float = Field(description="the rank's compute time ÷ the median rank's, over the window")
    compute_seconds: float | None = Field(default=None, description="the rank's median compute time per step")
    median_compute_seconds: float | None = Field(default=None, description="median over all ranks")
    window_steps: int | None = None
    from_step: int | None = None
    to_step: int | None = None


class SecurityViolation(Event):
    """A rank claimed what a rank may not (a node agent refused the claim): the job fails, not retried.

    Published by the node agent, never relayed from a rank. ``kind``: ``spool`` (an event line the
    agent refused as a forgery: another job's identity, a type ranks do not produce, a file outside
    the job's prefix)."""

    topic: ClassVar[str] = WORKERS
    event_type: Literal["SecurityViolation"] = "SecurityViolation"
    job_id: str
    tenant: str
    attempt: int
    allocation_id: str
    epoch: int
    node_id: str
    rank: int
    kind: Literal["spool"] = "spool"
    detail: str
    refused_event_type: str | None = Field(default=None, description="the eventType of the refused line")


# ----------------------------------------------------------------------------- checkpoints


class FileDigest(_Wire):
    uri: str
    size_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class TensorDigest(_Wire):
    """sha256 of one entry of the checkpointed state as a rank saved it: a tensor (or the chunk of a
    sharded one at ``offset``) or another object. The hash covers the key, dtype, shape and the raw
    little-endian bytes of the contiguous tensor (:mod:`trainyard.tensorhash` says exactly how), so it
    is the same for the same values whatever file, process or DCP metadata they were saved with."""

    key: str = Field(description="the entry's fully qualified key in the checkpointed state, e.g. "
                                 "model.layers.0.attn.weight, optimizer.state.wte.weight.exp_avg, rng.rank_1.torch")
    offset: list[int] = Field(default=[], description="where the saved chunk starts in the whole tensor (zeros for "
                                                      "an unsharded tensor; empty for a scalar or an object that is "
                                                      "not a tensor)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ShardWritten(Event):
    topic: ClassVar[str] = CHECKPOINTS
    event_type: Literal["ShardWritten"] = "ShardWritten"
    job_id: str
    tenant: str
    attempt: int
    epoch: int
    global_step: int = Field(ge=0)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    uri: str
    size_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    extra_files: list[FileDigest] = Field(
        default=[], description="files shared by all ranks (the DCP .metadata), reported by rank 0"
    )
    consumed_tokens: int = 0
    consumed_samples: int = 0
    spec_hash: str | None = None
    parallelism: dict[str, int] = {}
    write_seconds: float | None = Field(
        default=None, ge=0, description="this rank's save, from its start to the durable rename"
    )
    stall_seconds: float | None = Field(default=None, ge=0, description="how long training waited for this save")
    tensor_digests: list[TensorDigest] | None = Field(
        default=None, description="the digest of every entry this rank wrote into its shard (after DCP's "
                                  "de-duplication, each entry is written by one rank); the coordinator combines "
                                  "them into the manifest's tensorsHash. Null from a rank that does not report them")


class CheckpointReady(Event):
    topic: ClassVar[str] = CHECKPOINTS
    event_type: Literal["CheckpointReady"] = "CheckpointReady"
    job_id: str
    tenant: str
    attempt: int
    epoch: int
    global_step: int
    world_size: int
    manifest_uri: str
    content_hash: str = Field(description="sha256 over the manifest's files as written (the DCP .metadata "
                                          "included): what the coordinator verified on disk")
    consumed_tokens: int = 0
    tensors_hash: str | None = Field(
        default=None, description="sha256 over the saved tensors' content (keys, dtypes, shapes, values), independent "
                                  "of DCP's metadata: equal for bitwise-identical checkpoints; as the ranks reported "
                                  "it. Null when a rank did not report its tensors")


class CheckpointFailed(Event):
    topic: ClassVar[str] = CHECKPOINTS
    event_type: Literal["CheckpointFailed"] = "CheckpointFailed"
    job_id: str
    tenant: str | None = None
    attempt: int
    global_step: int
    reason: str


class CheckpointRefused(Event):
    """A rank's restore verification refused a READY checkpoint (missing or corrupt shard).

    The coordinator marks it FAILED with the problems, so no later attempt is handed it again.
    """

    topic: ClassVar[str] = CHECKPOINTS
    event_type: Literal["CheckpointRefused"] = "CheckpointRefused"
    job_id: str
    tenant: str
    attempt: int = Field(description="the attempt that refused it")
    manifest_uri: str
    global_step: int
    checkpoint_attempt: int | None = Field(default=None, description="the attempt that wrote it")
    problems: list[str] = []


EVALUATION_MAX_METRICS = 32
"""How many numbers one EvaluationReported may carry."""
EVALUATION_METRIC_NAME = r"^[A-Za-z][A-Za-z0-9_.\-/]{0,63}$"
"""A metric's name: a letter, then up to 63 letters, digits, ``_ . - /`` (what MLflow and TensorBoard take)."""

EvaluationMetricName = Annotated[str, Field(pattern=EVALUATION_METRIC_NAME)]
EvaluationMetricValue = Annotated[float, Field(allow_inf_nan=False)]


class EvaluationReported(Event):
    """An evaluation job's rank 0 reports what it measured of the checkpoint it evaluated (``run.report_evaluation``).
    A claim of a rank: the registry attaches it to the checkpoint the job's spec names (``initFrom``), never to one
    the event names, and only for a job whose spec says ``evaluation``. Bounded: at most
    :data:`EVALUATION_MAX_METRICS` finite numbers under names of :data:`EVALUATION_METRIC_NAME`."""

    topic: ClassVar[str] = CHECKPOINTS
    event_type: Literal["EvaluationReported"] = "EvaluationReported"
    job_id: str
    tenant: str
    attempt: int
    rank: int = Field(ge=0)
    metrics: dict[EvaluationMetricName, EvaluationMetricValue] = Field(
        min_length=1, max_length=EVALUATION_MAX_METRICS,
        description="the evaluation's numbers: the built-in evaluator's loss and perplexity, or the user's")


# ----------------------------------------------------------------------------- metrics


class StepMetrics(Event):
    topic: ClassVar[str] = METRICS
    event_type: Literal["StepMetrics"] = "StepMetrics"
    job_id: str
    tenant: str | None = None
    attempt: int
    rank: int
    step: int = Field(description="global step completed")
    max_steps: int | None = None
    loss: float
    lr: float | None = None
    consumed_tokens: int = Field(description="tokens consumed by the whole job so far")
    consumed_samples: int = 0
    tokens_per_second: float | None = None
    mfu: float | None = None
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    collective_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    metrics: dict[str, float] = Field(
        default={}, max_length=64, description="the training script's own numbers for this step (grad norm, "
                                               "accuracy, …), as it reported them "
                                               "(`run.report(step, loss=…, **metrics)`)",
    )


# ----------------------------------------------------------------------------- datasets


class DatasetVersionPublished(Event):
    """A dataset version's files and manifest are in place; the registry verifies them before the
    version is visible. ``tenant`` owns it (its files under ``tenants/<tenant>/datasets/``); without
    one it is the platform's, under ``datasets/``, and every tenant may train on it."""

    topic: ClassVar[str] = DATASETS
    event_type: Literal["DatasetVersionPublished"] = "DatasetVersionPublished"
    name: str
    version: str
    manifest_uri: str
    sha256: str
    tokenizer: str | None = None
    num_tokens: int | None = None
    tenant: str | None = Field(default=None, description="the owner; null: the platform's (every tenant may use it)")
    shared_with: list[str] = Field(
        default=[], max_length=256,
        description='other tenants that may train on it; ["*"]: every tenant',
    )

    def key(self) -> str:
        return dataset_key(self.tenant, self.name, self.version)


class DatasetRejected(Event):
    """The registry refused a published version (its manifest or a shard does not match its sha256,
    it is not under its owner's prefix, a different version was published under the same name):
    it stays invisible, and ``reason`` says why."""

    topic: ClassVar[str] = DATASETS
    event_type: Literal["DatasetRejected"] = "DatasetRejected"
    name: str
    version: str
    tenant: str | None = None
    manifest_uri: str
    sha256: str
    reason: str
    problems: list[str] = Field(default=[], max_length=64, description="each thing found wrong")
    published_event_id: UUID | None = Field(default=None, description="the DatasetVersionPublished refused")

    def key(self) -> str:
        return dataset_key(self.tenant, self.name, self.version)


def dataset_key(tenant: str | None, name: str, version: str) -> str:
    """The qualified reference of a dataset version (also its partition key): ``tenant/name@version``,
    or ``name@version`` for the platform's."""
    return f"{tenant}/{name}@{version}" if tenant else f"{name}@{version}"


# ----------------------------------------------------------------------------- registry (downstream)

ArtifactKind = Literal["dataset", "checkpoint", "model", "export"]
ExportFormat = Literal["hf"]


class ArtifactLineage(_Wire):
    """Where a checkpoint or model came from (the registry's lineage, as it travels)."""

    spec_hash: str
    code_revision: str
    dataset: str
    dataset_manifest_uri: str | None = None
    dataset_sha256: str | None = None
    tokenizer: str | None = None
    model_config_ref: str | None = Field(default=None, alias="modelConfig")
    parent_checkpoint: str | None = None
    code_archive: str | None = None
    code_commit: str | None = None
    parent_hugging_face: str | None = Field(
        default=None, description="the Hugging Face directory (file:// URI) the job's weights started from")
    environment: str | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="sha256:<hex> of the environment lock (code.environment) the job ran with")


class ArtifactRegistered(Event):
    """The registry recorded an artifact: a verified dataset version, a READY checkpoint, a finished
    job's model, or an export of a checkpoint (``kind`` export: a Hugging Face model directory). The
    public feed for services outside trainyard (evaluation, serving, billing)."""

    topic: ClassVar[str] = REGISTRY
    event_type: Literal["ArtifactRegistered"] = "ArtifactRegistered"
    artifact_id: str = Field(description="a checkpoint's, model's or export's artifact id; a dataset's qualified ref")
    kind: ArtifactKind
    tenant: str | None = Field(description="the owner (null: a platform dataset)")
    uri: str = Field(description="the manifest: what a reader opens (an export: its directory)")
    hash: str = Field(description="sha256 of the manifest (a dataset's), the checkpoint's content hash, or an "
                                  "export's: sha256 of its file listing, trainyard-export.json")
    tensors_hash: str | None = Field(
        default=None, description="a checkpoint's or model's hash of its tensors' content, independent of DCP's "
                                  "metadata (the manifest's tensorsHash): compare runs with it, as the ranks "
                                  "reported it. Null for datasets, exports and checkpoints without one")
    job_id: str | None = None
    global_step: int | None = None
    consumed_tokens: int | None = None
    lineage: ArtifactLineage | None = Field(default=None, description="for checkpoints, models and exports (an "
                                                                       "export's parentCheckpoint: the checkpoint "
                                                                       "it was converted from)")
    dataset: str | None = Field(default=None, description="for a dataset: its qualified ref, tenant/name@version")
    shared_with: list[str] = []
    tokenizer: str | None = None
    num_tokens: int | None = None

    def key(self) -> str:
        return self.job_id or self.artifact_id


class ArtifactRetired(Event):
    """An artifact stopped being loadable: its checkpoint was deleted by retention or refused at restore."""

    topic: ClassVar[str] = REGISTRY
    event_type: Literal["ArtifactRetired"] = "ArtifactRetired"
    artifact_id: str
    kind: ArtifactKind
    tenant: str | None
    uri: str
    hash: str
    job_id: str | None = None
    reason: str

    def key(self) -> str:
        return self.job_id or self.artifact_id


# ----------------------------------------------------------------------------- exports


def export_id(checkpoint_artifact_id: str, fmt: str) -> str:
    """An export's artifact id: ``<job>/export/<checkpoint dir name>/<format>``, one per checkpoint and
    format (so a second request for the same conversion is the same export)."""
    job_id, _, name = checkpoint_artifact_id.split("/", 2)
    return f"{job_id}/export/{name}/{fmt}"


class ExportRequested(Event):
    """Convert a READY checkpoint into another format (``hf``: a Hugging Face model directory).
    From the API (``POST /v1/registry/artifacts/{id}/export``) or the registry itself when a job whose
    spec says ``export`` succeeds; the registry verifies the checkpoint, converts it and answers with
    ``ArtifactRegistered(kind=export)`` or ``ExportFailed``."""

    topic: ClassVar[str] = EXPORTS
    event_type: Literal["ExportRequested"] = "ExportRequested"
    export_id: str = Field(description="the export's artifact id, export_id(checkpoint, format)")
    checkpoint_artifact_id: str
    job_id: str
    tenant: str
    format: ExportFormat
    requested_by: str = Field(description="who asked: a token id, or 'spec' for the spec's export")

    def key(self) -> str:
        return self.job_id


class ExportFailed(Event):
    """An export could not be made: the checkpoint is retired, fails verification, or cannot be
    converted (the reason says which). Nothing is left under the export's directory."""

    topic: ClassVar[str] = REGISTRY
    event_type: Literal["ExportFailed"] = "ExportFailed"
    export_id: str
    checkpoint_artifact_id: str
    job_id: str
    tenant: str
    format: ExportFormat
    reason: str
    problems: list[str] = Field(default=[], max_length=64, description="each thing found wrong")

    def key(self) -> str:
        return self.job_id


# ----------------------------------------------------------------------------- dead letters


class DeadLetter(Event):
    topic: ClassVar[str] = DEADLETTER
    event_type: Literal["DeadLetter"] = "DeadLetter"
    source_topic: str
    partition: int
    offset: int
    consumer_group: str
    key_b64: str | None = None
    raw_b64: str
    error: str

    def key(self) -> str:
        return f"{self.source_topic}/{self.partition}/{self.offset}"


# ----------------------------------------------------------------------------- decoding


def _union(*classes: type[Event]) -> Any:
    if len(classes) == 1:
        return TypeAdapter(classes[0])
    return TypeAdapter(Annotated[Union[classes], Field(discriminator="event_type")])  # type: ignore[arg-type]  # noqa: UP007 - a Union of a tuple, built at run time


TOPIC_EVENTS: dict[str, tuple[type[Event], ...]] = {
    JOBS: (JobSubmitted, JobControlRequested, JobStateChanged),
    NODES: (NodeHeartbeat, NodeQuarantined, NodeReinstated, NodeDrained, NodeUndrained),
    ALLOCATIONS: (GangAllocated, AllocationRevoked, CheckpointRequested, ReplicaReplaced),
    WORKERS: (WorkerStarted, WorkerExited, AttemptEnded, StragglerDetected, SecurityViolation,
              EnvironmentPreparing),
    CHECKPOINTS: (ShardWritten, CheckpointReady, CheckpointFailed, CheckpointRefused, EvaluationReported),
    METRICS: (StepMetrics,),
    DATASETS: (DatasetVersionPublished, DatasetRejected),
    REGISTRY: (ArtifactRegistered, ArtifactRetired, ExportFailed),
    EXPORTS: (ExportRequested,),
    DEADLETTER: (DeadLetter,),
}

_ADAPTERS: dict[str, TypeAdapter[Any]] = {t: _union(*cs) for t, cs in TOPIC_EVENTS.items()}

EVENT_TYPES: dict[str, type[Event]] = {
    cls.model_fields["event_type"].default: cls for cs in TOPIC_EVENTS.values() for cls in cs
}

AnyEvent: TypeAlias = Event


def decode_event(topic: str, raw: bytes) -> Event:
    """Parse and validate ``raw`` as one of the events of ``topic``.

    Raises ``ValueError`` (pydantic's ValidationError is one) for anything that is not
    a valid event of that topic; the bus sends such messages to the dead-letter topic.
    """
    try:
        adapter = _ADAPTERS[topic]
    except KeyError:
        raise ValueError(f"no events are defined for topic {topic!r}") from None
    return adapter.validate_json(raw)
