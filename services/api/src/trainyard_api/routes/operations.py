"""The ``operations`` routes: health and the event contract (AsyncAPI 3.0; outside the OpenAPI document, like
``/openapi.json``) without authentication; Prometheus metrics (they name tenants and jobs) with a platform-admin
token or the API's metrics token (``TRAINYARD_API_METRICS_TOKEN``), unless ``TRAINYARD_API_PUBLIC_METRICS``."""

from __future__ import annotations

import hmac
import json

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from trainyard_contract import asyncapi as contract
from trainyard_contract.errors import AuthError
from trainyard_runtime.store import Keys

from trainyard_api.auth import authenticate, bearer_token, require
from trainyard_api.deps import Ctx
from trainyard_api.http_errors import ADMIN_ERRORS
from trainyard_api.roles import Right
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
            # Response, not PlainTextResponse: FastAPI documents every error's body in the route's media type, and
            # the 401/403 bodies are JSON like everywhere else
            response_class=Response,
            responses={200: {"description": "the Prometheus text exposition format",
                             "content": {"text/plain": {"schema": {"type": "string"}}}},
                       **ADMIN_ERRORS})
async def metrics(request: Request, ctx: Ctx) -> Response:
    """The API's Prometheus metrics. They label tenants and jobs, so they need `Authorization: Bearer` with the
    metrics token (`TRAINYARD_API_METRICS_TOKEN`, what a scraper is given) or a platform-admin token; open to
    anyone only with `TRAINYARD_API_PUBLIC_METRICS=true`."""
    if not ctx.settings.api_public_metrics:
        await _metrics_reader(ctx, request.headers.get("authorization"))
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _metrics_reader(ctx: Ctx, authorization: str | None) -> None:
    """Nothing when the request may read the metrics; AuthError (401) or ForbiddenError (403) saying why not."""
    expected = ctx.settings.api_metrics_token
    try:
        secret = bearer_token(authorization)
        if expected is not None and hmac.compare_digest(secret.encode(), expected.get_secret_value().encode()):
            return
        token = await authenticate(ctx.store, authorization)
    except AuthError as exc:
        raise AuthError(f"{exc.message} (GET /metrics takes the metrics token, TRAINYARD_API_METRICS_TOKEN, "
                        "or a platform-admin token)") from exc
    require(token, Right.NODES)


@router.get("/v1/asyncapi.yaml", include_in_schema=False)
async def asyncapi_yaml() -> Response:
    return Response(await run_in_threadpool(contract.asyncapi_yaml), media_type="application/yaml")


@router.get("/v1/asyncapi.json", include_in_schema=False)
async def asyncapi_json() -> Response:
    return Response(await run_in_threadpool(contract.asyncapi_json), media_type="application/json")
