"""Response bodies of the REST API (camelCase on the wire, like the spec and the events).

The bodies the CLI reads too are defined once, in ``trainyard_contract.wire``, and re-exported here
under the same names; the rest are the API's own.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from trainyard_contract.events import DeviceInfo, JobState
from trainyard_contract.records import (
    ArtifactRecord,
    DatasetRecord,
    EvaluationResult,
    ExportRecord,
    ExperimentOrigin,
    HuggingFaceStart,
    TriggerOn,
    TriggerOrigin,
    TriggerSource,
)
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.wire import (  # the bodies the CLI reads too: defined there, published under these names
    ApiModel,
    AttemptView,
    CheckpointList,
    CheckpointView,
    CodeArchiveView,
    ControlResponse,
    DatasetPublished,
    ExportFile,
    JobPage,
    JobSummary,
    NodeEnvironmentView,
    ReplicaReplacementView,
    ProgressView,
    SubmitResponse,
    TriggerJobView,
)

__all__ = [
    "ArtifactList",
    "ArtifactView",
    "EvaluationList",
    "AttemptView",
    "NodeEnvironmentView",
    "ReplicaReplacementView",
    "AuditEntry",
    "AuditPage",
    "CheckpointAdviceView",
    "CheckpointList",
    "CheckpointView",
    "CodeArchiveView",
    "ControlResponse",
    "DatasetList",
    "DatasetPublished",
    "DatasetRejectionView",
    "DatasetView",
    "DrainResponse",
    "EXAMPLE_SPEC",
    "EXAMPLE_TEMPLATE",
    "ErrorMessage",
    "ExportFile",
    "FieldErrorItem",
    "FieldErrors",
    "GoodputHistory",
    "GoodputIntervalView",
    "GoodputReport",
    "GoodputView",
    "Health",
    "IssuedToken",
    "JobCondition",
    "JobPage",
    "JobSummary",
    "JobView",
    "NodeDrainView",
    "NodeList",
    "NodeQuarantineView",
    "NodeView",
    "ProgressView",
    "QuotaView",
    "RankTimingView",
    "ReinstateResponse",
    "StragglerView",
    "SubmitResponse",
    "TenantList",
    "TenantSettingsView",
    "TenantView",
    "TokenList",
    "TokenView",
    "TriggerFailureView",
    "TriggerJobView",
    "TriggerList",
    "TriggerView",
    "WhoAmI",
]

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


_Out = ApiModel


class GoodputView(_Out):
    """Where allocated device-time went (device-seconds = seconds × world size, summed over attempts)."""

    allocated_device_seconds: float = Field(description="Σ attempts (end or now − start) × world size")
    productive_device_seconds: float = Field(
        description="step time of steps a READY checkpoint saved, or every step of the attempt that succeeded")
    wasted_device_seconds: float = Field(
        description="lostWork + launchRestore + checkpointStall + hang + replicaDown + idle")
    in_flight_device_seconds: float = Field(
        description="step time of a running attempt after its last READY checkpoint (neither saved nor lost yet)")
    goodput: float | None = Field(description="productive ÷ allocated; null before anything was allocated")
    wasted: dict[str, float] = Field(
        description="wasted device-seconds by cause: lostWork (steps after the last READY checkpoint of an attempt "
                    "that ended without success), launchRestore (attempt start → its first step), checkpointStall "
                    "(training waiting for saves), hang (last step → end of an attempt ended by hang detection), "
                    "replicaDown (faultTolerance: a failed replica's device from its failure until its newcomer "
                    "started, while the others trained on), idle (the rest; the parts add up to allocated exactly)",
        examples=[{"lostWork": 40.0, "launchRestore": 12.5, "checkpointStall": 3.1, "hang": 0.0, "idle": 2.4}])


class CheckpointAdviceView(_Out):
    """The checkpoint coordinator's Young/Daly advice for the job (refreshed after each READY)."""

    interval_steps: int | None = Field(description="the advised interval in steps")
    interval_seconds: float | None = Field(description="the advised interval in seconds")
    method: Literal["daly", "young"] | None = Field(description="which formula gave the interval")
    current_interval_steps: int | None = Field(description="the spec's interval, for comparison")
    current_wasted_fraction: float | None = Field(description="expected waste at the current interval")
    advised_wasted_fraction: float | None = Field(description="expected waste at the advised interval")
    auto: bool = Field(description="the job follows the advice (checkpointPolicy.mode auto)")
    inputs: dict[str, Any] = Field(
        description="what it was computed from: checkpointCostSeconds (and costSource), stepSeconds, jobMtbfSeconds "
                    "(and mtbfSource), devices, failures, exposureDeviceSeconds, youngIntervalSeconds, "
                    "dalyIntervalSeconds")
    note: str | None = None
    updated_at: datetime | None = None


