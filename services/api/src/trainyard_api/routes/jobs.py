"""The ``jobs`` routes: submit a training job, list and read jobs and their checkpoints, cancel, pause and
resume them. (Metric history, logs and live updates are in :mod:`trainyard_api.routes.dashboard`.)"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Header, Query, Request, Response

from trainyard_contract.events import JobState
from trainyard_contract.records import TenantToken
from trainyard_contract.tracing import current_traceparent

from trainyard_api.bodies import SubmittedSpec
from trainyard_api.deps import Ctx, JobId, Tenant, may, strict_body
from trainyard_api.http_errors import AUTH_ERRORS, JOB_ERRORS, NOT_JSON, error, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import (
    EXAMPLE_SPEC,
    CheckpointList,
    ControlResponse,
    EvaluationList,
    JobPage,
    JobView,
    SubmitResponse,
)
from trainyard_api.views import checkpoint_view

MAX_OFFSET = 2**31 - 1
"""Largest list offset or page size a client may send (a page past the end is empty)."""

_SUBMIT = may(Right.SUBMIT, "job.submit")
Submitter = Annotated[TenantToken, _SUBMIT]
_CONTROLLERS = {action: Annotated[TenantToken, may(Right.CONTROL, f"job.{action}")]
                for action in ("cancel", "pause", "resume")}

router = APIRouter()


@router.post(
    "/v1/training-jobs", status_code=202, response_model=SubmitResponse,
    dependencies=[strict_body(SubmittedSpec, _SUBMIT)],
    tags=["jobs"], summary="Submit a training job",
    responses={
        202: {"headers": {
            "Location": {"description": "the job's URL", "required": True, "schema": {"type": "string"}},
            "Idempotent-Replayed": {"description": "`true` when an Idempotency-Key found an earlier job",
                                    "schema": {"type": "string", "enum": ["true"]}}}},
        **AUTH_ERRORS,
        **NOT_JSON,
        **error(409, "Idempotency-Key reused with a different spec"),
        **invalid("an invalid spec (or a body that is not JSON), each problem named by field; also a valid "
                  "one the platform cannot run: unknown model or dataset, a model that cannot fit the device, "
                  "an initFrom job without that READY checkpoint, parallelism that does not multiply to "
                  "gpuCount, a globalBatchSize that microBatchSize x data does not divide")},
)
async def submit_job(
    ctx: Ctx,
    tenant: Submitter,
    request: Request,
    response: Response,
    spec: Annotated[SubmittedSpec, Body(openapi_examples={
        "tiny": {"summary": "the tiny example (examples/tiny.yaml)", "value": EXAMPLE_SPEC},
    })],
    idempotency_key: Annotated[str | None, Header(
        max_length=200, description="a retried POST with the same key returns the same job")] = None,
) -> SubmitResponse:
    """Validate the spec (structure, model catalog, dataset registry, memory per device), store
    the job as `queued` and announce it (JobSubmitted). A model that cannot fit one device of
    `resources.gpuType` (as the trainer runs it: DDP, fp32 AdamW states) is a 422 naming
    `modelConfig` and `resources.gpuType`; one that fits only inside the planner's 15 % headroom
    is accepted with `warnings`. A `gpuCount` larger than the cluster is accepted: the job stays
    queued and `GET` says why (`queuedReason`)."""
    job, created, warnings = await ctx.jobs.submit(
        spec, tenant, idempotency_key=idempotency_key, traceparent=current_traceparent()
    )
    request.state.audit_target = f"job/{job.job_id}"
    request.state.audit_detail = None if created else "replayed (Idempotency-Key)"
    response.headers["Location"] = f"{ctx.settings.public_url}/v1/training-jobs/{job.job_id}"
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    return SubmitResponse(job_id=job.job_id, state=job.state, spec_hash=job.spec_hash, warnings=warnings or None)


@router.get("/v1/training-jobs", response_model=JobPage, tags=["jobs"], summary="List the tenant's jobs",
            responses={**AUTH_ERRORS, **invalid()})
async def list_jobs(
    ctx: Ctx,
    tenant: Tenant,
    state: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
    limit: Annotated[int | None, Query(
        gt=0, le=MAX_OFFSET, description="page size; default and maximum are the server's "
                                         "(TRAINYARD_API_PAGE_LIMIT, TRAINYARD_API_MAX_PAGE_LIMIT): a larger "
                                         "one gets the maximum")] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="from `nextOffset` of the previous page")] = 0,
) -> JobPage:
    """Newest first."""
    size = min(limit or ctx.settings.api_page_limit, ctx.settings.api_max_page_limit)
    return await ctx.jobs.list(tenant, state=state, limit=size, offset=offset)


@router.get("/v1/training-jobs/{job_id}", response_model=JobView, tags=["jobs"], summary="Get a job",
            responses=JOB_ERRORS)
async def get_job(ctx: Ctx, tenant: Tenant, job_id: JobId) -> JobView:
    """State, attempts (with placement score and detail), progress (global step, tokens, last loss,
    tokens/s), checkpoints (READY, FAILED with the reason — also a checkpoint refused at restore —
    and DELETED by retention, with write time), while queued why it waits (`queuedReason`,
    `queuedReasonKind`), the coordinator's `checkpointAdvice` (Young/Daly interval, method, inputs),
    the `goodput` ledger, each rank's latest timing breakdown (`rankTiming`: compute, collective,
    data-wait, checkpoint seconds, MFU) and `stragglers`."""
    return await ctx.jobs.view(tenant, job_id)


@router.get("/v1/training-jobs/{job_id}/checkpoints", response_model=CheckpointList, tags=["jobs"],
            summary="List a job's checkpoints", responses=JOB_ERRORS)
async def list_checkpoints(ctx: Ctx, tenant: Tenant, job_id: JobId) -> CheckpointList:
    """Oldest first; a checkpoint is usable only when `state` is READY (every shard verified)."""
    records = await ctx.jobs.checkpoints(tenant, job_id)
    return CheckpointList(job_id=job_id, checkpoints=[checkpoint_view(c) for c in records])


@router.get("/v1/training-jobs/{job_id}/evaluations", response_model=EvaluationList, tags=["jobs"],
            summary="List the evaluations of a job's checkpoints", responses=JOB_ERRORS)
async def list_evaluations(ctx: Ctx, tenant: Tenant, job_id: JobId) -> EvaluationList:
    """Each evaluation job's results (a `checkpointReady` trigger's, or one submitted with `evaluation`), attached
    by the registry to the checkpoint it evaluated: `globalStep`, `checkpointId` (the checkpoint's artifact),
    `metrics`. Oldest step first."""
    return EvaluationList(job_id=job_id, evaluations=await ctx.jobs.evaluations(tenant, job_id))


def _add_control_route(action: Literal["cancel", "pause", "resume"], doc: str) -> None:
    async def control(ctx: Ctx, tenant: TenantToken, job_id: JobId) -> ControlResponse:
        return await ctx.jobs.control(tenant, job_id, action)

    control.__annotations__["tenant"] = _CONTROLLERS[action]  # per action: not a module-level name

    control.__doc__ = doc + (" Answers 202 with the job's state at the time of the request, once the request is "
                             "recorded for the scheduler (which acts on no control event the API did not record).")
    router.post(
        f"/v1/training-jobs/{{job_id}}/{action}", status_code=202, response_model=ControlResponse,
        tags=["jobs"], summary=f"{action.capitalize()} a job", name=f"{action}_job",
        responses={**JOB_ERRORS, **error(409, "not allowed in the job's state, or the job has had 256 control "
                                              "requests in the last 3 days")},
    )(control)


_add_control_route("cancel", "Stop the job; it ends `cancelled`. A finished job answers 409.")
_add_control_route("pause", "Pause the job: the scheduler asks its ranks for a checkpoint (CheckpointRequested), "
                            "waits for it to become READY, then releases the gang; the job is `paused` and holds no "
                            "devices. A queued job is paused at once. Published as a JobControlRequested event.")
_add_control_route("resume", "Resume a paused job: it queues again and its next attempt starts from the latest "
                             "READY checkpoint (the one the pause wrote).")
