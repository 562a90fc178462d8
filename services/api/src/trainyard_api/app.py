"""The FastAPI application: routes, auth, error mapping, OpenAPI text.

``create_app(context)`` builds the app over an :class:`ApiContext` (Redis-backed store,
outbox, bus); the process wiring (uvicorn next to a ServiceRuntime) lives in ``server.py``.
Errors from ``trainyard_common.errors`` map to HTTP: SpecError 422 (with every bad field),
AuthError 401 (its ForbiddenError, a role without the right: 403), NotFoundError 404, ConflictError
409, InfrastructureError and a Redis that cannot serve 503; anything else is a 500. Every route documents each status it can answer, with its body.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cached_property
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, Header, Path, Query, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, BeforeValidator, TypeAdapter
from redis import exceptions as redis_errors
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.convertors import Convertor, register_url_convertor
from starlette.routing import Match, Route

from trainyard_common import contract
from trainyard_common.bus import Bus
from trainyard_common.errors import (
    AuthError,
    ConflictError,
    InfrastructureError,
    NotFoundError,
    SpecError,
    TrainyardError,
)
from trainyard_common.events import JobState
from trainyard_common.outbox import Outbox
from trainyard_common.records import TenantToken
from trainyard_common.spec import ARCHIVE_PATTERN, DATASET_REF_PATTERN
from trainyard_common.storage import ArtifactLayout
from trainyard_common.store import StateStore
from trainyard_common.tracing import current_traceparent

from trainyard_api.accounting import GoodputAccountant
from trainyard_api.admin import AdminService
from trainyard_api.audit import AuditLog, outcome_of
from trainyard_api.auth import ForbiddenError, authenticate, require
from trainyard_api.bodies import (
    TENANT_PATTERN,
    DatasetPublishBody,
    ExportBody,
    SubmittedSpec,
    TenantCreateBody,
    TenantSettingsBody,
    TokenCreateBody,
    TriggerCreateBody,
)
from trainyard_api.calibration import CalibrationReport, report
from trainyard_api.calibrator import CalibrationStore
from trainyard_api.code import ArchiveTooLargeError, CodeService, CodeStore, GitSource, too_large_message
from trainyard_api.dashboard import install_dashboard
from trainyard_api.datasets import DatasetService
from trainyard_api.exports import ExportService
from trainyard_api.goodput_history import intervals
from trainyard_api.jobs import JobService
from trainyard_api.lab import install_lab_routes
from trainyard_api.roles import Right, may_grant, rights
from trainyard_api.planning import PLAN_EXAMPLES, PlanRequest, PlanResponse, device_type_of, plan
from trainyard_api.schemas import (
    EXAMPLE_SPEC,
    EXAMPLE_TEMPLATE,
    ArtifactList,
    ArtifactView,
    AuditPage,
    CheckpointList,
    CodeArchiveView,
    ControlResponse,
    DatasetList,
    DatasetPublished,
    DatasetView,
    DrainResponse,
    ErrorMessage,
    FieldErrors,
    Health,
    GoodputHistory,
    GoodputIntervalView,
    GoodputReport,
    IssuedToken,
    JobPage,
    JobView,
    NodeList,
    ReinstateResponse,
    SubmitResponse,
    TenantList,
    TenantView,
    TokenList,
    TokenView,
    TriggerList,
    TriggerView,
    WhoAmI,
)
from trainyard_api.settings import ApiSettings
from trainyard_api.telemetry import TelemetryMiddleware
from trainyard_api.validation import FieldProblem, InvalidSpecError, field_errors, strict_body_errors
from trainyard_api.steptiming import StepTimingStore
from trainyard_api.tenants import TenantService
from trainyard_api.triggers import TriggerService, TriggerStore
from trainyard_api.views import checkpoint_view, goodput_interval_view, goodput_view

log = logging.getLogger(__name__)

REDIS_OUTAGES = (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ReadOnlyError,
                 redis_errors.TryAgainError, redis_errors.ClusterDownError, redis_errors.OutOfMemoryError)
"""Redis errors that mean the store cannot serve now (503, retry); any other is a refused command (500)."""

DESCRIPTION = """\
Submit, watch and control LLM training jobs on trainyard.

* A job is an immutable **TrainingSpec** (camelCase JSON, see `examples/tiny.yaml`).
  `POST /v1/training-jobs` validates it, stores it and answers `202` with the job id and
  the spec hash (sha256 of the canonical JSON, defaults filled in). A new configuration
  is a new job: there is no PATCH.
* Every route except `/healthz` and `/metrics` needs `Authorization: Bearer <token>`. The events trainyard
  publishes and consumes are described by `/v1/asyncapi.yaml` (and `.json`, AsyncAPI 3.0; no token either).
  A tenant sees only its own jobs, checkpoints and artifacts. The local stack (`make up`)
  writes a development token to `.trainyard/dev-token`.