class RankTimingView(_Out):
    """One rank's latest step of the current attempt, from its StepMetrics."""

    rank: int
    step: int
    at: datetime | None = None
    step_seconds: float
    compute_seconds: float
    collective_seconds: float
    data_wait_seconds: float
    checkpoint_seconds: float
    tokens_per_second: float | None = None
    mfu: float | None = None


class StragglerView(_Out):
    """A StragglerDetected report: a rank much slower than the median rank over a window of steps."""

    attempt: int
    rank: int
    node_id: str
    slowdown: float = Field(description="the rank's compute time ÷ the median rank's")
    compute_seconds: float | None = None
    median_compute_seconds: float | None = None
    window_steps: int | None = None
    from_step: int | None = None
    to_step: int | None = None
    occurred_at: datetime | None = None


class JobCondition(_Out):
    """Something wrong with a running job now (as a Kubernetes condition): it holds until the cause goes."""

    type: Literal["CheckpointsStalled"] = Field(
        description="CheckpointsStalled: the live attempt trains on, but none of its last checkpoints became "
                    "READY (a failure now loses every step since the newest READY one)")
    reason: str
    since: datetime | None = None
    attempt: int
    unprotected_intervals: int | None = Field(default=None,
                                              description="checkpoint intervals past the newest READY one")


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
    queued_reason_kind: str | None = Field(
        default=None, description="quota | capacity | topology | priority | preemption | backoff | quarantine | "
                                  "maintenance | interrupted | checkpoint (only while queued)")
    checkpoint_advice: CheckpointAdviceView | None = Field(
        default=None, description="Young/Daly checkpoint interval advice, once the coordinator has computed one")
    goodput: GoodputView | None = Field(default=None, description="the job's goodput ledger")
    rank_timing: list[RankTimingView] = Field(
        default=[], description="per rank of the current attempt: its latest compute / collective / data-wait / "
                                "checkpoint seconds and MFU")
    stragglers: list[StragglerView] = Field(default=[], description="the job's straggler reports, newest first")
    conditions: list[JobCondition] = Field(
        default=[], description="what is wrong with the running job now (CheckpointsStalled); empty when nothing")
    triggered_by: TriggerOrigin | None = Field(
        default=None, description="the trigger that submitted the job and the dataset version (and its "
                                  "ArtifactRegistered event) that set it off; null for a job submitted by hand")
    experiment: ExperimentOrigin | None = Field(
        default=None, description="the experiment that submitted the job as one of its trials, and the trial's "
                                  "point in the search space; null for a job submitted by hand")
    hugging_face_start: HuggingFaceStart | None = Field(
        default=None, description="the Hugging Face directory it starts from (initFrom.huggingFace) as the API "
                                  "found it at submission: config.json's sha256 and the weight files")
    children: list[str] = Field(
        default=[], description="ids of the tenant's jobs that start from this one (their initFrom.jobId), newest "
                                "first; the parent, if any, is spec.initFrom.jobId",
        examples=[["job-7d1e0c4b9a2f"]])


class ArtifactList(_Out):
    job_id: str
    artifacts: list[ArtifactRecord]


class EvaluationList(_Out):
    """The evaluations of a job's READY checkpoints (each by an evaluation job: docs/triggers.md), by step."""

    job_id: str
    evaluations: list[EvaluationResult] = Field(description="oldest step first; metrics as the evaluation reported "
                                                            "them (the built-in evaluator: loss, perplexity)")


