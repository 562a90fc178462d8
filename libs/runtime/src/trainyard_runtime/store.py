"""Redis keys and typed access to the durable records (see ``records.py``).

Every key starts with ``ty:`` and is built here, by :class:`Keys`; each belongs to a family that
:mod:`trainyard_runtime.keyspace` declares with its writers and readers (the ACLs are generated
from that declaration, and a unit test holds every key built here and every ``"ty:`` literal in the
code to it). Services share these readers so the API's read models and the writers agree on one layout.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError
from redis.exceptions import WatchError

from trainyard_runtime import replication
from trainyard_contract.errors import StateStoreError
from trainyard_contract.records import (
    ArtifactRecord,
    CheckpointRecord,
    DatasetRecord,
    DatasetRejection,
    ExportRecord,
    JobRecord,
    NodeRecord,
    Progress,
    Record,
    TenantToken,
    TokenRole,
    dataset_candidates,
    dataset_visible,
    resolve_dataset,
)

R = TypeVar("R", bound=Record)


class Keys:
    jobs = "ty:jobs"
    datasets = "ty:datasets"  # hash qualified ref (tenant/name@version, name@version) → JSON DatasetRecord
    dataset_rejections = "ty:dataset-rejections"  # hash qualified ref → JSON DatasetRejection (the latest refusal)
    nodes = "ty:nodes"
    tokens = "ty:tokens"  # hash sha256(token) → JSON TenantToken (revoked ones kept, with revokedAt)
    tenants = "ty:tenants"  # hash tenant → JSON TenantRecord (api)
    # hash tenant → JSON of the scheduler's TenantConfig (cohort, weight, maxPriority, quotas): set through the
    # API, seeded from the queue-config file for a tenant without one; wins over the queue config's tenants
    tenant_config = "ty:sched:tenant-config"
    audit = "ty:audit"  # stream: every administrative and job-control action (api), bounded
    lease_audit = "ty:lease-audit"
    pending_checkpoints = "ty:ckpt-pending"
    queue_config = "ty:sched:queue-config"  # JSON QueueConfig (tenants, quotas, priority classes); wins over the file
    calibration = "ty:calib:fit"  # JSON: the planner's fitted Calibration (to_dict) and when it was fitted (api)
    calibration_devices = "ty:calib:devices"  # set: device types with calibration samples (api)
    calibration_failures_seen = "ty:calib:failures-seen"  # zset job:attempt → ended at: failures sampled (api)
    # hash node id → JSON {"score", "at"}: the node's failure score, halving every half-life from "at" (scheduler)
    node_reputation = "ty:sched:node-reputation"
    # hash node id → JSON {"reason", "by", "score", "until", "at"}: nodes not placed on. The scheduler writes it
    # from NodeQuarantined (its own, by="reputation", or an admin's) and deletes it on NodeReinstated — the API
    # clears a node by publishing NodeReinstated(by=<admin>) on trainyard.nodes.
    node_quarantine = "ty:sched:node-quarantine"
    # hash node id → JSON {"reason", "by", "at", "bootId"}: drained nodes (no new work; their attempts checkpoint
    # and stop). The scheduler writes it from NodeDrained (an admin's, via the API) or a heartbeat with
    # draining=true (by="node-agent"), and deletes it on NodeUndrained or when the node's agent restarts.
    node_drain = "ty:sched:node-drain"
    checkpoint_jobs = "ty:ckpt:jobs"  # zset: jobs the coordinator's GC still looks at (its JOBS_INDEX)
    registry_live = "ty:registry:live"  # zset: jobs with artifacts not yet retired (registry's retire sweep)
    triggers = "ty:triggers"  # hash trigger id → JSON TriggerRecord, every tenant's (api)
    # stream of {"kind": "job"|"node", "id"}: a job record or a node's placement-relevant state (drain,
    # quarantine, reputation, devices) changed, appended in the MULTI that changed it; bounded. The scheduler's
    # leader reads it to keep its snapshot current and is woken by it (see :func:`stage_change`).
    changes = "ty:changes"
    # set: ids of jobs stored but not yet taken in by the scheduler (it checks them, then moves them to its active
    # set); written with the record, so a scheduler that reloads finds every job however far behind it is
    incoming_jobs = "ty:sched:incoming"
    sched_active = "ty:sched:active"  # set: jobs the scheduler has taken in that are not yet terminal
    sched_leader = "ty:sched:leader"  # "<epoch> <instance>" of the scheduler leader, with a TTL
    sched_leader_epoch = "ty:sched:leader-epoch"  # the scheduler's takeover counter, never decreasing
    tenants_bootstrap_lock = "ty:tenants:bootstrap-lock"  # the API worker that bootstraps the first tenant
    checkpoint_live_steps = "ty:ckpt:live-steps"  # hash job → rank 0's furthest (attempt, step) (coordinator)
    replication_barrier = replication.BARRIER_KEY  # INCRed before a WAIT (every service)

    @staticmethod
    def replication_ack(token: str) -> str:
        """A confirmed write's token (every service; see :func:`replication.execute_confirmed`)."""
        return replication.confirmation_key(token)

    @staticmethod
    def seen(service: str, group: str, event_id: str) -> str:
        """Set (with a TTL) once ``service``'s consumer ``group`` handled ``event_id`` (:class:`bus.Deduper`)."""
        return f"ty:seen:{service}:{group}:{event_id}"

    @staticmethod
    def agent(node_id: str) -> str:
        """The prefix of one node agent's own keys (``:epochs``, ``:launched``, ``:ranks``, ``:refused``,
        ``:unconfirmed``: see the node agent's ``AgentKeys``)."""
        return f"ty:agent:{node_id}"

    @staticmethod
    def metrics_history(job_id: str) -> str:
        """The prefix of a job's metrics-history keys (telemetry); the braces keep them in one cluster slot."""
        return f"ty:mh:{{{job_id}}}"

    @staticmethod
    def failures_seen(job_id: str, attempt: int) -> str:
        """Set once the coordinator counted the attempt's failure (it is counted once)."""
        return f"ty:failures:seen:{job_id}:{attempt}"

    @staticmethod
    def shard_timing(job_id: str, attempt: int, step: int) -> str:
        """Hash rank → the rank's save timing of one checkpoint (coordinator)."""
        return f"{Keys.shards(job_id, attempt, step)}:timing"

    @staticmethod
    def tenant_triggers(tenant: str) -> str:
        """Hash: trigger name → trigger id, one tenant's (names are unique per tenant) (api)."""
        return f"ty:tenant:{tenant}:triggers"

    @staticmethod
    def trigger_jobs(trigger_id: str) -> str:
        """Hash: dataset ref → id of the job the trigger submitted for that version (api)."""
        return f"ty:trigger:{trigger_id}:jobs"

    experiments = "ty:experiments"  # hash experiment id → JSON ExperimentRecord (api)
    experiments_active = "ty:experiments:active"  # set: experiments whose search is not over (api)

    @staticmethod
    def tenant_experiments(tenant: str) -> str:
        """Hash: experiment name → id, one tenant's (names are unique per tenant) (api)."""
        return f"ty:tenant:{tenant}:experiments"

    @staticmethod
    def experiment_driver(experiment_id: str) -> str:
        """The API process driving the experiment's search, with a TTL (api)."""
        return f"ty:experiment-driver:{experiment_id}"

    @staticmethod
    def trigger_failure(trigger_id: str) -> str:
        """JSON TriggerFailure: the last time the trigger could not submit (api)."""
        return f"ty:trigger:{trigger_id}:failure"

    @staticmethod
    def job(job_id: str) -> str:
        return f"ty:job:{job_id}"

    @staticmethod
    def tenant_jobs(tenant: str) -> str:
        return f"ty:tenant:{tenant}:jobs"

    @staticmethod
    def tenant_audit(tenant: str) -> str:
        """Stream: the audit entries whose target is in ``tenant`` (api), bounded."""
        return f"ty:audit:tenant:{tenant}"

    @staticmethod
    def job_children(job_id: str) -> str:
        """Sorted set: ids of the jobs whose ``initFrom.jobId`` is this job → their creation time (api)."""
        return f"ty:job:{job_id}:children"

    @staticmethod
    def control_requests(job_id: str) -> str:
        """Hash: eventId of a JobControlRequested → JSON ControlRequest ``{jobId, tenant, action, reason,
        requestedBy, at}``: the control requests the API accepted for the job. Written only by the API, in the
        MULTI that stages the event (:mod:`trainyard_runtime.controlrecords`); read by the scheduler, which acts on
        an event only when its record is there and matches. Bounded: records count for 3 days, at most 256 a job."""
        return f"ty:job:{job_id}:control"

    @staticmethod
    def progress(job_id: str) -> str:
        return f"ty:job:{job_id}:progress"

    @staticmethod
    def checkpoints(job_id: str) -> str:
        return f"ty:ckpt:{job_id}"

    @staticmethod
    def shards(job_id: str, attempt: int, step: int) -> str:
        return f"ty:ckpt:{job_id}:shards:{attempt}:{step}"

    @staticmethod
    def checkpoint_protection(job_id: str) -> str:
        """The coordinator's verdict on whether READY checkpoints still protect the job's live attempt (JSON)."""
        return f"ty:job:{job_id}:ckpt-protection"

    @staticmethod
    def checkpoint_advice(job_id: str) -> str:
        """JSON: the coordinator's Young/Daly checkpoint-interval advice for the job."""
        return f"ty:job:{job_id}:ckpt-advice"

    @staticmethod
    def checkpoint_timing(job_id: str) -> str:
        """Hash: the coordinator's measurements (step time, per-step checkpoint stall)."""
        return f"ty:ckpt:{job_id}:timing"

    @staticmethod
    def failure_stats(device_type: str) -> str:
        """Hash: observed attempt failures and exposure (device-seconds) of one device type."""
        return f"ty:failures:{device_type}"

    @staticmethod
    def calibration_samples(device_type: str, kind: str) -> str:
        """List: the newest measured-vs-predicted samples of one device type and kind, newest first (api)."""
        return f"ty:calib:samples:{device_type}:{kind}"

    @staticmethod
    def attempt_steps(job_id: str, attempt: int) -> str:
        """Hash: rank 0's step timing of one attempt (first/last step and when, work and stall sums) (api)."""
        return f"ty:job:{job_id}:steps:{attempt}"

    @staticmethod
    def attempt_step_points(job_id: str, attempt: int) -> str:
        """Sorted set: step → cumulative work seconds of the attempt, its newest steps only (api)."""
        return f"ty:job:{job_id}:steps:{attempt}:cum"

    @staticmethod
    def rank_timing(job_id: str, attempt: int) -> str:
        """Hash: rank → JSON of its latest StepMetrics timing breakdown (api)."""
        return f"ty:job:{job_id}:ranks:{attempt}"

    @staticmethod
    def stragglers(job_id: str) -> str:
        """List: the job's StragglerDetected events (JSON), newest first, capped (api)."""
        return f"ty:job:{job_id}:stragglers"

    goodput_final = "ty:goodput:final"  # hash job id → JSON {tenant, ledger}: ledgers of finished jobs (api)
    goodput_history_tenants = "ty:goodput:hist-tenants"  # set: tenants with a goodput history (api)

    @staticmethod
    def goodput_history(tenant: str) -> str:
        """Hash: bucket start (epoch seconds) → JSON of the tenant's cumulative ledger seconds by kind (api)."""
        return f"ty:goodput:hist:{tenant}"

    @staticmethod
    def artifacts(job_id: str) -> str:
        return f"ty:artifacts:{job_id}"

    # hash tenant → JSON TenantTracking: the MLflow server and TensorBoard switch a platform-admin set (api)
    tracking_tenants = "ty:tracking:tenants"
    # zset job → last rank-0 StepMetrics batch (ms): the jobs the tracking exporter looks at (telemetry)
    tracking_jobs = "ty:tracking:jobs"

    @staticmethod
    def tracking_cursor(job_id: str) -> str:
        """Hash: target (mlflow, tensorboard) → JSON cursor of the job's export (telemetry's tracking exporter)."""
        return f"ty:tracking:cursor:{job_id}"

    @staticmethod
    def evaluations(job_id: str) -> str:
        """Hash: evaluation job id → JSON EvaluationResult, the evaluations of ``job_id``'s checkpoints
        (registry; read by the api and telemetry)."""
        return f"ty:evals:{job_id}"

    @staticmethod
    def export(export_id: str) -> str:
        """JSON ExportRecord: an export's progress (the api or the registry writes it requested, with its
        ExportRequested; the registry ready or failed)."""
        return f"ty:export:{export_id}"

    @staticmethod
    def epoch(job_id: str) -> str:
        return f"ty:epoch:{job_id}"

    @staticmethod
    def allocation(allocation_id: str) -> str:
        return f"ty:alloc:{allocation_id}"

    @staticmethod
    def lease(node_id: str, device_index: int) -> str:
        return f"ty:lease:{node_id}:{device_index}"

    @staticmethod
    def replica(allocation_id: str, rank: int) -> str:
        """faultTolerance: the generation a replaced rank of the allocation may start as (the scheduler writes it
        with the job record; the node agent starts a newcomer only for the generation it names)."""
        return f"ty:replica:{allocation_id}:{rank}"

    @staticmethod
    def outbox(service: str) -> str:
        return f"ty:outbox:{service}"

    @staticmethod
    def health(service: str, instance: str) -> str:
        return f"ty:health:{service}:{instance}"

    @staticmethod
    def stuck(service: str, instance: str) -> str:
        """JSON list of the instance's consumed partitions held on one record (:class:`bus.StuckPartition`),
        refreshed with its health beacon; absent when none is."""
        return f"ty:stuck:{service}:{instance}"


