"""A typed HTTP client for the trainyard API (httpx), sync and async.

Answers are parsed into the bodies the API publishes (``trainyard_contract.wire``: one definition
for both sides, so the CLI does not import the server package); fields it does not know are
ignored. The job document is read here (:class:`Job`) with its spec and read models left as
JSON. Failures raise :class:`ApiError` subclasses whose message says what to do.

    with ApiClient("http://127.0.0.1:8080", token) as api:
        submitted = api.submit(spec_dict)
        job = api.get_job(submitted.job_id)
"""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from trainyard_contract.errors import AuthError, ConflictError, NotFoundError, SpecError, TrainyardError
from trainyard_contract.wire import (
    ApiModel,
    AttemptView,
    CheckpointList,
    CheckpointView,
    CodeArchiveView,
    ControlResponse,
    DatasetPublished,
    ExportFile,
    JobPage,
    ProgressView,
    SubmitResponse,
    TriggerJobView,
)

M = TypeVar("M", bound=BaseModel)
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
UPLOAD_CHUNK = 1 << 20


# ----------------------------------------------------------------------------- errors


class ApiError(TrainyardError):
    """The API answered with an error (``status``) or could not be reached (``status`` None)."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool | None = None) -> None:
        TrainyardError.__init__(self, message, retryable=retryable)  # not super(): SpecError's init differs
        self.status = status


class ApiUnreachableError(ApiError):
    retryable = True


class ApiAuthError(ApiError, AuthError):
    pass


class ApiNotFoundError(ApiError, NotFoundError):
    pass


class ApiConflictError(ApiError, ConflictError):
    pass


class ApiSpecError(ApiError, SpecError):
    """A 422: ``problems`` holds (field, message) for every bad field."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        ApiError.__init__(self, "; ".join(f"{f}: {m}" for f, m in problems) or "invalid request", status=422)
        self.problems = problems
        self.field, self.detail = problems[0] if problems else ("", "invalid request")


# ----------------------------------------------------------------------------- models


class Job(ApiModel):
    """``GET /v1/training-jobs/{id}`` as the CLI reads it: the spec and the read models stay JSON."""

    job_id: str
    tenant: str | None = None
    name: str | None = None
    state: str
    spec_hash: str
    spec: dict[str, Any] = {}
    created_at: datetime | None = None
    updated_at: datetime | None = None
    reason: str | None = None
    queued_reason: str | None = None
    attempts: list[AttemptView] = []
    progress: ProgressView = ProgressView()
    checkpoints: list[CheckpointView] = []
    queued_reason_kind: str | None = None
    goodput: dict[str, Any] | None = None
    checkpoint_advice: dict[str, Any] | None = None
    stragglers: list[dict[str, Any]] = []
    conditions: list[dict[str, Any]] = []
    triggered_by: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def attempt(self) -> int | None:
        return self.attempts[-1].attempt if self.attempts else None


class Artifact(ApiModel):
    artifact_id: str
    job_id: str
    type: str
    uri: str
    hash: str
    tensors_hash: str | None = None
    producer_attempt: int
    global_step: int
    consumed_tokens: int = 0
    lineage: dict[str, Any] = {}
    created_at: datetime | None = None
    retired_at: datetime | None = None
    retired_reason: str | None = None


class ExportState(ApiModel):
    export_id: str
    checkpoint_artifact_id: str
    job_id: str
    format: str
    state: str
    uri: str | None = None
    hash: str | None = None
    reason: str | None = None
    problems: list[str] = []


class ArtifactView(ApiModel):
    """``GET /v1/registry/artifacts/{id}``: an artifact, or an export in whatever state it is."""

    artifact_id: str
    type: str
    state: str
    artifact: Artifact | None = None
    export: ExportState | None = None
    files: list[ExportFile] | None = None


class TriggerFailure(ApiModel):
    at: datetime | None = None
    dataset: str
    message: str
    problems: list[dict[str, str]] = []


class Trigger(ApiModel):
    trigger_id: str
    tenant: str | None = None
    name: str
    on: str = "datasetVersion"
    dataset: str = ""
    job: str | None = None
    experiment: str | None = None
    every_steps: int | None = None
    sources: list[str] = []
    template: dict[str, Any] = {}
    enabled: bool = True
    created_by: str | None = None
    created_at: datetime | None = None
    jobs: list[TriggerJobView] | None = None
    last_failure: TriggerFailure | None = None


