"""Triggers: each new verified version of a matching dataset submits a job from a template.

A trigger (``POST /v1/triggers``) is a tenant's glob over dataset names, whose datasets it watches
(``sources``: its own, the platform's, other tenants' shared with it) and a training spec without
``dataset``. The API consumes ``ArtifactRegistered(kind="dataset")`` on ``trainyard.registry`` (group
``api-triggers``): :func:`matching_triggers` (pure) picks the triggers a version sets off and
:class:`TriggerFiring` submits each one's job through :meth:`JobService.submit` — the same checks and
dataset resolution as ``POST /v1/training-jobs`` — with an Idempotency-Key of (trigger, version), so an
event delivered or published again starts nothing twice. A version a trigger cannot submit for (its
template no longer validates) is recorded on the trigger as its last failure; the consumer goes on.

A ``checkpointReady`` trigger (``on``) watches a job (``job``) or an experiment's jobs (``experiment``) instead:
each ``ArtifactRegistered(kind="checkpoint")`` of its tenant that :func:`checkpoint_matches` (pure; ``everySteps``)
submits its template — an evaluation (``spec.evaluation``) without ``initFrom`` — with ``initFrom`` set to that
checkpoint and ``dataset`` to the trained job's, once per (trigger, checkpoint artifact), the same way.
"""

from __future__ import annotations

import fnmatch
import logging
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from prometheus_client import Counter
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

from trainyard_runtime.bus import is_retryable
from trainyard_contract.errors import ConflictError, NotFoundError, StateStoreError
from trainyard_contract.events import REGISTRY, ArtifactRegistered, dataset_key, utcnow
from trainyard_runtime.replication import execute_confirmed, write_confirmed
from trainyard_contract.records import (
    JobRecord,
    TenantToken,
    TriggerFailure,
    TriggerOrigin,
    TriggerRecord,
    is_deleted_tenant,
)
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.spec import DatasetRef
from trainyard_runtime.store import Keys

from trainyard_api.bodies import SubmittedSpec, TriggerCreateBody
from trainyard_api.jobs import JobService, new_job_id
from trainyard_api.schemas import TriggerFailureView, TriggerJobView, TriggerList, TriggerView
from trainyard_api.validation import TEMPLATE_ROOT, FieldProblem, InvalidSpecError, field_errors, under

log = logging.getLogger(__name__)

TRIGGER_GROUP = "api-triggers"
"""The consumer group (after the prefix) that reads ArtifactRegistered for triggers (contract.py)."""
TRIGGER_JOBS = Counter("trainyard_api_trigger_jobs_total", "jobs submitted by triggers")
TRIGGER_FAILURES = Counter("trainyard_api_trigger_failures_total", "dataset versions a trigger could not submit for")


# ----------------------------------------------------------------------------- pure decisions


def new_trigger_id() -> str:
    return f"trg-{secrets.token_hex(6)}"


def visible_as(trigger: TriggerRecord, owner: str | None, shared_with: Iterable[str]) -> str | None:
    """Which of the trigger's sources a dataset of ``owner`` shared with ``shared_with`` is, for the
    trigger's tenant (None: it is not one of them, or the tenant may not use it)."""
    if owner == trigger.tenant:
        source = "own"
    elif owner is None:
        source = "platform"
    elif trigger.tenant in shared_with or "*" in shared_with:
        source = "shared"
    else:
        return None
    return source if source in trigger.sources else None


def matching_triggers(triggers: Iterable[TriggerRecord], event: ArtifactRegistered) -> list[TriggerRecord]:
    """The enabled triggers a newly registered dataset version sets off: its name matches the trigger's
    glob, and its owner is one of the trigger's sources and lets the trigger's tenant use it (the owner
    itself, the platform, or a tenant that shares it with this one or with every tenant)."""
    if event.kind != "dataset" or event.dataset is None:
        return []
    try:
        ref = DatasetRef.parse(event.dataset)
    except ValueError:
        return []
    if ref.tenant != event.tenant:  # a qualified ref names its owner; one that disagrees is no dataset of ours
        return []
    return [t for t in triggers
            if t.enabled and t.on == "datasetVersion" and fnmatch.fnmatchcase(ref.name, t.dataset)
            and visible_as(t, event.tenant, event.shared_with) is not None]


def experiment_of(job: JobRecord | None) -> str | None:
    """The experiment a job is a trial of (``JobRecord.experiment``), if any."""
    return getattr(getattr(job, "experiment", None), "experiment_id", None)