class ArtifactView(_Out):
    """One artifact (any type), or an export in whatever state it is."""

    artifact_id: str = Field(examples=["job-3f2a9c1b7e4d/export/step-000000040-a1/hf"])
    type: Literal["checkpoint", "model", "export"]
    state: Literal["ready", "retired", "requested", "failed"] = Field(
        description="a checkpoint or model: ready or retired; an export: requested, ready or failed")
    artifact: ArtifactRecord | None = Field(default=None, description="the record, with lineage (an export: once "
                                                                      "ready)")
    export: ExportRecord | None = Field(default=None, description="an export's progress: requestedBy, reason and "
                                                                  "problems when it failed")
    evaluations: list[EvaluationResult] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="a checkpoint's: the evaluations attached to it (docs/triggers.md \"Evaluation on READY\")")
    files: list[ExportFile] | None = Field(
        default=None, description="a ready export's files (trainyard-export.json first), each downloadable at "
                                  "GET /v1/registry/artifacts/{exportId}/files/{name}")


class DatasetList(_Out):
    tenant: str = Field(description="the caller's tenant: its own versions live under tenants/<tenant>/datasets/")
    datasets: list[DatasetRecord] = Field(description="the verified versions the caller may use: its own, "
                                                      "the platform's, and those shared with its tenant")


class DatasetRejectionView(_Out):
    """A publish of a version's ref that the registry refused."""

    sha256: str = Field(description="the sha256 of the manifest that publish named")
    manifest_uri: str
    reason: str = Field(examples=["dataset acme/wiki@v1 was already published with sha256 …; a re-publish with "
                                  "sha256 … is refused (a new version needs a new name@version)"])
    problems: list[str] = Field(default=[], description="each thing the registry found wrong")
    rejected_at: datetime
    published_event_id: str | None = Field(default=None, description="the DatasetVersionPublished it answers")


class DatasetView(DatasetRecord):
    """A dataset version: verified (usable), or — shown to its owner only — rejected, with why."""

    state: Literal["verified", "rejected"]
    reason: str | None = Field(default=None, description="why the registry refused it (state rejected)")
    problems: list[str] = Field(default=[], description="each thing the registry found wrong")
    rejections: list[DatasetRejectionView] = Field(default=[], description=(
        "owner only, beside a verified version: a publish of the same ref the registry refused (the latest), "
        "such as a re-publish with another sha256; the verified version stays as it was"))


class StuckConsumer(_Out):
    """A service's consumer group that has not moved past one record of a partition (its handler keeps failing
    with an error it retries: Redis or the broker unreachable, or a bug); everything behind it on that
    partition waits."""

    service: str
    instance: str
    group: str
    topic: str
    partition: int
    offset: int
    tries: int = Field(description="failed tries of the record so far")
    since: float = Field(description="when the first try failed (seconds since the epoch)")
    error: str = Field(description="the last try's error")


class Health(_Out):
    status: Literal["ok", "degraded"] = Field(description="degraded: Redis or the broker is unavailable (503), "
                                                          "or a consumer is stuck on one record (200)")
    redis: bool
    broker: bool
    outbox_pending: int | None = None
    stuck_consumers: list[StuckConsumer] = Field(default_factory=list, description=(
        "consumers of any service stuck on one record (each service reports with its health beacon)"))
    worker: int = Field(default=0, description="the HTTP worker process that answered (0: the primary; "
                                               "TRAINYARD_API_WORKERS starts more on the same port)")


class GoodputReport(_Out):
    tenant: str = Field(description="the caller's tenant")
    jobs: int = Field(description="jobs summed")
    ledger: GoodputView
    tenants: dict[str, GoodputView] | None = Field(
        default=None, exclude_if=lambda v: v is None, description="every tenant's ledger (present with ?all=true)")