* A token has a role: `viewer` (read the tenant's jobs, artifacts, metrics, triggers), `submitter` (+ submit,
  pause, resume, cancel, upload code, create and delete triggers), `tenant-admin` (+ the tenant's tokens and
  audit log), `platform-admin` (everything, every tenant: tenants, quotas, nodes). A token that is unknown, revoked or expired gets `401`
  saying which; a role without the right (or another tenant's resource) gets `403` naming the role needed.
  See docs/tenants.md.
* Invalid input is a `422` whose `detail` lists every bad field by its dotted camelCase
  path, e.g. `{"detail": [{"field": "training.globalBatchSize", "message": "…"}]}`; query and
  path parameters keep their source (`query.limit`). Bodies are JSON with the types this document
  gives (`0` is not `false`, `"5"` is not `5`).
* `503` (with `Retry-After`) means the state store is unavailable, nothing else.
* `OPTIONS` on a path answers `204` with `Allow` listing its methods; a method the path does not
  have answers `405` with the same `Allow`.
"""

TAGS = [
    {"name": "jobs", "description": "Submit training jobs, follow their progress, cancel, pause and resume them."},
    {"name": "triggers", "description": "Data lands, training starts: a trigger submits a job from its template "
                                        "for each new verified version of a dataset whose name matches (see "
                                        "docs/triggers.md)."},
    {"name": "registry", "description": "Artifacts (READY checkpoints, final models, exports) with their lineage; "
                                        "exporting a checkpoint as a Hugging Face model directory."},
    {"name": "datasets", "description": "Dataset versions published to the registry (`name@version`)."},
    {"name": "code", "description": "Users' training code, pinned by content: `.tar.gz` archives named by their "
                                  "sha256 (`trainyard submit --code DIR` uploads them); a job names one in "
                                  "`code.archive`, or gives `code.repo` + `code.revision`."},
    {"name": "planning", "description": "Capacity planning: memory per device, step time, communication, "
                                        "pipeline bubble, checkpoint interval, ranked layouts; calibrated per "
                                        "device type by what the platform measured."},
    {"name": "lab", "description": "The dashboard's Lab on the planner's own numbers: memory per device against "
                                   "model size, scaling across nodes against interconnect bandwidth, the "
                                   "checkpoint interval's redo against overhead."},
    {"name": "goodput", "description": "Allocated vs productive vs wasted device-time (lost work, launch and "
                                       "restore, checkpoint stalls, hangs, idle), per tenant."},
    {"name": "admin", "description": "Administration: tenants (quotas, priority), their tokens (roles, expiry, "
                                     "revocation), the audit log; node inventory, quarantine, drain and "
                                     "reputation (platform-admin)."},
    {"name": "operations", "description": "Health and Prometheus metrics (including "
                                          "`trainyard_goodput_device_seconds{tenant,kind}`); no authentication."},
]

Responses = dict[int | str, dict[str, Any]]


def _error(status: int, description: str, *, model: type[Any] = ErrorMessage,
           headers: dict[str, str] | None = None) -> Responses:
    """One documented error response; ``headers``: name → description of headers it always carries."""
    doc: dict[str, Any] = {"model": model, "description": description}
    if headers:
        doc["headers"] = {name: {"description": text, "required": True, "schema": {"type": "string"}}
                          for name, text in headers.items()}
    return {status: doc}


def _invalid(description: str = "invalid parameters, each named by field (`query.limit`, `path.jobId`)"
             ) -> Responses:
    return _error(422, description, model=FieldErrors)


_NOT_JSON = _error(415, "the body is not sent as `application/json`")
_UNAUTHORIZED = _error(401, "missing, malformed, unknown, revoked or expired bearer token",
                       headers={"WWW-Authenticate": "`Bearer`"})
_UNAVAILABLE = _error(503, "the state store (Redis) is unavailable; retry", headers={"Retry-After": "seconds"})
_FORBIDDEN = _error(403, "the token's role lacks the right (the message names the role needed)")
_AUTH_ERRORS: Responses = {**_UNAUTHORIZED, **_FORBIDDEN, **_UNAVAILABLE}
_JOB_ERRORS: Responses = {**_AUTH_ERRORS, **_error(404, "no such job for this tenant"), **_invalid()}
_ADMIN_ERRORS: Responses = {**_UNAUTHORIZED, **_UNAVAILABLE,
                            **_error(403, "not a platform-admin token (or not one of this tenant's admins)")}
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_ARTIFACT_ID = rf"{_NAME}/(?:(?:checkpoint|model)/{_NAME}|export/{_NAME}/{_NAME})"
_EXPORT_ID = rf"{_NAME}/export/{_NAME}/{_NAME}"
ARTIFACT_ID_PATTERN = rf"^{_ARTIFACT_ID}$"
"""An artifact id: ``<job>/checkpoint|model/<name>``, an export's ``<job>/export/<checkpoint>/<format>``."""
EXPORT_ID_PATTERN = rf"^{_EXPORT_ID}$"


class _IdConvertor(Convertor[str]):
    """A path parameter holding an id with slashes, and nothing more: ``…/{id}/export`` and
    ``…/{id}/files/{name}`` are then never also a plain ``GET …/{id}``."""

    def __init__(self, regex: str) -> None:
        self.regex = regex

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("artifact", _IdConvertor(_ARTIFACT_ID))
register_url_convertor("export", _IdConvertor(_EXPORT_ID))
MAX_OFFSET = 2**31 - 1
"""Largest list offset or page size a client may send (a page past the end is empty)."""


@dataclass
class ApiContext:
    """What the routes need from the process: state, the outbox, the bus (for health), and the services
    over them — each built once, on first use (none keeps per-request state)."""

    settings: ApiSettings
    store: StateStore
    outbox: Outbox
    bus: Bus | None = None

    @cached_property
    def jobs(self) -> JobService:
        return JobService(self.store, self.outbox, max_attempts=self.settings.api_max_attempts, code=self.code,
                          layout=ArtifactLayout(self.settings.artifact_root_abs))

    @cached_property
    def triggers(self) -> TriggerService:
        return TriggerService(TriggerStore(self.store.redis), self.jobs)

    @cached_property
    def code(self) -> CodeService:
        """Code archives under the artifact root, and git for ``code.repo``."""
        s = self.settings
        return CodeService(CodeStore(ArtifactLayout(s.artifact_root_abs), max_bytes=s.api_max_code_bytes),
                           GitSource(timeout_s=s.api_git_timeout_s, max_bytes=s.api_max_code_bytes,
                                     local_repos=s.api_git_local_repos))

    @cached_property
    def datasets(self) -> DatasetService:
        return DatasetService(self.store, self.outbox, ArtifactLayout(self.settings.artifact_root_abs))

    @cached_property
    def exports(self) -> ExportService:
        return ExportService(self.store, self.outbox, ArtifactLayout(self.settings.artifact_root_abs))

    @cached_property
    def admin(self) -> AdminService:
        return AdminService(self.store, self.outbox)

    @cached_property
    def tenants(self) -> TenantService:
        return TenantService(self.store)

    @cached_property
    def audit(self) -> AuditLog:
        return AuditLog(self.store.redis, max_entries=self.settings.api_audit_max_entries)

    @cached_property
    def accounting(self) -> GoodputAccountant:
        s = self.settings
        return GoodputAccountant(self.store, StepTimingStore(self.store.redis),
                                 history_bucket_s=s.goodput_history_bucket_s,
                                 history_retention_s=s.goodput_history_retention_s)

    @cached_property
    def calibrations(self) -> CalibrationStore:
        """The planner's calibration samples and fit (written by the Calibrator of ``server.py``)."""
        return CalibrationStore(self.store.redis, max_samples=self.settings.calibration_max_samples)


def _context(request: Request) -> ApiContext:
    return request.app.state.context  # type: ignore[no-any-return]


_bearer = HTTPBearer(
    auto_error=False,
    description="an API token; the local stack writes one to `.trainyard/dev-token`",
)


async def _tenant(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> TenantToken:
    header = f"Bearer {credentials.credentials}" if credentials else request.headers.get("authorization")
    return await authenticate(_context(request).store, header)


_TARGET_PARTS = (("tenant", "tenant"), ("token_id", "token"), ("job_id", "job"), ("node_id", "node"),
                 ("archive", "code"), ("trigger_id", "trigger"), ("artifact_id", "artifact"))


def _audit_target(request: Request) -> str:
    """What a request acts on, from its path (``tenant/a/token/tok_…``); a route may set a better one."""
    chosen = getattr(request.state, "audit_target", None)
    if chosen:
        return str(chosen)
    params = request.path_params
    return "/".join(f"{word}/{params[name]}" for name, word in _TARGET_PARTS if name in params) or request.url.path


def _may(right: Right, action: str | None = None, *, platform: bool = False) -> Any:
    """A dependency: the request's token when it has ``right`` on the path's ``{tenant}`` (else its own
    tenant); 403 naming the role needed otherwise. With ``action``, the request is written to the audit log
    with its outcome (also when refused for its role): the target's tenant, or none for ``platform`` actions."""

    async def check(request: Request, token: Annotated[TenantToken, Depends(_tenant)]) -> AsyncIterator[TenantToken]:
        path_tenant = request.path_params.get("tenant")
        audit = _context(request).audit if action else None

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


def _strict_body(model: type[BaseModel], auth: Any = None) -> Any:
    """A dependency holding the body to JSON (415 otherwise) of the types of ``model`` (see
    :func:`strict_body_errors`), after authentication (``auth``: the route's own dependency, so a refused
    role is a 403 before any 422) and ahead of FastAPI's own, lax, validation."""
    adapter = TypeAdapter(model)
    auth = auth if auth is not None else Depends(_tenant)

    async def validate(request: Request, _: TenantToken) -> None:
        body = await request.body()
        if body and not is_json(request.headers.get("content-type")):
            raise StarletteHTTPException(415, "the body must be JSON: send Content-Type: application/json")
        if errors := strict_body_errors(adapter, body):
            raise RequestValidationError(errors)

    validate.__annotations__["_"] = Annotated[TenantToken, auth]  # a local: not resolvable from a string
    return Depends(validate)


async def _one_value_per_query_parameter(request: Request) -> None:
    """Every query parameter of this API takes one value: a repeated one is a 422, not its last value
    (other query parameters are ignored, repeated or not)."""
    route = request.scope.get("route")
    declared = {param.alias for param in route.dependant.query_params} if isinstance(route, APIRoute) else set()
    keys = [key for key, _ in request.query_params.multi_items() if key in declared]
    if repeated := sorted({key for key in keys if keys.count(key) > 1}):
        raise RequestValidationError([{"type": "value_error", "loc": ("query", key),
                                       "msg": "given more than once; it takes one value"} for key in repeated])


Ctx = Annotated[ApiContext, Depends(_context)]
Tenant = Annotated[TenantToken, _may(Right.READ)]
"""Any active token: reads of its own tenant's jobs, artifacts, datasets, plans, code."""
Admin = Annotated[TenantToken, _may(Right.NODES)]
_SUBMIT = _may(Right.SUBMIT, "job.submit")
_UPLOAD = _may(Right.SUBMIT, "code.upload")
_TRIGGER_CREATE = _may(Right.SUBMIT, "trigger.create")
_PUBLISH = _may(Right.SUBMIT, "dataset.publish")
_EXPORT = _may(Right.SUBMIT, "artifact.export")
_TENANT_CREATE = _may(Right.MANAGE_TENANTS, "tenant.create")
_TENANT_UPDATE = _may(Right.MANAGE_TENANTS, "tenant.update")
_TOKEN_CREATE = _may(Right.MANAGE_TOKENS, "token.create")
# route parameters' annotations are strings (``from __future__ import annotations``) resolved in this
# module's namespace: every dependency a route names in its signature is a module-level name
Submitter = Annotated[TenantToken, _SUBMIT]
Uploader = Annotated[TenantToken, _UPLOAD]
TriggerCreator = Annotated[TenantToken, _TRIGGER_CREATE]
TriggerDeleter = Annotated[TenantToken, _may(Right.SUBMIT, "trigger.delete")]
TriggerId = Annotated[str, Path(pattern=r"^trg-[0-9a-f]{12}$", description="the trigger's id, `trg-` + 12 hex",
                                examples=["trg-5c1d9e0a7b2f"])]
Publisher = Annotated[TenantToken, _PUBLISH]
NodeReinstater = Annotated[TenantToken, _may(Right.NODES, "node.reinstate", platform=True)]
NodeDrainer = Annotated[TenantToken, _may(Right.NODES, "node.drain", platform=True)]
NodeUndrainer = Annotated[TenantToken, _may(Right.NODES, "node.undrain", platform=True)]
TenantCreator = Annotated[TenantToken, _TENANT_CREATE]
TenantUpdater = Annotated[TenantToken, _TENANT_UPDATE]
TenantDeleter = Annotated[TenantToken, _may(Right.MANAGE_TENANTS, "tenant.delete")]
TenantManager = Annotated[TenantToken, _may(Right.MANAGE_TENANTS)]
TenantReader = Annotated[TenantToken, _may(Right.READ_TENANT)]
TokenCreator = Annotated[TenantToken, _TOKEN_CREATE]
TokenRevoker = Annotated[TenantToken, _may(Right.MANAGE_TOKENS, "token.revoke")]
TokenManager = Annotated[TenantToken, _may(Right.MANAGE_TOKENS)]
AuditReader = Annotated[TenantToken, _may(Right.READ_AUDIT)]
_CONTROLLERS = {action: Annotated[TenantToken, _may(Right.CONTROL, f"job.{action}")]
                for action in ("cancel", "pause", "resume")}
NodeId = Annotated[str, Path(max_length=128, description="the node id", examples=["node-a"])]
DrainReason = Annotated[str | None, Query(max_length=500, description="why (shown to the jobs that wait)")]
JobId = Annotated[str, Path(max_length=128, description="job id, `job-` + 12 hex",
                             examples=["job-3f2a9c1b7e4d"])]
ExportRequester = Annotated[TenantToken, _EXPORT]
ArtifactId = Annotated[str, Path(min_length=1, max_length=512, pattern=ARTIFACT_ID_PATTERN,
                                 description="`<job>/<kind>/<name>` (see GET /v1/registry/artifacts?jobId=)",
                                 examples=["job-3f2a9c1b7e4d/checkpoint/step-000000040-a1"])]
ExportId = Annotated[str, Path(min_length=1, max_length=512, pattern=EXPORT_ID_PATTERN,
                               description="an export's id, `<job>/export/<checkpoint>/<format>`",
                               examples=["job-3f2a9c1b7e4d/export/step-000000040-a1/hf"])]
ExportFileName = Annotated[str, Path(max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                     description="a file the export's listing names",
                                     examples=["model.safetensors"])]


# ----------------------------------------------------------------------------- errors


def _install_error_handlers(app: FastAPI) -> None:
    def _message(status: int, exc: TrainyardError, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=status, headers=headers)

    def _problems(problems: list[FieldProblem]) -> JSONResponse:
        return JSONResponse({"detail": [p.as_dict() for p in problems]}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _problems(field_errors(exc.errors()))

    @app.exception_handler(ArchiveTooLargeError)
    async def _too_large(_: Request, exc: ArchiveTooLargeError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=413)

    @app.exception_handler(SpecError)
    async def _spec(_: Request, exc: SpecError) -> JSONResponse:
        problems = exc.problems if isinstance(exc, InvalidSpecError) else None
        return _problems(problems or [FieldProblem(exc.field, exc.detail)])

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
            # FastAPI answers 400 when a JSON body is not UTF-8; it is as invalid as unparsable JSON
            return _problems([FieldProblem("body", f"the body is not valid JSON: it is not UTF-8 ({exc.__cause__})")])
        if exc.status_code == 405:
            return method_not_allowed(request)
        return await http_exception_handler(request, exc)

    @app.exception_handler(ForbiddenError)
    async def _forbidden(_: Request, exc: ForbiddenError) -> JSONResponse:
        return _message(403, exc)

    @app.exception_handler(AuthError)
    async def _auth(_: Request, exc: AuthError) -> JSONResponse:
        return _message(401, exc, {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(NotFoundError)
    async def _not_found(_: Request, exc: NotFoundError) -> JSONResponse:
        return _message(404, exc)

    @app.exception_handler(ConflictError)
    async def _conflict(_: Request, exc: ConflictError) -> JSONResponse:
        return _message(409, exc)

    @app.exception_handler(TrainyardError)
    async def _other(_: Request, exc: TrainyardError) -> JSONResponse:
        if exc.retryable or isinstance(exc, InfrastructureError):
            log.warning("request failed: %r", exc)
            return _message(503, exc, {"Retry-After": "1"})
        # every error a client can cause has its own status above: this one is ours
        log.error("request failed", exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)

    @app.exception_handler(RedisError)
    async def _redis(_: Request, exc: RedisError) -> JSONResponse:
        if isinstance(exc, REDIS_OUTAGES):
            log.warning("redis unavailable: %r", exc)
            return JSONResponse({"detail": "the state store (Redis) is unavailable; retry shortly"},
                                status_code=503, headers={"Retry-After": "1"})
        # Redis answered, and refused the command: a bug of ours, not an outage to retry
        log.error("redis refused a command", exc_info=exc)
        return JSONResponse({"detail": "internal error"}, status_code=500)


def is_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/…+json``, with any parameters (what FastAPI parses as JSON)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def method_not_allowed(request: Request) -> Response:
    """OPTIONS on a route's path: 204 with every method of the path in ``Allow``; any other method the
    path does not have: 405 with the same ``Allow`` (Starlette's own lists only the first route's)."""
    methods: set[str] = {"OPTIONS"}
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    allow = ", ".join(sorted(methods))
    if request.method == "OPTIONS":
        return Response(status_code=204, headers={"Allow": allow})
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": allow})


# ----------------------------------------------------------------------------- routes


def _install_job_routes(app: FastAPI) -> None:
    @app.post(
        "/v1/training-jobs", status_code=202, response_model=SubmitResponse,
        dependencies=[_strict_body(SubmittedSpec, _SUBMIT)],
        tags=["jobs"], summary="Submit a training job",
        responses={
            202: {"headers": {
                "Location": {"description": "the job's URL", "required": True, "schema": {"type": "string"}},
                "Idempotent-Replayed": {"description": "`true` when an Idempotency-Key found an earlier job",
                                        "schema": {"type": "string", "enum": ["true"]}}}},
            **_AUTH_ERRORS,
            **_NOT_JSON,
            **_error(409, "Idempotency-Key reused with a different spec"),
            **_invalid("an invalid spec (or a body that is not JSON), each problem named by field; also a valid "
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

    @app.get("/v1/training-jobs", response_model=JobPage, tags=["jobs"], summary="List the tenant's jobs",
             responses={**_AUTH_ERRORS, **_invalid()})
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

    @app.get("/v1/training-jobs/{job_id}", response_model=JobView, tags=["jobs"], summary="Get a job",
             responses=_JOB_ERRORS)
    async def get_job(ctx: Ctx, tenant: Tenant, job_id: JobId) -> JobView:
        """State, attempts (with placement score and detail), progress (global step, tokens, last loss,
        tokens/s), checkpoints (READY, FAILED with the reason — also a checkpoint refused at restore —
        and DELETED by retention, with write time), while queued why it waits (`queuedReason`,
        `queuedReasonKind`), the coordinator's `checkpointAdvice` (Young/Daly interval, method, inputs),
        the `goodput` ledger, each rank's latest timing breakdown (`rankTiming`: compute, collective,
        data-wait, checkpoint seconds, MFU) and `stragglers`."""
        return await ctx.jobs.view(tenant, job_id)

    @app.get("/v1/training-jobs/{job_id}/checkpoints", response_model=CheckpointList, tags=["jobs"],
             summary="List a job's checkpoints", responses=_JOB_ERRORS)
    async def list_checkpoints(ctx: Ctx, tenant: Tenant, job_id: JobId) -> CheckpointList:
        """Oldest first; a checkpoint is usable only when `state` is READY (every shard verified)."""
        records = await ctx.jobs.checkpoints(tenant, job_id)
        return CheckpointList(job_id=job_id, checkpoints=[checkpoint_view(c) for c in records])

    for action, doc in (
        ("cancel", "Stop the job; it ends `cancelled`. A finished job answers 409."),
        ("pause", "Pause the job: the scheduler asks its ranks for a checkpoint (CheckpointRequested), "
                  "waits for it to become READY, then releases the gang; the job is `paused` and holds no "
                  "devices. A queued job is paused at once. Published as a JobControlRequested event."),
        ("resume", "Resume a paused job: it queues again and its next attempt starts from the latest READY "
                   "checkpoint (the one the pause wrote)."),
    ):
        _add_control_route(app, action, doc)


def _add_control_route(app: FastAPI, action: Literal["cancel", "pause", "resume"], doc: str) -> None:
    async def control(ctx: Ctx, tenant: TenantToken, job_id: JobId) -> ControlResponse:
        return await ctx.jobs.control(tenant, job_id, action)

    control.__annotations__["tenant"] = _CONTROLLERS[action]  # per action: not a module-level name

    control.__doc__ = doc + " Answers 202 with the job's state at the time of the request."
    app.post(
        f"/v1/training-jobs/{{job_id}}/{action}", status_code=202, response_model=ControlResponse,
        tags=["jobs"], summary=f"{action.capitalize()} a job", name=f"{action}_job",
        responses={**_JOB_ERRORS, **_error(409, "not allowed in the job's state")},
    )(control)


def _install_plan_routes(app: FastAPI) -> None:
    @app.post(
        "/v1/plan", response_model=PlanResponse, tags=["planning"], dependencies=[_strict_body(PlanRequest)],
        summary="Plan capacity for a model on a set of devices",
        responses={**_AUTH_ERRORS, **_NOT_JSON, **_invalid(
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

    @app.get(
        "/v1/plan/calibration", response_model=CalibrationReport, tags=["planning"],
        summary="The planner's calibration per device type: factors, and predicted vs measured",
        responses={**_AUTH_ERRORS, **_invalid()},
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


_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _rfc3339(value: object) -> object:
    """A query instant as the document promises it (format date-time): pydantic alone would also take epoch
    numbers and naive times."""
    if isinstance(value, str) and not _RFC3339.fullmatch(value):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time with an offset, e.g. 2026-12-01T00:00:00Z")
    return value


Instant = Annotated[datetime, BeforeValidator(_rfc3339)]


def _install_goodput_and_admin_routes(app: FastAPI) -> None:
    @app.get("/v1/goodput", response_model=GoodputReport, tags=["goodput"],
             summary="The tenant's goodput ledger",
             responses={**_AUTH_ERRORS, **_invalid()})
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

    @app.get("/v1/goodput/history", response_model=GoodputHistory, tags=["goodput"],
             summary="The tenant's goodput over time",
             responses={**_AUTH_ERRORS, **_invalid()})
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
        (default 300 s; the latest sample of a bucket wins); an interval runs from one sampled bucket
        start to the next, so a gap while no API ran is one long interval. Samples are kept for
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

    @app.get("/v1/admin/nodes", response_model=NodeList, tags=["admin"], summary="List nodes",
             responses=_ADMIN_ERRORS)
    async def list_nodes(ctx: Ctx, _: Admin) -> NodeList:
        """Every node the scheduler knows: devices, rack, NVLink domain, network tier, health, last
        heartbeat, quarantine (reason, by, score, until) and the decaying reputation score (null
        when none is recorded)."""
        return NodeList(nodes=await ctx.admin.nodes())

    @app.post("/v1/admin/nodes/{node_id}/reinstate", status_code=202, response_model=ReinstateResponse,
              tags=["admin"], summary="Reinstate a quarantined node",
              responses={**_ADMIN_ERRORS, **_error(404, "no such node"), **_invalid()})
    async def reinstate_node(
        ctx: Ctx, admin: NodeReinstater,
        node_id: Annotated[str, Path(max_length=128, description="the node id", examples=["node-a"])],
    ) -> ReinstateResponse:
        """Publish NodeReinstated (`by` = the admin token's name); the scheduler clears the
        quarantine and places on the node again."""
        return await ctx.admin.reinstate(admin, node_id)

    @app.post("/v1/admin/nodes/{node_id}/drain", status_code=202, response_model=DrainResponse,
              tags=["admin"], summary="Drain a node (maintenance)",
              responses={**_ADMIN_ERRORS, **_error(404, "no such node"), **_invalid()})
    async def drain_node(ctx: Ctx, admin: NodeDrainer,
                         node_id: NodeId, reason: DrainReason = None) -> DrainResponse:
        """Publish NodeDrained (`by` = the admin token's name): nothing new is placed on the node, and
        the attempts running there checkpoint at an agreed step and stop, interrupted by maintenance
        (no failure budget spent, nobody blamed); they resume from that checkpoint elsewhere, or there
        after an undrain or a restart of its node agent."""
        return await ctx.admin.drain(admin, node_id, reason)

    @app.post("/v1/admin/nodes/{node_id}/undrain", status_code=202, response_model=DrainResponse,
              tags=["admin"], summary="Undrain a node",
              responses={**_ADMIN_ERRORS, **_error(404, "no such node"), **_invalid()})
    async def undrain_node(ctx: Ctx, admin: NodeUndrainer,
                           node_id: NodeId, reason: DrainReason = None) -> DrainResponse:
        """Publish NodeUndrained: the node takes new work again."""
        return await ctx.admin.undrain(admin, node_id, reason)


ArchiveId = Annotated[str, Path(pattern=ARCHIVE_PATTERN, description="`sha256:` + the 64-hex sha256 of the archive",
                               examples=["sha256:" + "0" * 64])]
GZIP = "application/gzip"


async def _body_within(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ArchiveTooLargeError("body", too_large_message(int(declared), limit))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ArchiveTooLargeError("body", too_large_message(size, limit))
        chunks.append(chunk)
    return b"".join(chunks)


def _install_code_routes(app: FastAPI) -> None:
    @app.put(
        "/v1/code/{archive}", response_model=CodeArchiveView, tags=["code"], summary="Upload a code archive",
        openapi_extra={"requestBody": {"required": True, "description": "the archive's bytes (`.tar.gz`)",
                                       "content": {GZIP: {"schema": {"type": "string", "format": "binary"}}}}},
        responses={
            200: {"description": "already stored (nothing changed)"},
            201: {"model": CodeArchiveView, "description": "stored"},
            **_AUTH_ERRORS,
            **_error(413, "the archive is over the API's limit (`TRAINYARD_API_MAX_CODE_BYTES`)"),
            **_error(415, f"the body is not sent as `{GZIP}`"),
            **_invalid("the body's sha256 is not the one the path names (`path.archive`), or the body is not a "
                       "code archive the platform will unpack (`body`: a path outside the tree, a device, …)"),
        },
    )
    async def put_code(ctx: Ctx, tenant: Uploader, request: Request, response: Response,
                       archive: ArchiveId) -> CodeArchiveView:
        """Store the tenant's code archive (what `trainyard submit --code DIR` packs): a deterministic
        `.tar.gz` named by the sha256 of its bytes. The API checks the hash, the size and that it unpacks
        safely; a job names it in `code.archive`. Uploading an archive again answers 200 and changes
        nothing."""
        media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
        if media != GZIP:
            raise StarletteHTTPException(415, f"send the archive as Content-Type: {GZIP}")
        data = await _body_within(request, ctx.settings.api_max_code_bytes)
        info, created = await ctx.code.upload(tenant.tenant, archive, data)
        response.status_code = 201 if created else 200
        return CodeArchiveView(archive=info.archive, size=info.size, files=info.files, uploaded_at=info.uploaded_at)

    @app.get("/v1/code/{archive}", response_model=CodeArchiveView, tags=["code"],
             summary="Get a code archive's metadata",
             responses={**_AUTH_ERRORS, **_error(404, "not uploaded for this tenant"), **_invalid()})
    async def get_code(ctx: Ctx, tenant: Tenant, archive: ArchiveId) -> CodeArchiveView:
        """Size, number of files and upload time of one of the tenant's archives (404: upload it)."""
        info = await ctx.code.info(tenant.tenant, archive)
        return CodeArchiveView(archive=info.archive, size=info.size, files=info.files, uploaded_at=info.uploaded_at)


_NO_TRIGGER = _error(404, "no such trigger for this tenant")


def _install_trigger_routes(app: FastAPI) -> None:
    @app.post(
        "/v1/triggers", status_code=201, response_model=TriggerView, tags=["triggers"], summary="Create a trigger",
        dependencies=[_strict_body(TriggerCreateBody, _TRIGGER_CREATE)],
        responses={**_AUTH_ERRORS, **_NOT_JSON, **_error(409, "the tenant has a trigger of that name already"),
                   **_invalid("an invalid body, each problem named by field; the template is checked as "
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

    @app.get("/v1/triggers", response_model=TriggerList, tags=["triggers"], summary="List the tenant's triggers",
             responses=_AUTH_ERRORS)
    async def list_triggers(ctx: Ctx, tenant: Tenant) -> TriggerList:
        """Oldest first, each with its last failure (null when none)."""
        return await ctx.triggers.list(tenant)

    @app.get("/v1/triggers/{trigger_id}", response_model=TriggerView, tags=["triggers"], summary="Get a trigger",
             responses={**_AUTH_ERRORS, **_NO_TRIGGER, **_invalid()})
    async def get_trigger(ctx: Ctx, tenant: Tenant, trigger_id: TriggerId) -> TriggerView:
        """The trigger, the jobs it started (one per dataset version) and the last version it could not
        submit a job for, with why (`lastFailure`: e.g. a template the model catalog no longer takes)."""
        return await ctx.triggers.get(tenant, trigger_id)

    @app.delete("/v1/triggers/{trigger_id}", response_model=TriggerView, tags=["triggers"],
                summary="Delete a trigger", responses={**_AUTH_ERRORS, **_NO_TRIGGER, **_invalid()})
    async def delete_trigger(ctx: Ctx, tenant: TriggerDeleter, trigger_id: TriggerId) -> TriggerView:
        """New dataset versions start nothing more; the jobs it started stay. Answers the trigger as it was.
        Submitter or above."""
        return await ctx.triggers.delete(tenant, trigger_id)


TenantName = Annotated[str, Path(pattern=TENANT_PATTERN, max_length=63, description="the tenant",
                                 examples=["research"])]
TokenId = Annotated[str, Path(pattern=r"^tok_[0-9a-f]{12}$", description="the token's id (never its secret)",
                              examples=["tok_3f2a9c1b7e4d"])]
_NO_TENANT = _error(404, "no such tenant")


def _install_tenant_routes(app: FastAPI) -> None:
    admin_errors = {**_ADMIN_ERRORS, **_invalid()}

    @app.post("/v1/admin/tenants", status_code=201, response_model=TenantView, tags=["admin"],
              summary="Create a tenant", dependencies=[_strict_body(TenantCreateBody, _TENANT_CREATE)],
              responses={**admin_errors, **_NOT_JSON, **_error(409, "the tenant exists already")})
    async def create_tenant(ctx: Ctx, admin: TenantCreator, request: Request,
                            body: TenantCreateBody) -> TenantView:
        """Create a tenant with optional queue settings (quotas per device type, fair-share weight, cohort,
        maxPriority); then issue its tokens with `POST /v1/admin/tenants/{tenant}/tokens`. The scheduler
        applies the settings at its next reconcile, without a restart. Platform-admin."""
        request.state.audit_target, request.state.audit_tenant = f"tenant/{body.tenant}", body.tenant
        return await ctx.tenants.create(admin, body)

    @app.get("/v1/admin/tenants", response_model=TenantList, tags=["admin"], summary="List tenants",
             responses=_ADMIN_ERRORS)
    async def list_tenants(ctx: Ctx, _: TenantManager) -> TenantList:
        """Every tenant created through the API, and every tenant that has active tokens (created before
        tenants were records: `createdAt` null), with its settings and number of active tokens. Platform-admin."""
        return await ctx.tenants.list()

    @app.get("/v1/admin/tenants/{tenant}", response_model=TenantView, tags=["admin"], summary="Get a tenant",
             responses={**admin_errors, **_NO_TENANT})
    async def get_tenant(ctx: Ctx, _: TenantReader, tenant: TenantName
                         ) -> TenantView:
        """The tenant's queue settings as the scheduler applies them. Platform-admin, or its own tenant-admin."""
        return await ctx.tenants.get(tenant)

    @app.patch("/v1/admin/tenants/{tenant}", response_model=TenantView, tags=["admin"],
               summary="Change a tenant's quotas and priority", dependencies=[_strict_body(TenantSettingsBody, _TENANT_UPDATE)],
               responses={**admin_errors, **_NOT_JSON, **_NO_TENANT})
    async def update_tenant(ctx: Ctx, _: TenantUpdater, request: Request, tenant: TenantName,
                            body: TenantSettingsBody) -> TenantView:
        """Change only the fields sent: `quotas` merges by device type (a quota set to `null` is removed),
        `maxPriority` caps its jobs' priority (and so the priority class they reach; `null` removes the cap).
        The scheduler applies it at its next reconcile, without a restart. Platform-admin."""
        request.state.audit_detail = body.model_dump_json(by_alias=True, exclude_unset=True)
        return await ctx.tenants.update(tenant, body)

    @app.delete("/v1/admin/tenants/{tenant}", response_model=TenantView, tags=["admin"], summary="Delete a tenant",
                responses={**admin_errors, **_NO_TENANT,
                           **_error(409, "the tenant has unfinished jobs, or holds the caller's own token")})
    async def delete_tenant(ctx: Ctx, admin: TenantDeleter, tenant: TenantName) -> TenantView:
        """Revoke every token of the tenant and forget it and its settings (its finished jobs and artifacts
        stay). Refused while it has unfinished jobs: cancel them first. Platform-admin."""
        return await ctx.tenants.delete(admin, tenant)

    @app.post("/v1/admin/tenants/{tenant}/tokens", status_code=201, response_model=IssuedToken, tags=["admin"],
              summary="Issue a token", dependencies=[_strict_body(TokenCreateBody, _TOKEN_CREATE)],
              responses={**admin_errors, **_NOT_JSON, **_NO_TENANT})
    async def create_token(ctx: Ctx, admin: TokenCreator, request: Request,
                           tenant: TenantName, body: TokenCreateBody) -> IssuedToken:
        """A new token of the tenant with a role and an optional expiry (`expiresAt` or `ttlSeconds`). The
        answer carries the secret (`token`) once; only its sha256 is stored. A tenant-admin issues tokens of
        its own tenant up to tenant-admin; a platform-admin any."""
        if refusal := may_grant(admin, body.role):
            raise ForbiddenError(refusal.message)
        issued = await ctx.tenants.issue(admin, tenant, body)
        request.state.audit_target = f"tenant/{tenant}/token/{issued.token_id}"
        request.state.audit_detail = f"role {issued.role}" + (
            f", expires {issued.expires_at.isoformat()}" if issued.expires_at else "")
        return issued

    @app.get("/v1/admin/tenants/{tenant}/tokens", response_model=TokenList, tags=["admin"],
             summary="List a tenant's tokens", responses={**admin_errors, **_NO_TENANT})
    async def list_tokens(ctx: Ctx, _: TokenManager, tenant: TenantName) -> TokenList:
        """Every token of the tenant, without its secret: id, name, role, state (active, revoked,
        expired), when created, expiring, revoked, and by whom."""
        return await ctx.tenants.tokens(tenant)

    @app.delete("/v1/admin/tenants/{tenant}/tokens/{token_id}", response_model=TokenView, tags=["admin"],
                summary="Revoke a token", responses={**admin_errors, **_error(404, "no such token in the tenant")})
    async def revoke_token(ctx: Ctx, admin: TokenRevoker, tenant: TenantName, token_id: TokenId) -> TokenView:
        """Refused (401, "revoked") from the next request on, at every API process. Revoking a revoked
        token changes nothing."""
        return await ctx.tenants.revoke(admin, tenant, token_id)

    @app.get("/v1/admin/audit", response_model=AuditPage, tags=["admin"], summary="Read the audit log",
             responses={**admin_errors})
    async def read_audit(
        ctx: Ctx, reader: AuditReader,
        tenant: Annotated[str | None, Query(pattern=TENANT_PATTERN, max_length=63,
                                            description="only this tenant's entries (a tenant-admin: its own)")] = None,
        limit: Annotated[int, Query(ge=1, le=1000, description="entries per page, newest first")] = 100,
        before: Annotated[str | None, Query(pattern=r"^[0-9]{1,20}-[0-9]{1,20}$",
                                            description="`nextBefore` of the previous page")] = None,
    ) -> AuditPage:
        """Every administrative action and every control action on a job (submit, pause, resume, cancel,
        code upload, trigger create and delete): who (token id, name, tenant, role), what (action, target), when, and the outcome
        (ok, denied, not-found, conflict, invalid, failed). A platform-admin reads all of it (or one
        tenant's with `tenant`), a tenant-admin its own tenant's."""
        if tenant is None and Right.ALL_TENANTS not in rights(reader.effective_role):
            tenant = reader.tenant
        if tenant is not None:
            require(reader, Right.READ_AUDIT, tenant)
        return await ctx.audit.page(tenant, limit=limit, before=before)


def _install_other_routes(app: FastAPI) -> None:
    @app.get("/v1/whoami", response_model=WhoAmI, tags=["admin"], summary="The caller's token: tenant, name, role",
             responses=_AUTH_ERRORS)
    async def whoami(tenant: Tenant) -> WhoAmI:
        """What the token acts as and may do (the dashboard shows the admin views only to platform-admins)."""
        role = tenant.effective_role
        return WhoAmI(tenant=tenant.tenant, name=tenant.name, token_id=tenant.token_id, role=role,
                      rights=sorted(r.value for r in rights(role)))

    @app.get("/v1/registry/artifacts", response_model=ArtifactList, tags=["registry"],
             summary="List a job's artifacts with lineage", responses=_JOB_ERRORS)
    async def list_artifacts(
        ctx: Ctx, tenant: Tenant,
        job_id: Annotated[str, Query(alias="jobId", max_length=128, description="the job whose artifacts to list")],
    ) -> ArtifactList:
        """Checkpoint, final-model and export artifacts: spec hash, code revision, dataset manifest and hash,
        tokenizer, producing attempt, content hash (an export's: the sha256 of its trainyard-export.json;
        its lineage's `parentCheckpoint` the checkpoint it was converted from)."""
        return ArtifactList(job_id=job_id, artifacts=await ctx.jobs.artifacts(tenant, job_id))

    _install_export_routes(app)

    @app.get("/v1/datasets", response_model=DatasetList, tags=["datasets"], summary="List datasets",
             responses=_AUTH_ERRORS)
    async def list_datasets(ctx: Ctx, tenant: Tenant) -> DatasetList:
        """The verified versions the caller may train on: its tenant's, the platform's, and those shared
        with its tenant (`tenant` is the owner, null for the platform's; `sharedWith` whom it is shared with)."""
        return DatasetList(tenant=tenant.tenant, datasets=await ctx.datasets.list(tenant))

    @app.post("/v1/datasets", status_code=202, response_model=DatasetPublished, tags=["datasets"],
              summary="Publish a dataset version", dependencies=[_strict_body(DatasetPublishBody, _PUBLISH)],
              responses={
                  202: {"headers": {"Location": {"description": "where to poll the version's state",
                                                 "required": True, "schema": {"type": "string"}}}},
                  **_AUTH_ERRORS, **_NOT_JSON, **_invalid("a body field out of bounds, named by field")})
    async def publish_dataset(ctx: Ctx, tenant: Publisher, request: Request, response: Response,
                              body: DatasetPublishBody) -> DatasetPublished:
        """Announce a version of the caller's tenant whose files are in place under its prefix
        (`tenants/<tenant>/datasets/<name>/<version>/`, see `trainyard datasets import`). The registry
        verifies the manifest's sha256 and every shard before the version is visible; `GET` the
        `Location` to see it `verified`, or `rejected` with the reason. Submitter or above."""
        published = await ctx.datasets.publish(tenant, body)
        request.state.audit_target = f"dataset/{published.dataset}"
        response.headers["Location"] = f"{ctx.settings.public_url}/v1/datasets/{published.dataset}"
        return published

    @app.get("/v1/datasets/{ref:path}", response_model=DatasetView, tags=["datasets"], summary="Get a dataset",
             responses={**_AUTH_ERRORS, **_error(404, "not published, not verified, or not visible to the "
                                                      "caller's tenant"), **_invalid()})
    async def get_dataset(
        ctx: Ctx, tenant: Tenant,
        ref: Annotated[str, Path(pattern=DATASET_REF_PATTERN, max_length=256,
                                 description="name@version (the caller's own, else the platform's) or "
                                             "tenant/name@version",
                                 examples=["tinycorpus@v1"])],
    ) -> DatasetView:
        """A verified version the caller may use; for the version's owner, also one the registry
        rejected (`state` rejected, with `reason` and `problems`). Anything else is a 404."""
        return await ctx.datasets.get(tenant, ref)

    @app.get("/healthz", response_model=Health, tags=["operations"], summary="Liveness and readiness",
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

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics",
             response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    # The event contract (AsyncAPI 3.0), unauthenticated and outside this document like /openapi.json.
    @app.get("/v1/asyncapi.yaml", include_in_schema=False)
    async def asyncapi_yaml() -> Response:
        return Response(await run_in_threadpool(contract.asyncapi_yaml), media_type="application/yaml")

    @app.get("/v1/asyncapi.json", include_in_schema=False)
    async def asyncapi_json() -> Response:
        return Response(await run_in_threadpool(contract.asyncapi_json), media_type="application/json")


_ARTIFACT_404 = _error(404, "no such artifact (or export) for this tenant")


def _install_export_routes(app: FastAPI) -> None:
    @app.get("/v1/registry/artifacts/{export_id:export}/files/{name}", tags=["registry"],
             summary="Download a file of a ready export", response_class=FileResponse,
             responses={200: {"content": {"application/octet-stream": {}}, "description": "the file's bytes"},
                        **_AUTH_ERRORS, **_ARTIFACT_404, **_error(409, "the export is not ready (or failed)"),
                        **_invalid()})
    async def get_export_file(ctx: Ctx, tenant: Tenant, export_id: ExportId, name: ExportFileName) -> FileResponse:
        """One file of the caller's tenant's ready export, streamed: only the names its
        `trainyard-export.json` lists (and that listing itself); `GET` the export for their sizes and
        sha256. `trainyard export <job> --out DIR` downloads them all and checks each."""
        path = await ctx.exports.file(tenant, export_id, name)
        return FileResponse(path, media_type="application/octet-stream", filename=name)

    @app.post("/v1/registry/artifacts/{artifact_id:artifact}/export", status_code=202, response_model=ArtifactView,
              tags=["registry"], summary="Export a checkpoint (a Hugging Face model directory)",
              dependencies=[_strict_body(ExportBody, _EXPORT)],
              responses={
                  200: {"model": ArtifactView, "description": "that export is ready already"},
                  202: {"headers": {"Location": {"description": "the export: GET it until it is ready or failed",
                                                 "required": True, "schema": {"type": "string"}}}},
                  **_AUTH_ERRORS, **_NOT_JSON, **_ARTIFACT_404,
                  **_error(409, "the artifact cannot be exported: retired (its checkpoint deleted by retention or "
                                "refused at restore; the message says why and what to export instead), or not a "
                                "checkpoint or model"),
                  **_invalid("an unknown `format` (only `hf`), or another body field")})
    async def export_artifact(ctx: Ctx, tenant: ExportRequester, request: Request, response: Response,
                              artifact_id: ArtifactId, body: ExportBody) -> ArtifactView:
        """Convert a READY checkpoint (or a job's model) into `format` (`hf`: config.json,
        model.safetensors, generation_config.json, tokenizer.json + tokenizer_config.json, which
        transformers' `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load). The
        registry verifies every shard against the checkpoint's manifest first, gathers the full state
        whatever the layout (DDP, FSDP, TP, PP) and records the directory as an `export` artifact
        (`<job>/export/<checkpoint>/<format>`) with the checkpoint's lineage. The same checkpoint and
        format is the same export: while it is requested this answers `202` with it, once ready `200`; after
        it failed a new request retries. `GET` the `Location` to follow it. Submitter or above."""
        view, asked = await ctx.exports.request(tenant, artifact_id, body.format)
        request.state.audit_target = f"artifact/{artifact_id}"
        request.state.audit_detail = f"export {view.artifact_id}" + ("" if asked else f" ({view.state} already)")
        response.headers["Location"] = f"{ctx.settings.public_url}/v1/registry/artifacts/{view.artifact_id}"
        if view.state == "ready":
            response.status_code = 200
        return view

    @app.get("/v1/registry/artifacts/{artifact_id:artifact}", response_model=ArtifactView, tags=["registry"],
             summary="Get an artifact or an export", responses={**_AUTH_ERRORS, **_ARTIFACT_404, **_invalid()})
    async def get_artifact(ctx: Ctx, tenant: Tenant, artifact_id: ArtifactId) -> ArtifactView:
        """One artifact of the caller's tenant (checkpoint, model or export, with lineage), or an export's
        state: `requested`, `ready` (with its `files`), or `failed` with the `reason` and `problems`."""
        return await ctx.exports.get(tenant, artifact_id)


def create_app(context: ApiContext) -> FastAPI:
    """The REST API over ``context``."""
    app = FastAPI(
        title="trainyard API",
        version="1.0.0",
        description=DESCRIPTION,
        openapi_tags=TAGS,
        dependencies=[Depends(_one_value_per_query_parameter)],
    )
    app.state.context = context
    app.add_middleware(TelemetryMiddleware)
    _install_error_handlers(app)
    _install_job_routes(app)
    _install_plan_routes(app)
    install_lab_routes(app, read=_may(Right.READ), strict_body=_strict_body, responses={
        **_AUTH_ERRORS, **_NOT_JSON, **_invalid("invalid input, each problem named by field; also an unknown model or "
                                                "device, or a tensor degree the node or the model's heads cannot "
                                                "be split by")}, assumptions=lambda r: _context(r).settings.assumptions)
    _install_goodput_and_admin_routes(app)
    _install_code_routes(app)
    _install_trigger_routes(app)
    _install_tenant_routes(app)
    _install_other_routes(app)
    from trainyard_api.dashboard_routes import install_dashboard_routes  # it imports this module's names

    install_dashboard_routes(app)
    install_dashboard(app)
    return app
