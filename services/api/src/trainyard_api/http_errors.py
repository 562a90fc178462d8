"""Errors over HTTP: the handlers that map ``trainyard_contract.errors`` to statuses, and the error responses
routes document.

SpecError 422 (with every bad field), AuthError 401 (its ForbiddenError, a role without the right: 403),
NotFoundError 404, ConflictError 409, InfrastructureError and a Redis that cannot serve 503; anything else
is a 500. ``OPTIONS`` answers 204 and a method the path lacks 405, both with ``Allow``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis import exceptions as redis_errors
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match, Route

from trainyard_contract.errors import (
    AuthError,
    ConflictError,
    InfrastructureError,
    NotFoundError,
    SpecError,
    TrainyardError,
)

from trainyard_api.auth import ForbiddenError
from trainyard_api.code import ArchiveTooLargeError
from trainyard_api.schemas import ErrorMessage, FieldErrors
from trainyard_api.validation import FieldProblem, InvalidSpecError, field_errors, with_json_positions

log = logging.getLogger(__name__)

REDIS_OUTAGES = (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ReadOnlyError,
                 redis_errors.TryAgainError, redis_errors.ClusterDownError, redis_errors.OutOfMemoryError)
"""Redis errors that mean the store cannot serve now (503, retry); any other is a refused command (500)."""

# ----------------------------------------------------------------------------- documented responses

Responses = dict[int | str, dict[str, Any]]


def error(status: int, description: str, *, model: type[Any] = ErrorMessage,
          headers: dict[str, str] | None = None) -> Responses:
    """One documented error response; ``headers``: name → description of headers it always carries."""
    doc: dict[str, Any] = {"model": model, "description": description}
    if headers:
        doc["headers"] = {name: {"description": text, "required": True, "schema": {"type": "string"}}
                          for name, text in headers.items()}
    return {status: doc}


def invalid(description: str = "invalid parameters, each named by field (`query.limit`, `path.jobId`)"
            ) -> Responses:
    """The documented 422: every bad field, by name."""
    return error(422, description, model=FieldErrors)


NOT_JSON = error(415, "the body is not sent as `application/json`")
UNAUTHORIZED = error(401, "missing, malformed, unknown, revoked or expired bearer token",
                     headers={"WWW-Authenticate": "`Bearer`"})
UNAVAILABLE = error(503, "the state store (Redis) is unavailable, or the API is overloaded; retry",
                    headers={"Retry-After": "seconds"})
FORBIDDEN = error(403, "the token's role lacks the right (the message names the role needed)")
AUTH_ERRORS: Responses = {**UNAUTHORIZED, **FORBIDDEN, **UNAVAILABLE}
JOB_ERRORS: Responses = {**AUTH_ERRORS, **error(404, "no such job for this tenant"), **invalid()}
ADMIN_ERRORS: Responses = {**UNAUTHORIZED, **UNAVAILABLE,
                           **error(403, "not a platform-admin token (or not one of this tenant's admins)")}

# ----------------------------------------------------------------------------- handlers


def _message(status: int, exc: TrainyardError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": exc.message}, status_code=status, headers=headers)


def _problems(problems: list[FieldProblem]) -> JSONResponse:
    return JSONResponse({"detail": [p.as_dict() for p in problems]}, status_code=422)


async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _problems(field_errors(with_json_positions(exc.errors(), exc.body)))


async def on_too_large(_: Request, exc: ArchiveTooLargeError) -> JSONResponse:
    return JSONResponse({"detail": exc.detail}, status_code=413)


async def on_spec(_: Request, exc: SpecError) -> JSONResponse:
    problems = exc.problems if isinstance(exc, InvalidSpecError) else None
    return _problems(problems or [FieldProblem(exc.field, exc.detail)])


async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        # FastAPI answers 400 when a JSON body is not UTF-8; it is as invalid as unparsable JSON
        return _problems([FieldProblem("body", f"the body is not valid JSON: it is not UTF-8 ({exc.__cause__})")])
    if exc.status_code == 405:
        return method_not_allowed(request)
    return await http_exception_handler(request, exc)


async def on_forbidden(_: Request, exc: ForbiddenError) -> JSONResponse:
    return _message(403, exc)


async def on_auth(_: Request, exc: AuthError) -> JSONResponse:
    return _message(401, exc, {"WWW-Authenticate": "Bearer"})


async def on_not_found(_: Request, exc: NotFoundError) -> JSONResponse:
    return _message(404, exc)


async def on_conflict(_: Request, exc: ConflictError) -> JSONResponse:
    return _message(409, exc)


async def on_trainyard(_: Request, exc: TrainyardError) -> JSONResponse:
    if exc.retryable or isinstance(exc, InfrastructureError):
        log.warning("request failed: %r", exc)
        return _message(503, exc, {"Retry-After": "1"})
    # every error a client can cause has its own status above: this one is ours
    log.error("request failed", exc_info=exc)
    return JSONResponse({"detail": "internal error"}, status_code=500)


async def on_redis(_: Request, exc: RedisError) -> JSONResponse:
    if isinstance(exc, redis_errors.MaxConnectionsError):  # Redis is up: this process has more requests in flight
        log.warning("overloaded: %r", exc)                 # than connections to it
        return JSONResponse({"detail": "the API is overloaded (every connection to the state store is busy); "
                                       "retry shortly"}, status_code=503, headers={"Retry-After": "1"})
    if isinstance(exc, REDIS_OUTAGES):
        log.warning("redis unavailable: %r", exc)
        return JSONResponse({"detail": "the state store (Redis) is unavailable; retry shortly"},
                            status_code=503, headers={"Retry-After": "1"})
    # Redis answered, and refused the command: a bug of ours, not an outage to retry
    log.error("redis refused a command", exc_info=exc)
    return JSONResponse({"detail": "internal error"}, status_code=500)


HANDLERS: dict[type[Exception], Any] = {
    RequestValidationError: on_validation,
    ArchiveTooLargeError: on_too_large,
    SpecError: on_spec,
    StarletteHTTPException: on_http,
    ForbiddenError: on_forbidden,
    AuthError: on_auth,
    NotFoundError: on_not_found,
    ConflictError: on_conflict,
    TrainyardError: on_trainyard,
    RedisError: on_redis,
}
"""Exception type → handler; the most derived registered type of an exception picks its handler."""


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of :data:`HANDLERS` as the API documents it."""
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)


def method_not_allowed(request: Request) -> Response:
    """OPTIONS on a route's path: 204 with every method of the path in ``Allow``; any other method the
    path does not have: 405 with the same ``Allow`` (Starlette's own lists only the first route's)."""
    methods: set[str] = {"OPTIONS"}
    for route in _every_route(request.app.router.routes):
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    allow = ", ".join(sorted(methods))
    if request.method == "OPTIONS":
        return Response(status_code=204, headers={"Allow": allow})
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": allow})


def _every_route(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """``routes`` and those of the routers they include: FastAPI (0.16x) keeps an included router as one
    entry (its ``original_router``). No router is included with a prefix, so each route's path is whole."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _every_route(included.routes)
        else:
            yield route