class GoodputIntervalView(_Out):
    """Device-seconds between two consecutive samples of a tenant's cumulative ledger."""

    start: datetime = Field(description="the earlier sample's bucket start")
    end: datetime = Field(description="the later sample's bucket start")
    allocated_device_seconds: float = Field(description="Δ allocated")
    productive_device_seconds: float = Field(description="Δ productive")
    in_flight_device_seconds: float = Field(
        description="Δ in flight (negative when in-flight work was saved or lost in the interval)")
    wasted_device_seconds: float = Field(description="Δ wasted")
    goodput: float | None = Field(
        description="Δproductive ÷ Δallocated; null when nothing was allocated. It can pass 1: steps count as "
                    "productive when a checkpoint saves them, which may be an interval after they ran")
    goodput_to_date: float | None = Field(
        default=None, description="productive ÷ allocated over everything up to the interval's end (within [0, 1]; "
                                  "what the Goodput page draws)")
    wasted: dict[str, float] = Field(description="Δ of each kind of waste",
                                     examples=[{"lostWork": 40.0, "launchRestore": 12.5, "checkpointStall": 3.1,
                                                "hang": 0.0, "idle": 2.4}])


class GoodputHistory(_Out):
    tenant: str = Field(description="the caller's tenant")
    bucket_seconds: int = Field(description="the sampling bucket (TRAINYARD_GOODPUT_HISTORY_BUCKET_S)")
    intervals: list[GoodputIntervalView] = Field(description="the caller's tenant's intervals, oldest first")
    tenants: dict[str, list[GoodputIntervalView]] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="every tenant's intervals (present with ?all=true, platform-admin)")


class NodeQuarantineView(_Out):
    reason: str | None = None
    by: str | None = Field(default=None, description="'reputation' (the scheduler) or an admin's name")
    score: float | None = None
    until: datetime | None = Field(default=None, description="when it returns on its own (null: only an admin)")
    at: datetime | None = None


class NodeDrainView(_Out):
    reason: str | None = None
    by: str | None = Field(default=None, description="an admin's name, or 'node-agent' (its agent is stopping)")
    at: datetime | None = None


class NodeView(_Out):
    node_id: str
    host: str
    rack: str | None
    nvlink_domain: str | None
    network_tier: str | None
    devices: list[DeviceInfo]
    healthy: bool
    last_seen: datetime
    quarantined: bool
    quarantine: NodeQuarantineView | None = Field(default=None, description="why and until when, when quarantined")
    drained: bool = Field(default=False, description="taken out of service on purpose: no new work; its attempts "
                                                     "checkpoint and stop, interrupted by maintenance")
    drain: NodeDrainView | None = Field(default=None, description="who drained it and why, when drained")
    reputation_score: float | None = Field(
        default=None, description="the scheduler's decaying failure score as last stored (null: none recorded)")
    reputation_at: datetime | None = Field(default=None, description="when that score was stored (it decays since)")
    sandbox: str | None = Field(
        default=None, description="how the node confines ranks: 'enforce' (each job's ranks as their own user, seeing "
                                  "only their own paths) or 'trusted-single-tenant' (unsandboxed: for one tenant's "
                                  "trusted code only); null: not reported by its agent")


class NodeList(_Out):
    nodes: list[NodeView]


class ReinstateResponse(_Out):
    node_id: str
    accepted: bool = True
    by: str = Field(description="the admin token's name, recorded in NodeReinstated.by")


class DrainResponse(_Out):
    node_id: str
    accepted: bool = True
    by: str = Field(description="the admin token's name, recorded in NodeDrained.by / NodeUndrained.by")


class FieldErrorItem(_Out):
    field: str = Field(examples=["training.globalBatchSize"])
    message: str


class FieldErrors(_Out):
    detail: list[FieldErrorItem]


class ErrorMessage(_Out):
    detail: str


# ----------------------------------------------------------------------------- tenant administration


class QuotaView(_Out):
    guaranteed: int | None = None
    borrow_limit: int | None = None


class TenantSettingsView(_Out):
    cohort: str = "default"
    weight: float = 1.0
    max_priority: int | None = None
    quotas: dict[str, QuotaView] = Field(default_factory=dict)