class _Triggers(ApiModel):
    triggers: list[Trigger]


class Dataset(ApiModel):
    name: str
    version: str
    tenant: str | None = None  # the owner; None: the platform's
    shared_with: list[str] = []
    manifest_uri: str
    sha256: str
    tokenizer: str | None = None
    num_tokens: int | None = None


class DatasetRejectionView(ApiModel):
    sha256: str
    manifest_uri: str
    reason: str
    problems: list[str] = []
    rejected_at: datetime
    published_event_id: str | None = None


class DatasetView(Dataset):
    """``GET /v1/datasets/{ref}``: a verified version (with, for its owner, refused publishes of its ref), or a
    rejected one with why."""

    state: str  # verified | rejected
    vocab_size: int | None = None
    dtype: str | None = None
    published_at: datetime | None = None
    reason: str | None = None
    problems: list[str] = []
    rejections: list[DatasetRejectionView] = []


# ----------------------------------------------------------------------------- requests


def error_for(response: httpx.Response) -> ApiError:
    """The ApiError an error response means."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = response.text or response.reason_phrase
    status = response.status_code
    if status == 422:
        if isinstance(detail, list):
            return ApiSpecError([(str(d.get("field", "")), str(d.get("message", d))) for d in detail
                                 if isinstance(d, dict)])
        return ApiSpecError([("", str(detail))])
    message = detail if isinstance(detail, str) else str(detail)
    if status == 401:
        return ApiAuthError(f"the API refused the token: {message}", status=status)
    if status == 404:
        return ApiNotFoundError(message, status=status)
    if status == 409:
        return ApiConflictError(message, status=status)
    return ApiError(f"HTTP {status}: {message}", status=status, retryable=status >= 500)


def _unreachable(base_url: str, exc: Exception) -> ApiUnreachableError:
    return ApiUnreachableError(
        f"cannot reach the trainyard API at {base_url} ({type(exc).__name__}). Is the stack running? "
        "Run `make up`, or point --api-url / TRAINYARD_API_URL at a running API"
    )


def _parse(response: httpx.Response, model: type[M]) -> M:
    if response.is_error:
        raise error_for(response)
    return model.model_validate(response.json())


def _headers(token: str | None) -> dict[str, str]:
    headers = {"Accept": "application/json", "User-Agent": "trainyard-cli"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _list_params(state: str | None, limit: int | None, offset: int) -> dict[str, Any]:
    params: dict[str, Any] = {"offset": offset}
    if state:
        params["state"] = state
    if limit:
        params["limit"] = limit
    return params


def _tls_for(base_url: str) -> ssl.SSLContext | bool:
    """For an ``http://`` API reached directly, a TLS context that trusts nothing; httpx's default otherwise.

    httpx builds a TLS context for every client, and the default one loads the CA bundle: 30-50 ms of each
    command's start. A plain-HTTP API reached without a proxy is never spoken to over TLS (the client follows
    no redirect), so its context need trust no one: a TLS connection it were ever asked to make would be
    refused, never let through. With a proxy in the environment (which httpx honours) nothing changes.
    """
    if not base_url.startswith("http://") or urllib.request.getproxies():
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class ApiClient:
    """Synchronous client. ``close()`` or use it as a context manager."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(token), timeout=timeout_s,
                                  transport=transport, verify=_tls_for(self.base_url))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url, exc) from exc

    def submit(self, spec: Mapping[str, Any], *, idempotency_key: str | None = None) -> SubmitResponse:
        """POST the spec; ``ApiSpecError`` lists every bad field on a 422."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return _parse(self._request("POST", "/v1/training-jobs", json=dict(spec), headers=headers), SubmitResponse)

    def get_job(self, job_id: str) -> Job:
        return _parse(self._request("GET", f"/v1/training-jobs/{job_id}"), Job)

    def list_jobs(self, *, state: str | None = None, limit: int | None = None, offset: int = 0) -> JobPage:
        return _parse(self._request("GET", "/v1/training-jobs", params=_list_params(state, limit, offset)), JobPage)

    def code_archive(self, archive: str) -> CodeArchiveView | None:
        """The tenant's stored archive ``sha256:<hex>`` (None when it was never uploaded)."""
        response = self._request("GET", f"/v1/code/{archive}")
        return None if response.status_code == 404 else _parse(response, CodeArchiveView)

    def upload_code(self, archive: str, data: bytes, *,
                    progress: Callable[[int], None] | None = None) -> CodeArchiveView:
        """PUT the archive's bytes (``progress`` gets the bytes sent so far, chunk by chunk)."""
        def chunks() -> Iterator[bytes]:
            for start in range(0, len(data), UPLOAD_CHUNK):
                yield data[start:start + UPLOAD_CHUNK]
                if progress is not None:
                    progress(min(start + UPLOAD_CHUNK, len(data)))

        headers = {"Content-Type": "application/gzip", "Content-Length": str(len(data))}
        timeout = httpx.Timeout(self._http.timeout.connect, read=300.0, write=300.0, pool=None)
        return _parse(self._request("PUT", f"/v1/code/{archive}", content=chunks(), headers=headers,
                                    timeout=timeout), CodeArchiveView)

    def checkpoints(self, job_id: str) -> list[CheckpointView]:
        page = _parse(self._request("GET", f"/v1/training-jobs/{job_id}/checkpoints"), CheckpointList)
        return page.checkpoints

    def evaluations(self, job_id: str) -> list[dict[str, Any]]:
        """GET /v1/training-jobs/{jobId}/evaluations: the evaluations of the job's checkpoints, by step."""
        return list(self.get_json(f"/v1/training-jobs/{job_id}/evaluations")["evaluations"])

    def control(self, job_id: str, action: str) -> ControlResponse:
        """``action``: cancel, pause or resume."""
        return _parse(self._request("POST", f"/v1/training-jobs/{job_id}/{action}"), ControlResponse)

    def cancel(self, job_id: str) -> ControlResponse:
        return self.control(job_id, "cancel")

    def logs(self, job_id: str, *, attempt: int | None = None, rank: int = 0, tail: int = 200,
             follow: bool = False) -> Iterator[str]:
        """A rank's log, chunk by chunk; with ``follow`` until its attempt ends (GET …/logs)."""
        params: dict[str, Any] = {"rank": rank, "tail": tail, "follow": str(follow).lower()}
        if attempt is not None:
            params["attempt"] = attempt
        timeout = httpx.Timeout(self._http.timeout.connect, read=None) if follow else self._http.timeout
        try:
            with self._http.stream("GET", f"/v1/training-jobs/{job_id}/logs", params=params,
                                   timeout=timeout) as response:
                if response.is_error:
                    response.read()
                    raise error_for(response)
                yield from response.iter_text()
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url, exc) from exc

    def artifacts(self, job_id: str) -> list[Artifact]:
        return _parse(self._request("GET", "/v1/registry/artifacts", params={"jobId": job_id}), _Artifacts).artifacts

    def datasets(self) -> list[Dataset]:
        return _parse(self._request("GET", "/v1/datasets"), _Datasets).datasets

    def request_export(self, artifact_id: str, fmt: str) -> ArtifactView:
        """POST /v1/registry/artifacts/{id}/export: the export (requested, or ready already)."""
        return _parse(self._request("POST", f"/v1/registry/artifacts/{artifact_id}/export", json={"format": fmt}),
                      ArtifactView)

    def get_artifact(self, artifact_id: str) -> ArtifactView:
        return _parse(self._request("GET", f"/v1/registry/artifacts/{artifact_id}"), ArtifactView)

    def download_export_file(self, export_id: str, name: str, sink: Callable[[bytes], None]) -> None:
        """Stream one file of a ready export into ``sink``, chunk by chunk."""
        timeout = httpx.Timeout(self._http.timeout.connect, read=300.0, write=None, pool=None)
        try:
            with self._http.stream("GET", f"/v1/registry/artifacts/{export_id}/files/{name}",
                                   timeout=timeout) as response:
                if response.is_error:
                    response.read()
                    raise error_for(response)
                for chunk in response.iter_bytes(UPLOAD_CHUNK):
                    sink(chunk)
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url, exc) from exc

    def create_trigger(self, body: Mapping[str, Any]) -> Trigger:
        """POST /v1/triggers; ``ApiSpecError`` lists every bad field (``template.…``) on a 422."""
        return _parse(self._request("POST", "/v1/triggers", json=dict(body)), Trigger)

    def triggers(self) -> list[Trigger]:
        return _parse(self._request("GET", "/v1/triggers"), _Triggers).triggers

    def get_trigger(self, trigger_id: str) -> Trigger:
        return _parse(self._request("GET", f"/v1/triggers/{trigger_id}"), Trigger)

    def delete_trigger(self, trigger_id: str) -> Trigger:
        return _parse(self._request("DELETE", f"/v1/triggers/{trigger_id}"), Trigger)
    def caller_tenant(self) -> str | None:
        """The token's tenant (where its own dataset versions live)."""
        return _parse(self._request("GET", "/v1/datasets"), _Datasets).tenant

    def publish_dataset(self, body: Mapping[str, Any]) -> DatasetPublished:
        """POST /v1/datasets: announce a version of the caller's tenant (the registry verifies it)."""
        return _parse(self._request("POST", "/v1/datasets", json=dict(body)), DatasetPublished)

    def dataset(self, ref: str, *, sha256: str | None = None) -> DatasetView:
        """GET /v1/datasets/{ref} (``sha256``: what became of the publish of that content; a 404 until the
        registry has decided)."""
        params = {"sha256": sha256} if sha256 else None
        return _parse(self._request("GET", f"/v1/datasets/{ref}", params=params), DatasetView)

    def health(self) -> dict[str, Any]:
        response = self._request("GET", "/healthz")
        return dict(response.json())

    def get_json(self, path: str, *, params: Mapping[str, Any] | None = None) -> Any:
        """The raw JSON of a GET (for ``--json`` output)."""
        response = self._request("GET", path, params=dict(params or {}))
        if response.is_error:
            raise error_for(response)
        return response.json()

    def post_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        """The JSON answer of a body-less POST (admin actions; ``params``: its query)."""
        return self.call_json("POST", path, params=params)

    def call_json(self, method: str, path: str, *, body: Any = None,
                  params: Mapping[str, Any] | None = None) -> Any:
        """The JSON answer of any request (``body`` sent as JSON when not None); ApiError for an error."""
        kwargs: dict[str, Any] = {"params": {k: v for k, v in (params or {}).items() if v is not None} or None}
        if body is not None:
            kwargs["json"] = body
        response = self._request(method, path, **kwargs)
        if response.is_error:
            raise error_for(response)
        return response.json()