CHANGES_MAXLEN = 100_000
"""About how many entries :data:`Keys.changes` keeps (a reader further behind reloads everything)."""


def stage_change(pipe: Pipeline, kind: str, ident: str) -> None:
    """Append ``{kind, id}`` to :data:`Keys.changes` inside the caller's MULTI (kind: ``job`` or ``node``)."""
    pipe.xadd(Keys.changes, {"kind": kind, "id": ident}, maxlen=CHANGES_MAXLEN, approximate=True)


async def note_change(redis: Redis, kind: str, ident: str) -> None:
    """:func:`stage_change` on its own, after a change made without a MULTI."""
    await redis.xadd(Keys.changes, {"kind": kind, "id": ident}, maxlen=CHANGES_MAXLEN, approximate=True)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token_id() -> str:
    """A token's public id: ``tok_`` + 12 random hex (not derived from the secret)."""
    return "tok_" + secrets.token_hex(6)


def token_id_of(digest: str, record: TenantToken) -> str:
    """The record's id; a record written before ids has ``tok_`` + the first 12 hex of its sha256."""
    return record.token_id or f"tok_{digest[:12]}"


def connect_redis(url: str) -> Redis:
    """A client for ``TRAINYARD_REDIS_URL``: ``redis://…`` (one server) or ``redis+sentinel://…`` (a primary
    that Sentinel fails over; the client follows it and epoch increments wait for a replica): see
    :mod:`trainyard_runtime.replication`."""
    return replication.connect(url)