def checkpoint_matches(trigger: TriggerRecord, event: ArtifactRegistered, *, experiment: str | None) -> bool:
    """Whether a registered checkpoint sets off a ``checkpointReady`` trigger: the trigger is enabled, the
    checkpoint is its tenant's (another tenant's never is), of the job it watches or of a job of the experiment
    it watches (``experiment``: the checkpoint's job's), at a step that is a multiple of ``everySteps``."""
    if (trigger.on != "checkpointReady" or not trigger.enabled or event.kind != "checkpoint"
            or event.tenant is None or event.tenant != trigger.tenant or event.job_id is None
            or event.global_step is None):
        return False
    if trigger.every_steps is not None and event.global_step % trigger.every_steps:
        return False
    return (trigger.job is not None and trigger.job == event.job_id) or (
        trigger.experiment is not None and trigger.experiment == experiment)


def matching_checkpoint_triggers(triggers: Iterable[TriggerRecord], event: ArtifactRegistered, *,
                                 experiment: str | None) -> list[TriggerRecord]:
    """The ``checkpointReady`` triggers a registered checkpoint sets off (:func:`checkpoint_matches`)."""
    return [t for t in triggers if checkpoint_matches(t, event, experiment=experiment)]


def creation_problems(body: TriggerCreateBody) -> list[FieldProblem]:
    """What ``on`` asks of the other fields: a dataset glob for ``datasetVersion``; one of ``job`` or
    ``experiment`` and an evaluation template without ``initFrom`` for ``checkpointReady``."""
    if body.on == "datasetVersion":
        problems = [FieldProblem(f, f"{f} goes with on: checkpointReady") for f, v in
                    (("job", body.job), ("experiment", body.experiment), ("everySteps", body.every_steps))
                    if v is not None]
        if body.dataset is None:
            problems.append(FieldProblem("dataset", "a datasetVersion trigger names the datasets it watches: a "
                                                    "glob over dataset names (wiki-*)"))
        return problems
    problems = []
    if body.dataset is not None:
        problems.append(FieldProblem("dataset", "a checkpointReady trigger watches a job or an experiment, not "
                                                "datasets: the evaluation runs on the trained job's dataset"))
    if (body.job is None) == (body.experiment is None):
        problems.append(FieldProblem("job", "a checkpointReady trigger watches exactly one of job or experiment"))
    if body.template.evaluation is None:
        problems.append(FieldProblem(f"{TEMPLATE_ROOT}.evaluation", "a checkpointReady trigger's template is an "
                                                                    "evaluation: give evaluation (e.g. {})"))
    if body.template.init_from is not None:
        problems.append(FieldProblem(f"{TEMPLATE_ROOT}.initFrom", "a checkpointReady trigger's template names no "
                                                                  "initFrom: each READY checkpoint fills it in"))
    return problems


def shadowing_ref(trigger: TriggerRecord, event: ArtifactRegistered) -> str | None:
    """For a platform version, the tenant's own dataset of the same name@version, which a submission of the
    unqualified ref would pick instead (the platform's cannot be named qualified); None otherwise."""
    if event.tenant is not None or event.dataset is None:
        return None
    ref = DatasetRef.parse(event.dataset)
    return dataset_key(trigger.tenant, ref.name, ref.version)


def idempotency_key(trigger_id: str, dataset: str) -> str:
    """The Idempotency-Key of the job a trigger submits for one dataset version."""
    return f"trigger:{trigger_id}:{dataset}"


def trigger_spec(template: dict[str, Any], dataset: str) -> SubmittedSpec:
    """The spec a trigger submits for ``dataset``: its template with that dataset (ValidationError when the
    stored template no longer parses)."""
    return SubmittedSpec.model_validate({**template, "dataset": dataset})


def checkpoint_spec(template: dict[str, Any], *, dataset: str, job_id: str, global_step: int) -> SubmittedSpec:
    """The evaluation a ``checkpointReady`` trigger submits for one checkpoint: its template with ``initFrom``
    that checkpoint and ``dataset`` the trained job's (ValidationError when the template no longer parses)."""
    return SubmittedSpec.model_validate({**template, "dataset": dataset,
                                         "initFrom": {"jobId": job_id, "globalStep": global_step}})


def trigger_token(trigger: TriggerRecord) -> TenantToken:
    """Whom a trigger's jobs are submitted as: its tenant, named after the trigger (``submittedBy``)."""
    return TenantToken(tenant=trigger.tenant, name=f"trigger:{trigger.name}", role="submitter",
                       token_id=trigger.trigger_id)


