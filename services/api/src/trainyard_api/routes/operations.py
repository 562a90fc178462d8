"""The ``operations`` routes, without authentication: health, Prometheus metrics, and the event contract
(AsyncAPI 3.0; outside the OpenAPI document, like ``/openapi.json``)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from trainyard_common import contract
from trainyard_common.store import Keys

from trainyard_api.deps import Ctx
from trainyard_api.schemas import Health, StuckConsumer

router = APIRouter()


@router.get("/healthz", response_model=Health, tags=["operations"], summary="Liveness and readiness",
            responses={503: {"model": Health, "description": "Redis or the broker is unavailable"}})
async def healthz(ctx: Ctx) -> JSONResponse:
    """Redis answers PING and the broker connection is started (else 503); ``degraded`` with 200 when a consumer
    of any service is stuck on one record (``stuckConsumers``)."""
    stuck: list[StuckConsumer] = []
    try:
        redis_ok = bool(await ctx.store.redis.ping())
        pending = await ctx.outbox.pending()
        stuck = await _stuck_consumers(ctx.store.redis)
    except (RedisError, OSError):
        redis_ok, pending = False, None
    broker_ok = ctx.bus is not None and ctx.bus.started
    if ctx.bus is not None:
        ours = {(s.group, s.topic, s.partition) for s in stuck}
        stuck += [StuckConsumer(service="api", instance="this", **s.as_dict()) for s in ctx.bus.stuck()
                  if (s.group, s.topic, s.partition) not in ours]
    serving = redis_ok and broker_ok
    body = Health(status="ok" if serving and not stuck else "degraded", redis=redis_ok,
                  broker=broker_ok, outbox_pending=pending, worker=ctx.settings.api_worker_index,
                  stuck_consumers=stuck)
    return JSONResponse(body.model_dump(by_alias=True), status_code=200 if serving else 503)


async def _stuck_consumers(redis: Redis) -> list[StuckConsumer]:
    """What every service's beacon reports stuck (``ty:stuck:<service>:<instance>``)."""
    out: list[StuckConsumer] = []
    keys = [k async for k in redis.scan_iter(match=Keys.stuck("*", "*"), count=100)]
    for key, raw in zip(keys, await redis.mget(keys) if keys else []):
        if raw is None:
            continue
        _, _, service, instance = (key.decode() if isinstance(key, bytes) else key).split(":", 3)
        try:
            out += [StuckConsumer(service=service, instance=instance, **item) for item in json.loads(raw)]
        except (ValueError, TypeError):
            continue  # a beacon of another version: skip it rather than fail the health check
    return out


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
