"""The typed client: requests it sends, answers it parses, errors it raises (no network)."""

from __future__ import annotations

import json

import httpx
import pytest

from trainyard_cli.client import (
    ApiAuthError,
    ApiClient,
    ApiConflictError,
    ApiError,
    ApiNotFoundError,
    ApiSpecError,
    ApiUnreachableError,
    error_for,
)
from trainyard_contract.errors import AuthError, NotFoundError, SpecError

JOB = {
    "jobId": "job-0123456789ab", "tenant": "t", "name": "tiny", "state": "running", "specHash": "sha256:x",
    "spec": {"modelConfig": "gpt-tiny@v1"},
    "attempts": [{"attempt": 1, "allocationId": "alloc-1", "epoch": 1, "state": "running", "nodes": ["n0"],
                  "worldSize": 2, "startCheckpoint": None, "startedAt": "2024-05-01T12:00:00Z", "endedAt": None,
                  "failureReason": None, "placementScore": None}],
    "progress": {"globalStep": 7, "maxSteps": 40, "consumedTokens": 1000, "lastLoss": 3.2},
    "checkpoints": [], "someFutureField": {"ignored": True},
}


def test_requests_carry_the_token_and_answers_are_typed() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST":
            return httpx.Response(202, json={"jobId": "job-0123456789ab", "state": "queued", "specHash": "sha256:x"})
        return httpx.Response(200, json=JOB)

    with ApiClient("http://api/", "tok", transport=httpx.MockTransport(handler)) as api:
        submitted = api.submit({"specVersion": "v1"}, idempotency_key="k")
        job = api.get_job(submitted.job_id)
    assert seen[0].headers["authorization"] == "Bearer tok" and seen[0].headers["idempotency-key"] == "k"
    assert json.loads(seen[0].content) == {"specVersion": "v1"}
    assert seen[1].url.path == "/v1/training-jobs/job-0123456789ab"
    assert job.progress.global_step == 7 and job.attempt == 1 and not job.terminal


@pytest.mark.parametrize(("status", "body", "cls", "base"), [
    (401, {"detail": "unknown token"}, ApiAuthError, AuthError),
    (404, {"detail": "no job"}, ApiNotFoundError, NotFoundError),
    (409, {"detail": "already succeeded"}, ApiConflictError, ApiError),
    (503, {"detail": "redis down"}, ApiError, ApiError),
])
def test_error_statuses_map_to_the_error_tree(status: int, body: dict, cls: type, base: type) -> None:
    error = error_for(httpx.Response(status, json=body))
    assert isinstance(error, cls) and isinstance(error, base) and error.status == status
    assert body["detail"] in error.message
    assert error.retryable == (status >= 500)


def test_a_422_keeps_every_field_problem() -> None:
    error = error_for(httpx.Response(422, json={"detail": [
        {"field": "training.globalBatchSize", "message": "must be a multiple"},
        {"field": "dataset", "message": "unknown dataset"},
    ]}))
    assert isinstance(error, ApiSpecError) and isinstance(error, SpecError)
    assert error.problems == [("training.globalBatchSize", "must be a multiple"), ("dataset", "unknown dataset")]
    assert error.field == "training.globalBatchSize"


def test_an_unreachable_api_says_to_start_the_stack() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with ApiClient("http://127.0.0.1:1", "tok", transport=httpx.MockTransport(refuse)) as api:
        with pytest.raises(ApiUnreachableError, match="make up"):
            api.list_jobs()


def test_a_plain_http_api_gets_a_tls_context_that_trusts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CA bundle is loaded for an http:// API (a TLS connection through it would be refused, not trusted)."""
    import ssl

    from trainyard_cli.client import _tls_for

    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert _tls_for("https://api.example:443") is True  # httpx's default: the CA bundle
    context = _tls_for("http://127.0.0.1:8080")
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] == 0
    monkeypatch.setenv("HTTPS_PROXY", "https://proxy.example:3128")  # a proxy may speak TLS: the default again
    assert _tls_for("http://127.0.0.1:8080") is True