def trigger_view(record: TriggerRecord, *, jobs: dict[str, str] | None = None,
                 failure: TriggerFailure | None = None) -> TriggerView:
    on_checkpoint = record.on == "checkpointReady"
    return TriggerView(
        trigger_id=record.trigger_id, tenant=record.tenant, name=record.name, on=record.on, dataset=record.dataset,
        job=record.job, experiment=record.experiment, every_steps=record.every_steps,
        sources=record.sources, template=record.template, enabled=record.enabled, created_by=record.created_by,
        created_at=record.created_at,
        jobs=None if jobs is None else [TriggerJobView(dataset=d, job_id=j, checkpoint=d if on_checkpoint else None)
                                        for d, j in sorted(jobs.items())],
        last_failure=None if failure is None else TriggerFailureView(
            at=failure.at, dataset=failure.dataset, event_id=failure.event_id, message=failure.message,
            problems=failure.problems),
    )


# ----------------------------------------------------------------------------- the store


class TriggerStore:
    """Triggers in Redis: the records (``ty:triggers``), each tenant's names, each trigger's jobs and
    last failure."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def create(self, record: TriggerRecord) -> str | None:
        """Store a new trigger; the id of the tenant's trigger of that name when there is one already."""
        names = Keys.tenant_triggers(record.tenant)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(names)
                        if taken := await pipe.hget(names, record.name):
                            await pipe.unwatch()
                            return str(taken)
                        pipe.multi()
                        pipe.hset(names, record.name, record.trigger_id)
                        pipe.hset(Keys.triggers, record.trigger_id, record.dumps())
                        await execute_confirmed(self.redis, pipe)  # answered 201 only once a replica has it
                        return None
                    except WatchError:
                        continue
        except RedisError as exc:
            raise StateStoreError(f"cannot store trigger {record.trigger_id}: {exc!r}") from exc

    async def all(self) -> list[TriggerRecord]:
        return [TriggerRecord.model_validate_json(raw) for raw in await self.redis.hvals(Keys.triggers)]

    async def get(self, trigger_id: str) -> TriggerRecord | None:
        raw = await self.redis.hget(Keys.triggers, trigger_id)
        return TriggerRecord.model_validate_json(raw) if raw else None

    async def delete(self, record: TriggerRecord) -> None:
        """Forget the trigger (the jobs it started stay)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(Keys.triggers, record.trigger_id)
            pipe.hdel(Keys.tenant_triggers(record.tenant), record.name)
            pipe.delete(Keys.trigger_jobs(record.trigger_id), Keys.trigger_failure(record.trigger_id))
            await execute_confirmed(self.redis, pipe)

    async def jobs(self, trigger_id: str) -> dict[str, str]:
        """Dataset ref → the job the trigger submitted for it."""
        return dict(await self.redis.hgetall(Keys.trigger_jobs(trigger_id)))  # type: ignore[arg-type]  # decoded: str

    async def job_for(self, trigger_id: str, dataset: str) -> str | None:
        job_id = await self.redis.hget(Keys.trigger_jobs(trigger_id), dataset)
        return str(job_id) if job_id else None

    async def record_job(self, trigger_id: str, dataset: str, job_id: str) -> None:
        # confirmed: lost in a failover, the version would start a second job
        await write_confirmed(self.redis, lambda p: p.hsetnx(Keys.trigger_jobs(trigger_id), dataset, job_id))

    async def tenant_deleted(self, tenant: str) -> bool:
        """Whether ``tenant`` was deleted through the API (its triggers start nothing then)."""
        return is_deleted_tenant(await self.redis.hget(Keys.tenant_config, tenant))

    async def failure(self, trigger_id: str) -> TriggerFailure | None:
        raw = await self.redis.get(Keys.trigger_failure(trigger_id))
        return TriggerFailure.model_validate_json(raw) if raw else None

    async def record_failure(self, trigger_id: str, failure: TriggerFailure) -> None:
        await self.redis.set(Keys.trigger_failure(trigger_id), failure.dumps())


# ----------------------------------------------------------------------------- the routes' service


class TriggerService:
    """What the trigger routes do, scoped to the calling tenant (another tenant's trigger is a 404)."""

    def __init__(self, store: TriggerStore, jobs: JobService, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.jobs = jobs
        self.clock = clock

    async def create(self, token: TenantToken, body: TriggerCreateBody) -> TriggerView:
        """Check the template as POST /v1/training-jobs checks a spec (its dataset aside, and for a checkpointReady
        trigger its initFrom), then store it."""
        problems = creation_problems(body)
        try:
            await self.jobs.check(body.template, token, template=True)
        except InvalidSpecError as exc:
            filled = ("initFrom",) if body.on == "checkpointReady" else ()
            problems += under(TEMPLATE_ROOT, [p for p in exc.problems if p.field.split(".")[0] not in filled])
        if problems:
            raise InvalidSpecError(problems)
        # stored as given: a code.repo revision is resolved again for each job, as a submission would
        record = TriggerRecord(
            trigger_id=new_trigger_id(), tenant=token.tenant, name=body.name, on=body.on, dataset=body.dataset or "",
            job=body.job, experiment=body.experiment, every_steps=body.every_steps,
            sources=list(dict.fromkeys(body.sources)), template=body.template.wire_template(), enabled=body.enabled,
            created_by=token.token_id or token.name, created_at=self.clock(),
        )
        if (taken := await self.store.create(record)) is not None:
            raise ConflictError(f"tenant {token.tenant!r} has a trigger named {body.name!r} already ({taken}); "
                                "delete it first or choose another name")
        return trigger_view(record, jobs={})

    async def _own(self, token: TenantToken, trigger_id: str) -> TriggerRecord:
        record = await self.store.get(trigger_id)
        if record is None or record.tenant != token.tenant:
            raise NotFoundError(f"no trigger {trigger_id!r} for tenant {token.tenant!r} (GET /v1/triggers lists them)")
        return record

    async def list(self, token: TenantToken) -> TriggerList:
        records = sorted((t for t in await self.store.all() if t.tenant == token.tenant),
                         key=lambda t: (t.created_at, t.trigger_id))
        return TriggerList(triggers=[trigger_view(t, failure=await self.store.failure(t.trigger_id))
                                     for t in records])

    async def get(self, token: TenantToken, trigger_id: str) -> TriggerView:
        record = await self._own(token, trigger_id)
        return trigger_view(record, jobs=await self.store.jobs(trigger_id),
                            failure=await self.store.failure(trigger_id))

    async def delete(self, token: TenantToken, trigger_id: str) -> TriggerView:
        record = await self._own(token, trigger_id)
        view = trigger_view(record, jobs=await self.store.jobs(trigger_id),
                            failure=await self.store.failure(trigger_id))
        await self.store.delete(record)
        return view


# ----------------------------------------------------------------------------- the consumer


class TriggerFiring:
    """The consumer of ArtifactRegistered: a new dataset version submits the jobs of the triggers it matches.

    ``jobs`` gives the JobService to submit through (the API's, with its code service and settings).
    A version a trigger cannot submit for is recorded as the trigger's last failure — whatever the reason,
    so one trigger's failure never keeps the others from their jobs nor holds up the partition; an outage
    (Redis) is raised, and the bus retries the event with back-off (what was submitted is not doubled)."""

    def __init__(self, store: TriggerStore, jobs: Callable[[], JobService], *,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.jobs = jobs
        self.clock = clock

    def install(self, runtime: ServiceRuntime) -> str:
        """Subscribe to REGISTRY in group ``<prefix>.api-triggers``, de-duplicated by event id."""
        return runtime.bus.subscribe(
            REGISTRY, {ArtifactRegistered: self.on_artifact_registered},
            group=f"{runtime.settings.group_prefix}.{TRIGGER_GROUP}", deduper_factory=runtime.deduper,
            background=True)

    async def on_artifact_registered(self, event: ArtifactRegistered) -> None:
        if event.kind == "checkpoint":
            await self.on_checkpoint_registered(event)
            return
        for trigger in matching_triggers(await self.store.all(), event):
            await self.fire(trigger, event)

    async def on_checkpoint_registered(self, event: ArtifactRegistered) -> None:
        """A READY checkpoint: the evaluations of the checkpointReady triggers it sets off."""
        triggers = [t for t in await self.store.all() if t.on == "checkpointReady"]
        if not triggers or event.job_id is None:
            return
        trained = await self.jobs().store.get_job(event.job_id)
        if trained is None or trained.tenant != event.tenant or trained.spec.evaluation is not None:
            return  # no job of the checkpoint's tenant (never fires another tenant's trigger), or an evaluation
        for trigger in matching_checkpoint_triggers(triggers, event, experiment=experiment_of(trained)):
            await self.fire_checkpoint(trigger, event, trained)

    async def fire_checkpoint(self, trigger: TriggerRecord, event: ArtifactRegistered,
                              trained: JobRecord) -> str | None:
        """Submit the trigger's evaluation of the event's checkpoint, once; the job id (None: it failed)."""
        assert event.global_step is not None
        ref = event.artifact_id
        if (done := await self.store.job_for(trigger.trigger_id, ref)) is not None:
            return done
        if await self.store.tenant_deleted(trigger.tenant):
            await self._failed(trigger, event, f"tenant {trigger.tenant!r} was deleted: its triggers start nothing", [],
                               ref=ref)
            return None
        origin = TriggerOrigin(trigger_id=trigger.trigger_id, trigger_name=trigger.name, checkpoint=ref,
                               event_id=str(event.event_id))
        step = event.global_step
        return await self._submit(trigger, event, ref, origin, lambda: checkpoint_spec(
            trigger.template, dataset=trained.spec.dataset, job_id=trained.job_id, global_step=step))

    async def fire(self, trigger: TriggerRecord, event: ArtifactRegistered) -> str | None:
        """Submit the trigger's job for the event's dataset version, once; the job id (None: it failed)."""
        assert event.dataset is not None
        dataset = event.dataset
        if (done := await self.store.job_for(trigger.trigger_id, dataset)) is not None:
            return done
        if await self.store.tenant_deleted(trigger.tenant):
            await self._failed(trigger, event, f"tenant {trigger.tenant!r} was deleted: its triggers start nothing", [])
            return None
        jobs = self.jobs()
        if (own := shadowing_ref(trigger, event)) and await jobs.store.get_dataset(own) is not None:
            await self._failed(trigger, event, f"the platform's {dataset} cannot be submitted for tenant "
                                               f"{trigger.tenant!r}: its own {own} has the same name and version, "
                                               "and a submission of the unqualified ref trains on that one", [])
            return None
        origin = TriggerOrigin(trigger_id=trigger.trigger_id, trigger_name=trigger.name, dataset=dataset,
                               event_id=str(event.event_id))
        return await self._submit(trigger, event, dataset, origin, lambda: trigger_spec(trigger.template, dataset))

    async def _submit(self, trigger: TriggerRecord, event: ArtifactRegistered, ref: str, origin: TriggerOrigin,
                      build: Callable[[], SubmittedSpec]) -> str | None:
        """Submit ``build()`` for ``ref`` (a dataset version or a checkpoint) with the (trigger, ref) Idempotency-Key
        and record the job on the trigger; a failure is recorded as the trigger's last (an outage is raised)."""
        jobs = self.jobs()
        token = trigger_token(trigger)
        key = idempotency_key(trigger.trigger_id, ref)
        try:
            spec = build()
            submitted = await jobs.submit(spec, token, idempotency_key=key, triggered_by=origin)
            job_id = submitted.job.job_id
            if submitted.created:
                TRIGGER_JOBS.inc()
                log.info("trigger %s (%s) submitted %s for %s", trigger.trigger_id, trigger.name, job_id, ref)
        except ConflictError:
            # the key's job exists with another spec (code.revision moved since): it is this version's job
            job_id = new_job_id(trigger.tenant, key)
        except ValidationError as exc:
            await self._failed(trigger, event, "the stored template no longer parses as a spec",
                               field_errors(exc.errors()), ref=ref)
            return None
        except InvalidSpecError as exc:
            what = "checkpoint" if trigger.on == "checkpointReady" else "dataset"
            await self._failed(trigger, event, f"the template does not validate with this {what}", exc.problems,
                               ref=ref)
            return None
        except Exception as exc:  # noqa: BLE001 - recorded on the trigger; the other triggers still fire
            if is_retryable(exc):
                raise
            log.exception("trigger %s: submitting for %s failed", trigger.trigger_id, ref)
            await self._failed(trigger, event, getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}", [],
                               ref=ref)
            return None
        await self.store.record_job(trigger.trigger_id, ref, job_id)
        return job_id

    async def _failed(self, trigger: TriggerRecord, event: ArtifactRegistered, message: str,
                      problems: list[FieldProblem], *, ref: str | None = None) -> None:
        ref = ref or event.dataset
        assert ref is not None
        TRIGGER_FAILURES.inc()
        log.warning("trigger %s (%s) cannot submit for %s: %s %s", trigger.trigger_id, trigger.name,
                    ref, message, [p.as_dict() for p in problems])
        await self.store.record_failure(trigger.trigger_id, TriggerFailure(
            at=self.clock(), dataset=ref, event_id=str(event.event_id), message=message,
            problems=[p.as_dict() for p in problems]))
