"""The ``goodput`` routes: allocated vs productive vs wasted device-time per tenant, now and over time."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from trainyard_telemetry.goodput_history import intervals

from trainyard_api.auth import require
from trainyard_api.deps import Ctx, Tenant
from trainyard_api.http_errors import AUTH_ERRORS, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import GoodputHistory, GoodputIntervalView, GoodputReport
from trainyard_api.views import goodput_interval_view, goodput_view

_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _rfc3339(value: object) -> object:
    """A query instant as the document promises it (format date-time): pydantic alone would also take epoch
    numbers and naive times."""
    if isinstance(value, str) and not _RFC3339.fullmatch(value):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time with an offset, e.g. 2026-12-01T00:00:00Z")
    return value


Instant = Annotated[datetime, BeforeValidator(_rfc3339)]

router = APIRouter()


@router.get("/v1/goodput", response_model=GoodputReport, tags=["goodput"],
            summary="The tenant's goodput ledger",
            responses={**AUTH_ERRORS, **invalid()})
async def get_goodput(
    ctx: Ctx, tenant: Tenant,
    all_tenants: Annotated[bool, Query(alias="all", description="every tenant's ledger (platform-admin)")] = False,
) -> GoodputReport:
    """Device-seconds summed over the caller's jobs: allocated, productive (steps a READY
    checkpoint or the final model saved), in flight, and wasted by cause (lostWork, launchRestore,
    checkpointStall, hang, idle; they add up to allocated exactly). Computed from the attempts,
    the checkpoint records and rank 0's step timing at request time; the Prometheus gauges are
    refreshed every `TRAINYARD_GOODPUT_REFRESH_S`."""
    accounting = ctx.accounting
    ledger, jobs = await accounting.tenant(tenant.tenant)
    others = None
    if all_tenants:
        require(tenant, Right.ALL_TENANTS)
        others = {name: goodput_view(v) for name, v in (await accounting.all_tenants()).items()}
    return GoodputReport(tenant=tenant.tenant, jobs=jobs, ledger=goodput_view(ledger), tenants=others)


@router.get("/v1/goodput/history", response_model=GoodputHistory, tags=["goodput"],
            summary="The tenant's goodput over time",
            responses={**AUTH_ERRORS, **invalid()})
async def get_goodput_history(
    ctx: Ctx, tenant: Tenant,
    since: Annotated[Instant | None, Query(description="only intervals that end after this instant")] = None,
    until: Annotated[Instant | None, Query(description="only intervals that start before this instant")] = None,
    all_tenants: Annotated[bool, Query(alias="all", description="every tenant's history (platform-admin)")] = False,
) -> GoodputHistory:
    """Allocated, productive, in-flight and wasted device-seconds (by cause) per interval, oldest
    first, with each interval's goodput (Δproductive ÷ Δallocated; null when nothing was
    allocated). Every `TRAINYARD_GOODPUT_REFRESH_S` the API samples each tenant's cumulative
    ledger (the one `GET /v1/goodput` answers) into a bucket of `TRAINYARD_GOODPUT_HISTORY_BUCKET_S`
    (default 300 s; the latest sample of a bucket wins); an interval runs from the instant one
    sample was taken to the next one's, so a gap while no API ran is one long interval. Samples are kept for
    `TRAINYARD_GOODPUT_HISTORY_RETENTION_S` (default 30 days). `since` and `until` (RFC 3339, with
    an offset) keep the intervals that overlap them (none when `since` is after `until`)."""
    accounting = ctx.accounting
    window = {"since": since.timestamp() if since else None, "until": until.timestamp() if until else None}

    async def of(name: str) -> list[GoodputIntervalView]:
        return [goodput_interval_view(i) for i in intervals(await accounting.history(name), **window)]

    others = None
    if all_tenants:
        require(tenant, Right.ALL_TENANTS)
        others = {name: await of(name) for name in await accounting.history_tenants()}
    return GoodputHistory(tenant=tenant.tenant, bucket_seconds=accounting.history_bucket_s,
                          intervals=await of(tenant.tenant), tenants=others)