class AsyncApiClient:
    """The same calls for async code (tests, the dev stack)."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(token), timeout=timeout_s,
                                       transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncApiClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _unreachable(self.base_url, exc) from exc

    async def submit(self, spec: Mapping[str, Any], *, idempotency_key: str | None = None) -> SubmitResponse:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return _parse(await self._request("POST", "/v1/training-jobs", json=dict(spec), headers=headers),
                      SubmitResponse)

    async def get_job(self, job_id: str) -> Job:
        return _parse(await self._request("GET", f"/v1/training-jobs/{job_id}"), Job)

    async def list_jobs(self, *, state: str | None = None, limit: int | None = None, offset: int = 0) -> JobPage:
        return _parse(await self._request("GET", "/v1/training-jobs", params=_list_params(state, limit, offset)),
                      JobPage)

    async def checkpoints(self, job_id: str) -> list[CheckpointView]:
        return _parse(await self._request("GET", f"/v1/training-jobs/{job_id}/checkpoints"), CheckpointList).checkpoints

    async def control(self, job_id: str, action: str) -> ControlResponse:
        return _parse(await self._request("POST", f"/v1/training-jobs/{job_id}/{action}"), ControlResponse)

    async def cancel(self, job_id: str) -> ControlResponse:
        return await self.control(job_id, "cancel")

    async def artifacts(self, job_id: str) -> list[Artifact]:
        return _parse(await self._request("GET", "/v1/registry/artifacts", params={"jobId": job_id}),
                      _Artifacts).artifacts

    async def datasets(self) -> list[Dataset]:
        return _parse(await self._request("GET", "/v1/datasets"), _Datasets).datasets

    async def health(self) -> dict[str, Any]:
        return dict((await self._request("GET", "/healthz")).json())

    async def get_json(self, path: str, *, params: Mapping[str, Any] | None = None) -> Any:
        response = await self._request("GET", path, params=dict(params or {}))
        if response.is_error:
            raise error_for(response)
        return response.json()


class _Artifacts(ApiModel):
    artifacts: list[Artifact]


class _Datasets(ApiModel):
    tenant: str | None = None
    datasets: list[Dataset]
