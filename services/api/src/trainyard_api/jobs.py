"""Job submission, control and read models: the thin I/O shell behind the routes.

Decisions (job ids, which control actions a state allows, reference checks) are pure
functions; :class:`JobService` loads, decides and writes. A job and its JobSubmitted are
written in one Redis MULTI (the outbox relay publishes the event afterwards), so a job is
never stored without its event nor announced without being stored. A control request and its
JobControlRequested likewise (:mod:`trainyard_runtime.controlrecords`): the scheduler treats both events as
wake-ups and acts only on what this module wrote.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
import builtins
from typing import NamedTuple

from opentelemetry import trace
from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import ConfigError, ConflictError, NotFoundError, StateStoreError
from trainyard_contract.events import TERMINAL_STATES, JobControlRequested, JobSubmitted, utcnow
from trainyard_contract.hfdir import HfDir, inspect_dir, resolve_start
from trainyard_contract.records import (
    ArtifactRecord,
    CheckpointRecord,
    EvaluationResult,
    ExperimentOrigin,
    HuggingFaceStart,
    JobRecord,
    Progress,
    TenantToken,
    TriggerOrigin,
)
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout, location_uri
from trainyard_contract.tracing import current_traceparent, job_context
from trainyard_runtime.controlrecords import (
    CONTROL_REQUEST_TTL_S,
    MAX_CONTROL_REQUESTS,
    expired_requests,
    room_for_request,
    stage_control_request,
)
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.replication import confirm_replicated
from trainyard_runtime.store import Keys, StateStore, stage_change
from trainyard_telemetry.accounting import GoodputAccountant
from trainyard_telemetry.steptiming import StepTimingStore

from trainyard_api.code import CodeService
from trainyard_api.planning import check_spec_memory
from trainyard_api.schemas import ControlResponse, JobPage, JobView
from trainyard_api.validation import (
    FieldProblem,
    InvalidSpecError,
    check_hugging_face_start,
    check_evaluation,
    check_init_from,
    check_references,
    resolve_model_config,
)
from trainyard_api.views import JobExtras, job_summary, job_view

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("trainyard.api")

JOBS_SUBMITTED = Counter("trainyard_api_jobs_submitted_total", "jobs accepted by POST /v1/training-jobs")
JOBS_REJECTED = Counter("trainyard_api_jobs_rejected_total", "submissions answered 422 after reference checks")
CONTROL_REQUESTS = Counter("trainyard_api_control_requests_total", "accepted control requests", ["action"])

CONTROL_ALLOWED: Mapping[str, frozenset[str]] = {
    "cancel": frozenset({"queued", "running", "paused"}),
    "pause": frozenset({"queued", "running"}),
    "resume": frozenset({"paused"}),
}


# ----------------------------------------------------------------------------- pure decisions


def new_job_id(tenant: str, idempotency_key: str | None = None) -> str:
    """``job-`` + 12 hex: random, or derived from (tenant, Idempotency-Key) so a retry finds its job."""
    if idempotency_key:
        digest = hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest()
        return f"job-{digest[:12]}"
    return f"job-{secrets.token_hex(6)}"


def control_refusal(state: str, action: str) -> str | None:
    """Why ``action`` is not allowed in ``state`` (None when it is)."""
    if state in CONTROL_ALLOWED[action]:
        return None
    if state in TERMINAL_STATES:
        return f"the job is already {state}; a finished job cannot be {_past(action)}"
    allowed = ", ".join(sorted(CONTROL_ALLOWED[action]))
    return f"cannot {action} a {state} job (allowed while {allowed})"


def _past(action: str) -> str:
    return {"cancel": "cancelled", "pause": "paused", "resume": "resumed"}[action]


def new_job_record(
    job_id: str, spec: TrainingSpec, token: TenantToken, *, traceparent: str | None,
    max_attempts: int, now: datetime, triggered_by: TriggerOrigin | None = None,
    hugging_face_start: HuggingFaceStart | None = None, experiment: ExperimentOrigin | None = None,
) -> JobRecord:
    return JobRecord(
        job_id=job_id, tenant=token.tenant, spec=spec, spec_hash=spec.spec_hash(), state="queued",
        priority=spec.priority, submitted_by=token.name, created_at=now, updated_at=now,
        max_attempts=max_attempts, traceparent=traceparent, triggered_by=triggered_by,
        hugging_face_start=hugging_face_start, experiment=experiment,
    )


def parent_job_id(job: JobRecord) -> str | None:
    """The job this one starts from (``initFrom.jobId``), if any."""
    init = job.spec.init_from
    return init.job_id if init is not None else None


def hugging_face_start(relative: str, found: HfDir) -> HuggingFaceStart:
    """What a job records of the directory it starts from."""
    return HuggingFaceStart(directory=relative, uri=location_uri(found.path), config_sha256=found.config_sha256,
                            weight_files=dict(found.weight_files), index_sha256=found.index_sha256,
                            export_sha256=found.export_sha256)


def find_start(layout: ArtifactLayout | None, tenant: str, relative: str) -> HfDir | ConfigError:
    """The tenant's directory ``relative`` inspected, or why it cannot start a job (file system I/O)."""
    if layout is None:
        return ConfigError("this API has no artifact store to find Hugging Face directories in; use initFrom.jobId")
    try:
        return inspect_dir(resolve_start(layout, tenant, relative))
    except ConfigError as exc:
        return exc


