"""The ``experiments`` routes: create a sweep over a base spec, follow its trials, stop it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Request

from trainyard_contract.records import TenantToken

from trainyard_api.bodies import ExperimentBody
from trainyard_api.deps import Ctx, Tenant, may, strict_body
from trainyard_api.experiments import ExperimentList, ExperimentView
from trainyard_api.http_errors import AUTH_ERRORS, NOT_JSON, error, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import EXAMPLE_TEMPLATE

_CREATE = may(Right.SUBMIT, "experiment.create")
Creator = Annotated[TenantToken, _CREATE]
Stopper = Annotated[TenantToken, may(Right.CONTROL, "experiment.stop")]
ExperimentId = Annotated[str, Path(pattern=r"^exp-[0-9a-f]{12}$", description="`exp-` + 12 hex",
                                   examples=["exp-3f9a1c2b7d4e"])]
_NO_EXPERIMENT = error(404, "no such experiment for this tenant")
_EXAMPLE: dict[str, Any] = {
    "name": "lr-sweep",
    "base": {**EXAMPLE_TEMPLATE, "dataset": "tinycorpus@v1"},
    "space": {"training.learningRate": {"type": "float", "low": 0.0003, "high": 0.03, "log": True}},
    "search": {"algorithm": "random", "seed": 7},
    "metric": {"name": "loss", "goal": "minimize"},
    "earlyStopping": {"kind": "successiveHalving", "minSteps": 10, "reductionFactor": 2},
    "budget": {"maxTrials": 6},
    "maxConcurrentTrials": 2,
}

router = APIRouter()


@router.post(
    "/v1/experiments", status_code=201, response_model=ExperimentView, response_model_by_alias=True,
    tags=["experiments"], summary="Start an experiment", dependencies=[strict_body(ExperimentBody, _CREATE)],
    responses={**AUTH_ERRORS, **NOT_JSON, **error(409, "the tenant has an experiment of that name already"),
               **invalid("an invalid body, each problem named by field: the base as POST /v1/training-jobs "
                         "checks a spec (`base.modelConfig`), a trial's point where the space sets it "
                         "(`space.training.learningRate`)")},
)
async def create_experiment(ctx: Ctx, tenant: Creator, request: Request,
                            body: Annotated[ExperimentBody, Body(openapi_examples={
                                "lr": {"summary": "six learning rates, the worst stopped early", "value": _EXAMPLE}})]
                            ) -> ExperimentView:
    """Each trial is the base spec with its point of `space` written in (dotted camelCase paths), submitted as an
    ordinary job (its `experiment` names the experiment, the trial and the point). At most
    `maxConcurrentTrials` hold devices at once. With `earlyStopping` (successive halving) a trial pauses at
    each rung until every trial still in the race reached it; the best 1/η go on, the others stop with a
    checkpoint and the reason. The search survives API restarts (its state is in Redis). Submitter or above."""
    created = await ctx.experiments.create(tenant, body.experiment_spec())
    request.state.audit_target = f"experiment/{created.experiment_id}"
    return created


@router.get("/v1/experiments", response_model=ExperimentList, response_model_by_alias=True, tags=["experiments"],
            summary="List the tenant's experiments", responses=AUTH_ERRORS)
async def list_experiments(ctx: Ctx, tenant: Tenant) -> ExperimentList:
    """Oldest first, each with its trials."""
    return await ctx.experiments.list(tenant)


@router.get("/v1/experiments/{experiment_id}", response_model=ExperimentView, response_model_by_alias=True,
            tags=["experiments"], summary="Get an experiment",
            responses={**AUTH_ERRORS, **_NO_EXPERIMENT, **invalid()})
async def get_experiment(ctx: Ctx, tenant: Tenant, experiment_id: ExperimentId) -> ExperimentView:
    """Its trials (point, job, state, metric at each rung, last value, device-hours, why it stopped), the rung
    decisions, and once it is over the best trial with its job's latest READY checkpoint."""
    return await ctx.experiments.get(tenant, experiment_id)


@router.post("/v1/experiments/{experiment_id}/stop", response_model=ExperimentView, response_model_by_alias=True,
             status_code=202, tags=["experiments"], summary="Stop an experiment",
             responses={**AUTH_ERRORS, **_NO_EXPERIMENT, **invalid()})
async def stop_experiment(ctx: Ctx, tenant: Stopper, experiment_id: ExperimentId) -> ExperimentView:
    """Its running trials checkpoint and stop, no new trial starts; the best trial so far is kept."""
    return await ctx.experiments.stop(tenant, experiment_id)
