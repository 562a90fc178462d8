"""The ``triggers`` routes: create, list, read and delete the triggers that submit a job from a template for
each new verified version of a matching dataset."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Request

from trainyard_contract.records import TenantToken

from trainyard_api.bodies import TriggerCreateBody
from trainyard_api.deps import Ctx, Tenant, may, strict_body
from trainyard_api.http_errors import AUTH_ERRORS, NOT_JSON, error, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import EXAMPLE_TEMPLATE, TriggerList, TriggerView

_TRIGGER_CREATE = may(Right.SUBMIT, "trigger.create")
TriggerCreator = Annotated[TenantToken, _TRIGGER_CREATE]
TriggerDeleter = Annotated[TenantToken, may(Right.SUBMIT, "trigger.delete")]
TriggerId = Annotated[str, Path(pattern=r"^trg-[0-9a-f]{12}$", description="the trigger's id, `trg-` + 12 hex",
                                examples=["trg-5c1d9e0a7b2f"])]
_NO_TRIGGER = error(404, "no such trigger for this tenant")

router = APIRouter()


@router.post(
    "/v1/triggers", status_code=201, response_model=TriggerView, tags=["triggers"], summary="Create a trigger",
    dependencies=[strict_body(TriggerCreateBody, _TRIGGER_CREATE)],
    responses={**AUTH_ERRORS, **NOT_JSON, **error(409, "the tenant has a trigger of that name already"),
               **invalid("an invalid body, each problem named by field; the template is checked as "
                         "POST /v1/training-jobs checks a spec (its dataset aside), its problems named "
                         "`template.<field>` (`template.resources.gpuCount`, `template.modelConfig`)")},
)
async def create_trigger(
    ctx: Ctx, tenant: TriggerCreator, request: Request,
    body: Annotated[TriggerCreateBody, Body(openapi_examples={
        "wiki": {"summary": "train the tiny example on every new version of the tenant's wiki-* datasets",
                 "value": {"name": "wiki-nightly", "dataset": "wiki-*", "sources": ["own"],
                           "template": EXAMPLE_TEMPLATE}},
        "platform": {"summary": "and on new versions of the platform's tinycorpus",
                     "value": {"name": "tinycorpus", "dataset": "tinycorpus", "sources": ["platform"],
                               "template": EXAMPLE_TEMPLATE}},
    })],
) -> TriggerView:
    """Each new verified version of a dataset whose name matches `dataset` (a glob: `wiki-*`) and whose
    owner is one of `sources` (`own`: the tenant's; `platform`: the platform's; `shared`: other
    tenants' shared with this one) submits a job from `template` with `dataset` set to that version's
    qualified ref, once per version (`GET /v1/triggers/{triggerId}` lists the jobs). The job's
    `triggeredBy` names the trigger and the version. Submitter or above."""
    created = await ctx.triggers.create(tenant, body)
    request.state.audit_target = f"trigger/{created.trigger_id}"
    return created


@router.get("/v1/triggers", response_model=TriggerList, tags=["triggers"], summary="List the tenant's triggers",
            responses=AUTH_ERRORS)
async def list_triggers(ctx: Ctx, tenant: Tenant) -> TriggerList:
    """Oldest first, each with its last failure (null when none)."""
    return await ctx.triggers.list(tenant)


@router.get("/v1/triggers/{trigger_id}", response_model=TriggerView, tags=["triggers"], summary="Get a trigger",
            responses={**AUTH_ERRORS, **_NO_TRIGGER, **invalid()})
async def get_trigger(ctx: Ctx, tenant: Tenant, trigger_id: TriggerId) -> TriggerView:
    """The trigger, the jobs it started (one per dataset version) and the last version it could not
    submit a job for, with why (`lastFailure`: e.g. a template the model catalog no longer takes)."""
    return await ctx.triggers.get(tenant, trigger_id)


@router.delete("/v1/triggers/{trigger_id}", response_model=TriggerView, tags=["triggers"],
               summary="Delete a trigger", responses={**AUTH_ERRORS, **_NO_TRIGGER, **invalid()})
async def delete_trigger(ctx: Ctx, tenant: TriggerDeleter, trigger_id: TriggerId) -> TriggerView:
    """New dataset versions start nothing more; the jobs it started stay. Answers the trigger as it was.
    Submitter or above."""
    return await ctx.triggers.delete(tenant, trigger_id)
