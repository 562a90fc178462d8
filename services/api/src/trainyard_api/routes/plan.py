"""The ``planning`` routes: plan capacity for a model on a set of devices, and the planner's calibration
per device type."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query
from starlette.concurrency import run_in_threadpool

from trainyard_telemetry.calibration import CalibrationReport, report

from trainyard_api.deps import Ctx, Tenant, strict_body
from trainyard_api.http_errors import AUTH_ERRORS, NOT_JSON, invalid
from trainyard_api.planning import PLAN_EXAMPLES, PlanRequest, PlanResponse, device_type_of, plan

router = APIRouter()


@router.post(
    "/v1/plan", response_model=PlanResponse, tags=["planning"], dependencies=[strict_body(PlanRequest)],
    summary="Plan capacity for a model on a set of devices",
    responses={**AUTH_ERRORS, **NOT_JSON, **invalid(
        "invalid input (or a body that is not JSON), each problem named by field; also a valid one the planner "
        "cannot answer: an unknown model or device, a layout whose dp x tp x pp differs from devices, a "
        "globalBatch the layout does not give, recommending without globalBatch, a layout the model cannot "
        "be split by")},
)
async def plan_capacity(
    ctx: Ctx,
    _: Tenant,
    request: Annotated[PlanRequest, Body(openapi_examples=PLAN_EXAMPLES)],
) -> PlanResponse:
    """Memory per device, step time, communication and bottleneck for a layout, or every
    feasible layout ranked with each rejected one explained (`"layout": "recommend"`); time to
    train from `tokens`; checkpoint size, write time and Young / Daly intervals from
    `checkpoint`. The same arithmetic as `trainyard plan …` and the submission check. When the
    platform has measured the device type, `calibrated` adds the estimates corrected by its
    measurements, and says which calibration (factors, sample counts) that was. Nothing is
    stored."""
    stored = await ctx.calibrations.load() if request.calibrate else None
    return await run_in_threadpool(
        plan, request, assumptions=ctx.settings.assumptions, calibration=stored.fitted if stored else None,
        fitted_at=stored.fitted_at if stored else None)


@router.get(
    "/v1/plan/calibration", response_model=CalibrationReport, tags=["planning"],
    summary="The planner's calibration per device type: factors, and predicted vs measured",
    responses={**AUTH_ERRORS, **invalid()},
)
async def plan_calibration(
    ctx: Ctx,
    tenant: Tenant,
    device_type: Annotated[str | None, Query(alias="deviceType", max_length=64,
                                             description="only this device type")] = None,
    limit: Annotated[int, Query(ge=0, le=1000, description="rows per device type and kind, newest first")] = 20,
) -> CalibrationReport:
    """Per device type: the fitted step-time and checkpoint-write factors (measured / predicted),
    the measured MTBF per device, the samples behind each, and a predicted-vs-measured table
    (measured, the raw prediction, the calibrated one, error %). Samples come from rank 0's
    StepMetrics (step time without checkpoints, checkpoint stalls) and from failed attempts;
    the fit is refreshed every `TRAINYARD_CALIBRATION_REFRESH_S`. Other tenants' samples count
    and are shown without their job ids."""
    store = ctx.calibrations
    types = [device_type_of(device_type)] if device_type else None
    measurements, stored = await store.measurements(types), await store.load()
    s = ctx.settings
    return report(measurements, stored, tenant=tenant.tenant, assumptions=s.assumptions, only=types,
                  min_samples=s.calibration_min_samples, max_samples=s.calibration_max_samples, limit=limit)