class StateStore:
    """Typed reads and simple writes of the shared records."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def _get(self, key: str, cls: type[R]) -> R | None:
        try:
            raw = await self.redis.get(key)
        except RedisError as exc:
            raise StateStoreError(f"redis GET {key} failed: {exc!r}") from exc
        return cls.model_validate_json(raw) if raw else None

    async def _hvals(self, key: str, cls: type[R]) -> list[R]:
        try:
            raw = await self.redis.hvals(key)
        except RedisError as exc:
            raise StateStoreError(f"redis HVALS {key} failed: {exc!r}") from exc
        return [cls.model_validate_json(r) for r in raw]

    # jobs -------------------------------------------------------------------
    async def get_job(self, job_id: str) -> JobRecord | None:
        return await self._get(Keys.job(job_id), JobRecord)

    async def create_job(self, job: JobRecord) -> bool:
        """Store a new job; False if the id exists already (idempotent re-submission)."""
        created = await self.redis.set(Keys.job(job.job_id), job.dumps(), nx=True)
        if created:
            score = job.created_at.timestamp()
            async with self.redis.pipeline(transaction=True) as pipe:
                stage_change(pipe, "job", job.job_id)
                pipe.sadd(Keys.incoming_jobs, job.job_id)
                pipe.zadd(Keys.jobs, {job.job_id: score})
                pipe.zadd(Keys.tenant_jobs(job.tenant), {job.job_id: score})
                if job.spec.init_from is not None and job.spec.init_from.job_id:
                    pipe.zadd(Keys.job_children(job.spec.init_from.job_id), {job.job_id: score})
                await pipe.execute()
        return bool(created)

    async def put_job(self, job: JobRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(Keys.job(job.job_id), job.dumps())
            stage_change(pipe, "job", job.job_id)
            await pipe.execute()

    async def list_job_ids(self, tenant: str | None = None, *, limit: int = 100, offset: int = 0) -> list[str]:
        key = Keys.tenant_jobs(tenant) if tenant else Keys.jobs
        return list(await self.redis.zrevrange(key, offset, offset + limit - 1))  # type: ignore[arg-type]  # decoded: str

    async def get_jobs(self, job_ids: Sequence[str]) -> list[JobRecord]:
        if not job_ids:
            return []
        raws = await self.redis.mget([Keys.job(j) for j in job_ids])
        return [JobRecord.model_validate_json(r) for r in raws if r]

    async def get_progress(self, job_id: str) -> Progress | None:
        return await self._get(Keys.progress(job_id), Progress)

    # checkpoints ------------------------------------------------------------
    async def list_checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        records = await self._hvals(Keys.checkpoints(job_id), CheckpointRecord)
        return sorted(records, key=lambda c: (c.global_step, c.attempt))

    async def latest_ready_checkpoint(self, job_id: str) -> CheckpointRecord | None:
        ready = [c for c in await self.list_checkpoints(job_id) if c.state == "READY"]
        return ready[-1] if ready else None

    async def get_checkpoint(self, job_id: str, checkpoint_id: str) -> CheckpointRecord | None:
        raw = await self.redis.hget(Keys.checkpoints(job_id), checkpoint_id)
        return CheckpointRecord.model_validate_json(raw) if raw else None

    async def put_checkpoint(self, record: CheckpointRecord) -> None:
        await self.redis.hset(Keys.checkpoints(record.job_id), record.checkpoint_id, record.dumps())

    # registry ---------------------------------------------------------------
    async def list_artifacts(self, job_id: str) -> list[ArtifactRecord]:
        records = await self._hvals(Keys.artifacts(job_id), ArtifactRecord)
        return sorted(records, key=lambda a: (a.global_step, a.created_at))

    async def put_artifact(self, record: ArtifactRecord) -> bool:
        """Idempotent by artifact id; False when it was recorded before."""
        return bool(await self.redis.hsetnx(Keys.artifacts(record.job_id), record.artifact_id, record.dumps()))

    async def create_artifact(self, record: ArtifactRecord, stage: Callable[[Pipeline], None]) -> bool:
        """Record an artifact unless its id is recorded already, with what ``stage`` queues (the outbox's
        events) in the same MULTI; False, and nothing staged, when it was recorded before."""
        key = Keys.artifacts(record.job_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    if await pipe.hexists(key, record.artifact_id):
                        await pipe.reset()
                        return False
                    pipe.multi()
                    pipe.hset(key, record.artifact_id, record.dumps())
                    stage(pipe)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue

    async def get_artifact(self, job_id: str, artifact_id: str) -> ArtifactRecord | None:
        raw = await self.redis.hget(Keys.artifacts(job_id), artifact_id)
        return ArtifactRecord.model_validate_json(raw) if raw else None

    async def get_export(self, export_id: str) -> ExportRecord | None:
        return await self._get(Keys.export(export_id), ExportRecord)

    async def get_dataset(self, ref: str) -> DatasetRecord | None:
        """The verified version under its qualified ref (no visibility check: see resolve_dataset)."""
        raw = await self.redis.hget(Keys.datasets, ref)
        return DatasetRecord.model_validate_json(raw) if raw else None

    async def resolve_dataset(self, ref: str, tenant: str | None) -> DatasetRecord | None:
        """What ``ref`` (qualified or not) names for ``tenant``; None when unknown or not visible to it."""
        candidates = dataset_candidates(ref, tenant)
        raws = await self.redis.hmget(Keys.datasets, candidates)
        records = {c: DatasetRecord.model_validate_json(raw) for c, raw in zip(candidates, raws) if raw}
        return resolve_dataset(ref, tenant, records)

    async def get_dataset_rejection(self, ref: str) -> DatasetRejection | None:
        raw = await self.redis.hget(Keys.dataset_rejections, ref)
        return DatasetRejection.model_validate_json(raw) if raw else None

    async def put_dataset(self, record: DatasetRecord) -> None:
        await self.redis.hset(Keys.datasets, record.ref, record.dumps())

    async def list_datasets(self, tenant: str | None = None, *, every: bool = False) -> list[DatasetRecord]:
        """The verified versions ``tenant`` may see (``every``: all of them, for operators and tests)."""
        records = await self._hvals(Keys.datasets, DatasetRecord)
        return records if every else [r for r in records if dataset_visible(r, tenant)]

    # nodes ------------------------------------------------------------------
    async def list_nodes(self) -> list[NodeRecord]:
        return await self._hvals(Keys.nodes, NodeRecord)

    async def put_node(self, record: NodeRecord) -> None:
        await self.redis.hset(Keys.nodes, record.node_id, record.dumps())

    # tenants ----------------------------------------------------------------
    async def add_token(self, token: str, tenant: str, name: str = "default", *, admin: bool = False,
                        role: TokenRole | None = None, expires_at: datetime | None = None,
                        created_by: str | None = None) -> TenantToken:
        """Register ``token``; ``role`` None keeps the pre-role meaning of ``admin``. Returns the record."""
        if role is not None:
            admin = role == "platform-admin"
        record = TenantToken(tenant=tenant, name=name, admin=admin, role=role, expires_at=expires_at,
                             token_id=new_token_id(), created_by=created_by)
        await replication.write_confirmed(self.redis, lambda p: p.hset(Keys.tokens, hash_token(token), record.dumps()))
        return record

    async def token_records(self) -> dict[str, TenantToken]:
        """Every token record (revoked and expired ones too) by the sha256 it is stored under."""
        raw: dict[str, str] = await self.redis.hgetall(Keys.tokens)  # type: ignore[assignment]  # decoded: str
        return {digest: TenantToken.model_validate_json(value) for digest, value in raw.items()}

    async def tenant_for_token(self, token: str) -> TenantToken | None:
        raw = await self.redis.hget(Keys.tokens, hash_token(token))
        return TenantToken.model_validate_json(raw) if raw else None
