"""The dependencies routes share: the context, the caller's token and its rights (audited), a body held
to JSON of its model's types, one value per query parameter; and the ``Annotated`` names routes declare.

Route modules use ``from __future__ import annotations``: a route's parameter annotations are strings
resolved in its own module's namespace, so every dependency a signature names is a module-level name there.
A role dependency audited by a route (``may(right, action)``) is made once and shared by its annotation and
its ``strict_body``, so FastAPI runs (and audits) it once per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainyard_contract.records import TenantToken

from trainyard_api.audit import outcome_of
from trainyard_api.auth import ForbiddenError, authenticate, require
from trainyard_api.context import ApiContext, context_of
from trainyard_api.roles import Right
from trainyard_api.validation import strict_body_errors

_bearer = HTTPBearer(
    auto_error=False,
    description="an API token; the local stack writes one to `.trainyard/dev-token`",
)


async def authenticated(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> TenantToken:
    """The request's token, checked against the store (401 when missing, unknown, revoked or expired)."""
    header = f"Bearer {credentials.credentials}" if credentials else request.headers.get("authorization")
    return await authenticate(context_of(request).store, header)


_TARGET_PARTS = (("tenant", "tenant"), ("token_id", "token"), ("job_id", "job"), ("node_id", "node"),
                 ("archive", "code"), ("trigger_id", "trigger"), ("artifact_id", "artifact"))


def _audit_target(request: Request) -> str:
    """What a request acts on, from its path (``tenant/a/token/tok_…``); a route may set a better one."""
    chosen = getattr(request.state, "audit_target", None)
    if chosen:
        return str(chosen)
    params = request.path_params
    return "/".join(f"{word}/{params[name]}" for name, word in _TARGET_PARTS if name in params) or request.url.path


def may(right: Right, action: str | None = None, *, platform: bool = False) -> Any:
    """A dependency: the request's token when it has ``right`` on the path's ``{tenant}`` (else its own
    tenant); 403 naming the role needed otherwise. With ``action``, the request is written to the audit log
    with its outcome (also when refused for its role): the target's tenant, or none for ``platform`` actions."""

    async def check(request: Request,
                    token: Annotated[TenantToken, Depends(authenticated)]) -> AsyncIterator[TenantToken]:
        path_tenant = request.path_params.get("tenant")
        audit = context_of(request).audit if action else None

        async def note(outcome: Any, detail: str | None) -> None:
            if audit is not None and action is not None:
                tenant = getattr(request.state, "audit_tenant", None) or path_tenant or (
                    None if platform else token.tenant)
                await audit.record(token, action, _audit_target(request), tenant=tenant, outcome=outcome,
                                   detail=detail)

        try:
            require(token, right, path_tenant)
        except ForbiddenError as exc:
            await note("denied", exc.message)
            raise
        try:
            yield token
        except Exception as exc:
            await note(outcome_of(exc), getattr(exc, "message", None) or str(exc) or type(exc).__name__)
            raise
        await note("ok", getattr(request.state, "audit_detail", None))

    return Depends(check)


def is_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/…+json``, with any parameters (what FastAPI parses as JSON)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def strict_body(model: type[BaseModel], auth: Any = None) -> Any:
    """A dependency holding the body to JSON (415 otherwise) of the types of ``model`` (see
    :func:`strict_body_errors`), after authentication (``auth``: the route's own dependency, so a refused
    role is a 403 before any 422) and ahead of FastAPI's own, lax, validation."""
    adapter = TypeAdapter(model)
    auth = auth if auth is not None else Depends(authenticated)

    async def validate(request: Request, _: TenantToken) -> None:
        body = await request.body()
        if body and not is_json(request.headers.get("content-type")):
            raise StarletteHTTPException(415, "the body must be JSON: send Content-Type: application/json")
        if errors := strict_body_errors(adapter, body):
            raise RequestValidationError(errors)

    validate.__annotations__["_"] = Annotated[TenantToken, auth]  # a local: not resolvable from a string
    return Depends(validate)


async def one_value_per_query_parameter(request: Request) -> None:
    """Every query parameter of this API takes one value: a repeated one is a 422, not its last value
    (other query parameters are ignored, repeated or not)."""
    route = request.scope.get("route")
    declared = {param.alias for param in route.dependant.query_params} if isinstance(route, APIRoute) else set()
    keys = [key for key, _ in request.query_params.multi_items() if key in declared]
    if repeated := sorted({key for key in keys if keys.count(key) > 1}):
        raise RequestValidationError([{"type": "value_error", "loc": ("query", key),
                                       "msg": "given more than once; it takes one value"} for key in repeated])


Ctx = Annotated[ApiContext, Depends(context_of)]
Tenant = Annotated[TenantToken, may(Right.READ)]
"""Any active token: reads of its own tenant's jobs, artifacts, datasets, plans, code."""
Admin = Annotated[TenantToken, may(Right.NODES)]
"""A platform-admin token (the nodes right)."""
JobId = Annotated[str, Path(max_length=128, description="job id, `job-` + 12 hex",
                             examples=["job-3f2a9c1b7e4d"])]