# ----------------------------------------------------------------------------- the shell


class Submission(NamedTuple):
    """What :meth:`JobService.submit` did: the job, whether this call created it, and the
    planner's warnings (a job that fits only inside the memory headroom)."""

    job: JobRecord
    created: bool
    warnings: list[str]


class JobService:
    """Everything the job routes do, scoped to the calling tenant."""

    def __init__(
        self,
        store: StateStore,
        outbox: Outbox,
        *,
        max_attempts: int = 3,
        catalog: Mapping[str, ModelConfig] = MODEL_CATALOG,
        clock: Callable[[], datetime] = utcnow,
        code: CodeService | None = None,
        layout: ArtifactLayout | None = None,
    ) -> None:
        self.store = store
        self.redis: Redis = store.redis
        self.outbox = outbox
        self.max_attempts = max_attempts
        self.catalog = catalog
        self.clock = clock
        self.code = code
        self.layout = layout  # the artifact store, where initFrom.huggingFace directories are
        self.timing = StepTimingStore(self.redis)
        self.accounting = GoodputAccountant(store, self.timing, clock=clock)

    # submit -------------------------------------------------------------------
    async def submit(
        self, spec: TrainingSpec, token: TenantToken, *, idempotency_key: str | None = None,
        traceparent: str | None = None, triggered_by: TriggerOrigin | None = None,
        experiment: ExperimentOrigin | None = None,
    ) -> Submission:
        """Validate references and memory, store the job and stage JobSubmitted.

        A spec whose model cannot fit its device type's memory is rejected; one that fits only
        inside the planner's headroom is accepted with a warning (see ``planning``). With an
        Idempotency-Key a retried submission returns the job it created the first time
        (created False); the same key with a different spec is a 409. With ``code.repo`` the
        revision is resolved and archived first, and the stored spec names that commit and archive.
        ``triggered_by``: the trigger that submits it (recorded on the job as its lineage).
        """
        spec, warnings, start = await self._check(spec, token)
        job = new_job_record(
            new_job_id(token.tenant, idempotency_key), spec, token,
            traceparent=traceparent, max_attempts=self.max_attempts, now=self.clock(), triggered_by=triggered_by,
            hugging_face_start=start, experiment=experiment,
        )
        existing = await self._create(job)
        if existing is None:
            JOBS_SUBMITTED.inc()
            return Submission(job, True, warnings)
        if idempotency_key and existing.spec_hash == job.spec_hash:
            return Submission(existing, False, warnings)
        if idempotency_key:
            raise ConflictError(
                f"Idempotency-Key {idempotency_key!r} was used before for job {existing.job_id} "
                "with a different spec; use a new key for a new job"
            )
        raise StateStoreError("job id collision; retry the submission")  # 48 random bits: never in practice

    async def check(
        self, spec: TrainingSpec, token: TenantToken, *, template: bool = False
    ) -> tuple[TrainingSpec, list[str]]:
        """What :meth:`submit` checks, storing nothing: the spec as it would be stored and the planner's
        warnings, or InvalidSpecError listing every problem. ``template``: a trigger's template, whose
        dataset is a placeholder that is not checked (each new version fills it in)."""
        spec, warnings, _ = await self._check(spec, token, template=template)
        return spec, warnings

    async def _check(
        self, spec: TrainingSpec, token: TenantToken, *, template: bool = False
    ) -> tuple[TrainingSpec, list[str], HuggingFaceStart | None]:
        """:meth:`check`, and what the job records of its ``initFrom.huggingFace`` directory."""
        problems: list[FieldProblem] = []
        start: HuggingFaceStart | None = None
        if spec.code is not None:
            if self.code is None:
                raise InvalidSpecError([FieldProblem("code", "this API takes no code: submit without code")])
            spec, problems = await self.code.pin(spec, token.tenant)
        # the dataset as this tenant may use it; the stored spec (and its hash) names it qualified
        dataset = await self.store.resolve_dataset(spec.dataset, token.tenant)
        problems.extend(check_references(spec, catalog=self.catalog, dataset_known=dataset is not None,
                                         dataset_vocab=dataset.vocab_size if dataset is not None else None))
        if dataset is not None and dataset.ref != spec.dataset:
            spec = spec.model_copy(update={"dataset": dataset.ref})
        init = spec.init_from
        if init is not None and init.hugging_face is not None:
            found = await asyncio.to_thread(find_start, self.layout, token.tenant, init.hugging_face)
            start_problems = check_hugging_face_start(spec, resolve_model_config(spec, self.catalog), found)
            problems.extend(start_problems)
            if isinstance(found, HfDir) and not start_problems:
                start = hugging_face_start(init.hugging_face, found)
        elif init is not None and init.job_id is not None:
            parent = await self.store.get_job(init.job_id)
            known = parent is not None and parent.tenant == token.tenant
            ready = [c.global_step for c in await self.store.list_checkpoints(init.job_id)
                     if c.state == "READY"] if known else []
            problems.extend(check_init_from(spec, parent_known=known, ready_steps=ready))
        problems.extend(check_evaluation(spec))
        config = resolve_model_config(spec, self.catalog)
        memory = check_spec_memory(spec, config) if config is not None else None
        if memory is not None:
            problems.extend(memory.problems)
        if template:
            problems = [p for p in problems if p.field != "dataset"]
        if problems:
            if not template:
                JOBS_REJECTED.inc()
            raise InvalidSpecError(problems)
        return spec, memory.warnings if memory is not None else [], start

    async def _create(self, job: JobRecord) -> JobRecord | None:
        """SET NX the record, index it (and under its ``initFrom`` parent) and stage JobSubmitted in one
        MULTI; the existing record if taken."""
        key = Keys.job(job.job_id)
        score = job.created_at.timestamp()
        event = JobSubmitted(
            job_id=job.job_id, tenant=job.tenant, spec=job.spec, spec_hash=job.spec_hash,
            submitted_by=job.submitted_by,
        )
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        raw = await pipe.get(key)
                        if raw:
                            await pipe.unwatch()
                            # a replay answers 202 too: only once a replica holds what the first request wrote
                            await confirm_replicated(self.redis, key)
                            return JobRecord.model_validate_json(raw)
                        pipe.multi()
                        pipe.set(key, job.dumps(), nx=True)
                        stage_change(pipe, "job", job.job_id)  # wakes the scheduler (no broker hop)
                        pipe.sadd(Keys.incoming_jobs, job.job_id)
                        pipe.zadd(Keys.jobs, {job.job_id: score})
                        pipe.zadd(Keys.tenant_jobs(job.tenant), {job.job_id: score})
                        if parent := parent_job_id(job):  # checked to be the same tenant's job
                            pipe.zadd(Keys.job_children(parent), {job.job_id: score})
                        self.outbox.stage(pipe, event, traceparent=job.traceparent)
                        await pipe.execute()
                        return None
                    except WatchError:
                        continue
        except RedisError as exc:
            raise StateStoreError(f"cannot store job {job.job_id}: {exc!r}") from exc

    # read ---------------------------------------------------------------------
    async def get(self, token: TenantToken, job_id: str) -> JobRecord:
        """The tenant's job; another tenant's job is as invisible as a missing one (404)."""
        job = await self.store.get_job(job_id)
        if job is None or job.tenant != token.tenant:
            raise NotFoundError(f"no job {job_id!r} for tenant {token.tenant!r}")
        return job

    async def view(self, token: TenantToken, job_id: str) -> JobView:
        job = await self.get(token, job_id)
        progress = await self.store.get_progress(job_id)
        checkpoints = await self.store.list_checkpoints(job_id)
        return job_view(job, progress, checkpoints, await self._extras(job))

    async def children(self, job_id: str) -> list[str]:
        """Ids of the jobs that start from ``job_id`` (initFrom.jobId), newest first."""
        try:
            return list(await self.redis.zrevrange(Keys.job_children(job_id), 0, -1))  # type: ignore[arg-type]  # decoded
        except RedisError as exc:
            raise StateStoreError(f"cannot read the children of job {job_id}: {exc!r}") from exc

    async def _extras(self, job: JobRecord) -> JobExtras:
        """Advice (coordinator), goodput, per-rank timing of the current attempt, stragglers."""
        raw_advice = await self.redis.get(Keys.checkpoint_advice(job.job_id))
        advice = None
        if raw_advice:
            try:
                advice = json.loads(raw_advice)
            except json.JSONDecodeError:
                log.warning("%s: unreadable checkpoint advice in Redis; not shown", job.job_id)
        current = job.current
        protection = None
        if raw := await self.redis.get(Keys.checkpoint_protection(job.job_id)):
            try:
                protection = json.loads(raw)
            except json.JSONDecodeError:
                log.warning("%s: unreadable checkpoint protection in Redis; not shown", job.job_id)
        return JobExtras(
            advice=advice if isinstance(advice, dict) else None,
            protection=protection if isinstance(protection, dict) else None,
            goodput=await self.accounting.job(job),
            ranks=await self.timing.ranks(job.job_id, current.attempt) if current else {},
            stragglers=await self.timing.stragglers(job.job_id),
            children=await self.children(job.job_id),
        )

    async def list(self, token: TenantToken, *, state: str | None, limit: int, offset: int) -> JobPage:
        """Newest first; with a state filter the index is scanned until the page is full."""
        items = []
        cursor = offset
        batch = limit if state is None else max(limit, 100)
        while True:
            ids = await self.store.list_job_ids(token.tenant, limit=batch, offset=cursor)
            jobs, progress = await self._load(ids)
            for i, job_id in enumerate(ids):
                job = jobs.get(job_id)
                if job is None or (state is not None and job.state != state):
                    continue
                items.append(job_summary(job, progress.get(job_id)))
                if len(items) == limit:
                    more = i + 1 < len(ids) or len(ids) == batch
                    return JobPage(jobs=items, next_offset=cursor + i + 1 if more else None)
            if len(ids) < batch:
                return JobPage(jobs=items, next_offset=None)
            cursor += len(ids)

    async def _load(self, ids: Sequence[str]) -> tuple[dict[str, JobRecord], dict[str, Progress]]:
        if not ids:
            return {}, {}
        raws = await self.redis.mget([Keys.job(j) for j in ids] + [Keys.progress(j) for j in ids])
        jobs = {j: JobRecord.model_validate_json(r) for j, r in zip(ids, raws[: len(ids)]) if r}
        progress = {j: Progress.model_validate_json(r) for j, r in zip(ids, raws[len(ids):]) if r}
        return jobs, progress

    # builtins.list: JobService.list is a method
    async def checkpoints(self, token: TenantToken, job_id: str) -> builtins.list[CheckpointRecord]:
        await self.get(token, job_id)
        return await self.store.list_checkpoints(job_id)

    async def artifacts(self, token: TenantToken, job_id: str) -> builtins.list[ArtifactRecord]:
        await self.get(token, job_id)
        return [a for a in await self.store.list_artifacts(job_id) if a.tenant == token.tenant]

    async def evaluations(self, token: TenantToken, job_id: str) -> builtins.list[EvaluationResult]:
        """The evaluations of the job's checkpoints (``ty:evals:<job>``, the registry's), by step."""
        await self.get(token, job_id)
        raw = await self.store.redis.hvals(Keys.evaluations(job_id))
        return sorted((EvaluationResult.model_validate_json(r) for r in raw),
                      key=lambda e: (e.global_step, e.finished_at, e.evaluation_job_id))

    # control ------------------------------------------------------------------
    async def control(
        self, token: TenantToken, job_id: str, action: str, reason: str | None = None
    ) -> ControlResponse:
        """Ask the scheduler to cancel, pause or resume: the request recorded (``Keys.control_requests``) and
        JobControlRequested staged in the outbox in one MULTI; the scheduler acts only on a recorded request.

        The request joins the job's trace (its span links to the HTTP request's span). 409 when the job's state
        does not allow it, or when the job has :data:`MAX_CONTROL_REQUESTS` recent requests already.
        """
        job = await self.get(token, job_id)
        if refusal := control_refusal(job.state, action):
            raise ConflictError(refusal)
        event = JobControlRequested(
            job_id=job.job_id, tenant=job.tenant, action=action,
            reason=reason or f"{action} requested by {token.name}",
        )
        request_span = trace.get_current_span().get_span_context()
        links = [trace.Link(request_span)] if request_span.is_valid else []
        with job_context(job.traceparent), _tracer.start_as_current_span(
            f"job {action} requested", links=links,
            attributes={"trainyard.job_id": job.job_id, "trainyard.action": action},
        ):
            await self._record_control(event, requested_by=token.name)
        CONTROL_REQUESTS.labels(action).inc()
        return ControlResponse(job_id=job.job_id, action=action, state=job.state)

    async def _record_control(self, event: JobControlRequested, *, requested_by: str) -> None:
        """The control record and its event in one MULTI (the outbox confirms replication, as for every write
        it stages; Redis errors reach the route's handlers as before); the job's expired records pruned."""
        now = self.clock()
        stored: dict[str, str] = await self.redis.hgetall(  # type: ignore[assignment]  # decoded: str
            Keys.control_requests(event.job_id))
        expired = expired_requests(stored, now=now)
        if not room_for_request(stored, expired):
            raise ConflictError(f"job {event.job_id} has {MAX_CONTROL_REQUESTS} control requests of the last "
                                f"{CONTROL_REQUEST_TTL_S // 3600} hours already; try again later")
        async with self.redis.pipeline(transaction=True) as pipe:
            stage_control_request(pipe, self.outbox, event, requested_by=requested_by, at=now, expired=expired,
                                  traceparent=current_traceparent())
            await pipe.execute()
