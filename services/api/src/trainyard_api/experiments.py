"""Experiments: the store, the routes' service and the views (``POST /v1/experiments``).

An experiment is a record in Redis (``ty:experiments``, one JSON :class:`ExperimentRecord` per id; each
tenant's names in ``ty:tenant:<t>:experiments``; the ones still searching in ``ty:experiments:active``). The
routes create it, read it and ask it to stop; the search itself is ``experiment_driver.ExperimentDriver``'s,
which moves the record on under WATCH. A trial is an ordinary job: :meth:`JobService.submit` with an
Idempotency-Key of (experiment, trial), so a trial is submitted once however often the driver tries.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel
from redis.asyncio import Redis
from redis.exceptions import RedisError, WatchError

from trainyard_contract.errors import ConflictError, NotFoundError, StateStoreError
from trainyard_contract.events import utcnow
from trainyard_contract.experiments import ExperimentRecord, ExperimentSpec, RungDecision, Trial
from trainyard_contract.records import TenantToken
from trainyard_runtime.replication import execute_confirmed
from trainyard_runtime.store import Keys

from trainyard_api.bodies import SubmittedSpec
from trainyard_api.jobs import JobService, new_job_id
from trainyard_api.search import rung_steps, sample_point, trial_body
from trainyard_api.validation import FieldProblem, InvalidSpecError, field_errors, under


def new_experiment_id() -> str:
    return f"exp-{secrets.token_hex(6)}"


def trial_key(experiment_id: str, number: int) -> str:
    """The Idempotency-Key a trial's job is submitted with."""
    return f"experiment:{experiment_id}:trial:{number}"


def trial_job_id(record: ExperimentRecord, number: int) -> str:
    return new_job_id(record.tenant, trial_key(record.experiment_id, number))


def experiment_token(record: ExperimentRecord) -> TenantToken:
    """Whom an experiment's trials are submitted and controlled as: its tenant, named after it."""
    return TenantToken(tenant=record.tenant, name=f"experiment:{record.spec.name}", role="submitter",
                       token_id=record.experiment_id)


def space_problems(spec: ExperimentSpec) -> list[FieldProblem]:
    """What the search space asks that the base cannot take (pure)."""
    problems: list[FieldProblem] = []
    es = spec.early_stopping
    max_steps = int(spec.base.get("training", {}).get("maxSteps", 0))
    if es is not None:
        if "training.maxSteps" in spec.space:
            problems.append(FieldProblem("space.training.maxSteps", "early stopping compares trials at the same "
                                                                    "steps: training.maxSteps cannot vary with it"))
        if spec.budget.max_trials < 2:
            problems.append(FieldProblem("budget.maxTrials", "early stopping compares trials: give it at least 2"))
        elif not rung_steps(spec, max_steps):
            problems.append(FieldProblem("earlyStopping.minSteps", f"the first rung ({es.min_steps}) must come "
                                                                    f"before base.training.maxSteps ({max_steps})"))
    return problems


# ----------------------------------------------------------------------------- views


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class BestTrial(_Out):
    trial: int
    job_id: str | None
    value: float | None
    params: dict[str, float | int | str | bool]
    checkpoint: str | None = Field(default=None, description="its job's latest READY checkpoint id")
    global_step: int | None = None


class ExperimentView(_Out):
    experiment_id: str
    tenant: str
    name: str
    state: str
    reason: str | None
    spec: ExperimentSpec
    trials: list[Trial]
    rung_decisions: list[RungDecision]
    rungs: list[int] = Field(description="the steps at which successive halving compares the trials")
    best: BestTrial | None
    device_hours: float = Field(description="the device-hours every trial held so far")
    created_by: str | None
    created_at: datetime
    updated_at: datetime


class ExperimentList(_Out):
    experiments: list[ExperimentView]


def experiment_view(record: ExperimentRecord, best_checkpoint: tuple[str, int] | None = None) -> ExperimentView:
    best = None
    if record.best_trial is not None:
        t = record.trials[record.best_trial]
        best = BestTrial(trial=t.number, job_id=t.job_id, value=t.value, params=t.params,
                         checkpoint=best_checkpoint[0] if best_checkpoint else None,
                         global_step=best_checkpoint[1] if best_checkpoint else None)
    max_steps = int(record.spec.base.get("training", {}).get("maxSteps", 0))
    return ExperimentView(
        experiment_id=record.experiment_id, tenant=record.tenant, name=record.spec.name, state=record.state,
        reason=record.reason, spec=record.spec, trials=record.trials,
        rung_decisions=record.rung_decisions,
        rungs=rung_steps(record.spec, max_steps), best=best,
        device_hours=round(sum(t.device_hours for t in record.trials), 6), created_by=record.created_by,
        created_at=record.created_at, updated_at=record.updated_at)


# ----------------------------------------------------------------------------- the store

Change = Callable[[ExperimentRecord], Awaitable[ExperimentRecord | None]]


class ExperimentStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def create(self, record: ExperimentRecord) -> str | None:
        """Store a new experiment; the id of the tenant's experiment of that name when there is one already."""
        names = Keys.tenant_experiments(record.tenant)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(names)
                        if taken := await pipe.hget(names, record.spec.name):
                            await pipe.unwatch()
                            return str(taken)
                        pipe.multi()
                        pipe.hset(names, record.spec.name, record.experiment_id)
                        pipe.hset(Keys.experiments, record.experiment_id, record.dumps())
                        pipe.sadd(Keys.experiments_active, record.experiment_id)
                        await execute_confirmed(self.redis, pipe)
                        return None
                    except WatchError:
                        continue
        except RedisError as exc:
            raise StateStoreError(f"cannot store experiment {record.experiment_id}: {exc!r}") from exc

    async def get(self, experiment_id: str) -> ExperimentRecord | None:
        raw = await self.redis.hget(Keys.experiments, experiment_id)
        return ExperimentRecord.model_validate_json(raw) if raw else None

    async def of_tenant(self, tenant: str) -> list[ExperimentRecord]:
        ids = list((await self.redis.hgetall(Keys.tenant_experiments(tenant))).values())
        raws = await self.redis.hmget(Keys.experiments, ids) if ids else []
        return [ExperimentRecord.model_validate_json(r) for r in raws if r]

    async def active(self) -> list[str]:
        return sorted(str(i) for i in await self.redis.smembers(Keys.experiments_active))

    async def update(self, experiment_id: str, change: Change) -> ExperimentRecord | None:
        """Read, change and write the record under WATCH (``change`` answering None writes nothing); the
        record as written, or None when there is no such experiment."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(Keys.experiments)
                    raw = await pipe.hget(Keys.experiments, experiment_id)
                    if not raw:
                        await pipe.unwatch()
                        return None
                    current = ExperimentRecord.model_validate_json(raw)
                    changed = await change(current)
                    if changed is None or changed == current:
                        await pipe.unwatch()
                        return current
                    pipe.multi()
                    pipe.hset(Keys.experiments, experiment_id, changed.dumps())
                    if changed.state != "running":
                        pipe.srem(Keys.experiments_active, experiment_id)
                    await execute_confirmed(self.redis, pipe)
                    return changed
                except WatchError:
                    continue


# ----------------------------------------------------------------------------- the routes' service


class ExperimentService:
    """What the experiment routes do, scoped to the calling tenant (another tenant's experiment is a 404)."""

    def __init__(self, store: ExperimentStore, jobs: JobService, *,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.jobs = jobs
        self.clock = clock

    async def create(self, token: TenantToken, spec: ExperimentSpec) -> ExperimentView:
        """Check the base and one trial's spec as POST /v1/training-jobs would, then store the experiment."""
        problems = space_problems(spec)
        record = ExperimentRecord(experiment_id=new_experiment_id(), tenant=token.tenant, spec=spec,
                                  created_by=token.token_id or token.name, created_at=self.clock(),
                                  updated_at=self.clock())
        first = Trial(number=0, params=sample_point(spec, 0, []))
        try:
            trial_spec = SubmittedSpec.model_validate(trial_body(spec, first))
        except ValidationError as exc:
            problems.extend(_space_or_base(spec, field_errors(exc.errors())))
        else:
            try:
                await self.jobs.check(trial_spec, token)
            except InvalidSpecError as exc:
                problems.extend(_space_or_base(spec, exc.problems))
        if problems:
            raise InvalidSpecError(problems)
        if (taken := await self.store.create(record)) is not None:
            raise ConflictError(f"tenant {token.tenant!r} has an experiment named {spec.name!r} already ({taken}); "
                                "choose another name")
        return experiment_view(record)

    async def _own(self, token: TenantToken, experiment_id: str) -> ExperimentRecord:
        record = await self.store.get(experiment_id)
        if record is None or record.tenant != token.tenant:
            raise NotFoundError(f"no experiment {experiment_id!r} for tenant {token.tenant!r} "
                                "(GET /v1/experiments lists them)")
        return record

    async def list(self, token: TenantToken) -> ExperimentList:
        records = sorted(await self.store.of_tenant(token.tenant), key=lambda r: (r.created_at, r.experiment_id))
        return ExperimentList(experiments=[experiment_view(r) for r in records])

    async def get(self, token: TenantToken, experiment_id: str) -> ExperimentView:
        record = await self._own(token, experiment_id)
        return experiment_view(record, await self._best_checkpoint(record))

    async def _best_checkpoint(self, record: ExperimentRecord) -> tuple[str, int] | None:
        if record.best_trial is None or (job_id := record.trials[record.best_trial].job_id) is None:
            return None
        ready = [c for c in await self.jobs.store.list_checkpoints(job_id) if c.state == "READY"]
        newest = max(ready, key=lambda c: c.global_step, default=None)
        return (newest.checkpoint_id, newest.global_step) if newest is not None else None

    async def stop(self, token: TenantToken, experiment_id: str) -> ExperimentView:
        """Ask the search to stop: its running trials are checkpointed and stopped, no new one starts."""
        await self._own(token, experiment_id)

        async def ask(current: ExperimentRecord) -> ExperimentRecord | None:
            if current.state != "running" or current.stop_requested:
                return None
            return current.model_copy(update={"stop_requested": f"stopped by {token.name}",
                                              "updated_at": self.clock()})

        record = await self.store.update(experiment_id, ask)
        assert record is not None
        return experiment_view(record)


def _space_or_base(spec: ExperimentSpec, problems: list[FieldProblem]) -> list[FieldProblem]:
    """A trial spec's problems named where the user can fix them: ``space.<path>`` when the search space sets
    the field, else ``base.<field>``."""
    out = []
    for p in problems:
        varied = next((path for path in spec.space if p.field == path or p.field.startswith(path + ".")), None)
        out.extend([FieldProblem(f"space.{varied}", p.message)] if varied else under("base", [p]))
    return out