class TenantView(_Out):
    tenant: str
    created_at: datetime | None = Field(default=None, description="null for a tenant known only by its tokens")
    created_by: str | None = None
    settings: TenantSettingsView = Field(description="its queue settings as the scheduler applies them")
    settings_stored: bool = Field(description="false: no settings stored yet (the scheduler's defaults, or its "
                                              "queue-config file's seed, apply)")
    active_tokens: int = 0


class TenantList(_Out):
    tenants: list[TenantView]


class TokenView(_Out):
    token_id: str = Field(examples=["tok_3f2a9c1b7e4d"])
    tenant: str
    name: str
    role: Literal["viewer", "submitter", "tenant-admin", "platform-admin"]
    state: Literal["active", "revoked", "expired"]
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    created_by: str | None = None


class TokenList(_Out):
    tokens: list[TokenView]


class IssuedToken(TokenView):
    token: str = Field(description="the secret: shown once, only its sha256 is stored")


class WhoAmI(_Out):
    """The caller's token, as the API reads it (never the secret)."""

    tenant: str
    name: str
    token_id: str | None = Field(default=None, examples=["tok_3f2a9c1b7e4d"])
    role: Literal["viewer", "submitter", "tenant-admin", "platform-admin"]
    rights: list[str] = Field(description="what the role may do (docs/tenants.md)", examples=[["read", "submit"]])


class AuditEntry(_Out):
    id: str = Field(description="the stream id (`<ms>-<seq>`): pass it as `before` for the next page")
    at: str
    action: str = Field(examples=["job.cancel", "token.create", "tenant.update"])
    target: str = Field(examples=["job/job-3f2a9c1b7e4d", "tenant/research/token/tok_3f2a9c1b7e4d"])
    tenant: str | None = Field(default=None, description="the tenant the target belongs to")
    outcome: str = Field(description="ok, denied, not-found, conflict, invalid or failed")
    actor_token_id: str | None = None
    actor_name: str
    actor_tenant: str
    actor_role: str
    detail: str | None = None


class AuditPage(_Out):
    entries: list[AuditEntry]
    next_before: str | None = Field(default=None, description="the next (older) page's `before`; null at the end")


# ----------------------------------------------------------------------------- triggers

EXAMPLE_TEMPLATE: dict[str, Any] = {k: v for k, v in EXAMPLE_SPEC.items() if k != "dataset"}


class TriggerFailureView(_Out):
    at: datetime
    dataset: str = Field(description="the version it could not submit a job for")
    event_id: str = Field(description="the ArtifactRegistered event of that version")
    message: str
    problems: list[FieldErrorItem] = Field(default=[], description="the spec's problems, named by field")


class TriggerView(_Out):
    trigger_id: str = Field(examples=["trg-5c1d9e0a7b2f"])
    tenant: str
    name: str
    on: TriggerOn = Field(default="datasetVersion", description="datasetVersion: new dataset versions; "
                                                                 "checkpointReady: READY checkpoints")
    dataset: str = Field(description="the glob over dataset names it matches (empty: a checkpointReady trigger)",
                         examples=["wiki-*"])
    job: str | None = Field(default=None, description="checkpointReady: the job whose checkpoints it evaluates")
    experiment: str | None = Field(default=None, description="checkpointReady: the experiment whose jobs' "
                                                             "checkpoints it evaluates")
    every_steps: int | None = Field(default=None, description="checkpointReady: only steps that are multiples of "
                                                              "it (null: every READY checkpoint)")
    sources: list[TriggerSource] = Field(description="whose datasets it watches: own, platform, shared")
    template: dict[str, Any] = Field(description="the spec it submits, without dataset (defaults filled in)")
    enabled: bool
    created_by: str | None
    created_at: datetime
    jobs: list[TriggerJobView] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the jobs it started, one per dataset version (GET of one trigger only)")
    last_failure: TriggerFailureView | None = Field(
        default=None, description="the last version it could not submit a job for (e.g. the template no "
                                  "longer validates), with why")


class TriggerList(_Out):
    triggers: list[TriggerView]
