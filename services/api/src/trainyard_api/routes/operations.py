"""The ``operations`` routes, without authentication: health, Prometheus metrics, and the event contract
(AsyncAPI 3.0; outside the OpenAPI document, like ``/openapi.json``)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from trainyard_common import contract

from trainyard_api.deps import Ctx
from trainyard_api.schemas import Health

router = APIRouter()


@router.get("/healthz", response_model=Health, tags=["operations"], summary="Liveness and readiness",
            responses={503: {"model": Health, "description": "Redis or the broker is unavailable"}})
async def healthz(ctx: Ctx) -> JSONResponse:
    """Redis answers PING and the broker connection is started."""
    try:
        redis_ok = bool(await ctx.store.redis.ping())
        pending = await ctx.outbox.pending()
    except (RedisError, OSError):
        redis_ok, pending = False, None
    broker_ok = ctx.bus is not None and ctx.bus.started
    body = Health(status="ok" if redis_ok and broker_ok else "degraded", redis=redis_ok,
                  broker=broker_ok, outbox_pending=pending, worker=ctx.settings.api_worker_index)
    return JSONResponse(body.model_dump(by_alias=True), status_code=200 if body.status == "ok" else 503)


@router.get("/metrics", tags=["operations"], summary="Prometheus metrics",
            response_class=PlainTextResponse)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/asyncapi.yaml", include_in_schema=False)
async def asyncapi_yaml() -> Response:
    return Response(await run_in_threadpool(contract.asyncapi_yaml), media_type="application/yaml")


@router.get("/v1/asyncapi.json", include_in_schema=False)
async def asyncapi_json() -> Response:
    return Response(await run_in_threadpool(contract.asyncapi_json), media_type="application/json")
