"""The app's error mapping and its OpenAPI document, without a broker or a Redis: statuses as
documented, the 422 body the routes really send, 503 only for an outage, ``Allow`` for the path."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from redis import exceptions as redis_errors

from trainyard_api.app import ApiContext, create_app
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_api.settings import ApiSettings
from trainyard_runtime.store import StateStore


class FailingRedis:
    """Every command raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Callable[..., Any]:
        async def command(*_: Any, **__: Any) -> Any:
            raise self.error
        return command


def client(redis: object) -> httpx.AsyncClient:
    app = create_app(ApiContext(ApiSettings(), StateStore(redis), None))  # type: ignore[arg-type]  # a test double
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                             headers={"Authorization": "Bearer t"})


class TokenOnlyRedis(FailingRedis):
    """Knows one token (tenant-a); any other command raises."""

    def __init__(self) -> None:
        super().__init__(AssertionError("no command may be sent"))

    async def hget(self, *_: Any) -> str:
        return '{"tenant": "tenant-a", "name": "alice"}'


async def as_tenant(method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with client(TokenOnlyRedis()) as c:
        return await c.request(method, path, **kwargs)


def document() -> dict[str, Any]:
    return create_app(ApiContext(ApiSettings(), None, None)).openapi()  # type: ignore[arg-type]  # a test double


async def test_503_means_redis_cannot_serve_and_a_refused_command_is_500() -> None:
    async with client(FailingRedis(redis_errors.ConnectionError("refused"))) as c:
        resp = await c.get("/v1/training-jobs")
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", resp.text
    async with client(FailingRedis(redis_errors.ResponseError("ERR value is out of range"))) as c:
        resp = await c.get("/v1/training-jobs")
        assert resp.status_code == 500 and resp.json() == {"detail": "internal error"}


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/training-jobs?offset=1140921020336992944128", "query.offset"),  # was a Redis error, as a 503
    ("/v1/training-jobs?state=null", "query.state"),
    ("/v1/training-jobs/" + "j" * 129, "path.job_id"),
    ("/v1/datasets/not-a-ref", "path.ref"),
    ("/v1/plan/calibration?limit=-1", "query.limit"),
    ("/v1/registry/artifacts", "query.jobId"),
])
async def test_bad_input_is_a_422_naming_the_field_before_anything_reaches_redis(path: str, field: str) -> None:
    resp = await as_tenant("GET", path)
    assert resp.status_code == 422, resp.text
    assert [p["field"] for p in resp.json()["detail"]] == [field]


@pytest.mark.parametrize(("body", "headers", "status", "field"), [
    (b")\xff\xfe", {"Content-Type": "application/json"}, 422, "body"),  # not UTF-8
    (b'{"model": "gpt-tiny@v1", "calibrate": 0}', {"Content-Type": "application/json"}, 422, "calibrate"),
    (b'{"model": "gpt-tiny@v1", "devices": "8"}', {"Content-Type": "application/json"}, 422, "devices"),
    (b'{"model": "gpt-tiny@v1", "tokens": NaN}', {"Content-Type": "application/json"}, 422, "body"),
    (b'{"model": "gpt-tiny@v1"}', {"Content-Type": "text/plain"}, 415, None),
])
async def test_a_body_is_json_of_the_documented_types(body: bytes, headers: dict[str, str], status: int,
                                                      field: str | None) -> None:
    resp = await as_tenant("POST", "/v1/plan", content=body, headers=headers)
    assert resp.status_code == status, resp.text
    if field is not None:
        assert field in [p["field"] for p in resp.json()["detail"]]


@pytest.mark.parametrize(("body", "where"), [
    (b'{"model": "gpt-tiny@v1\x01"}', "Invalid control character at: line 1 column 23 (char 22)"),
    (b'{\n  "model": "gpt-tiny@v1",\n  "devices": 8,,\n}',
     "Expecting property name enclosed in double quotes: line 3 column 16 (char 43)"),
    (b'{"model": ', "Expecting value: line 1 column 11 (char 10)"),
])
async def test_a_body_that_is_no_json_is_told_where_it_breaks(body: bytes, where: str) -> None:
    """The decoder's message whole: "Invalid control character at" once came without its line and column."""
    resp = await as_tenant("POST", "/v1/plan", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"] == [{"field": "body", "message": f"the body is not valid JSON: {where}"}]
    with pytest.raises(ValueError) as decoded:
        json.loads(body)
    assert str(decoded.value) == where  # what Python's own decoder says of the same bytes


async def test_a_whole_number_is_an_integer_as_in_json_schema() -> None:
    spec = {**EXAMPLE_SPEC, "resources": {**EXAMPLE_SPEC["resources"], "gpuCount": 3.0}}  # type: ignore[dict-item]  # an invalid value, on purpose
    resp = await as_tenant("POST", "/v1/training-jobs", json=spec)
    # past the types: 3 devices for data parallelism 2 is the spec's own rule, not a type error
    assert resp.status_code == 422 and [p["field"] for p in resp.json()["detail"]] == ["parallelism"]


async def test_options_and_other_methods_list_every_method_of_the_path() -> None:
    async with client(FailingRedis(AssertionError("no command may be sent"))) as c:
        options = await c.options("/v1/training-jobs")
        assert options.status_code == 204 and options.headers["Allow"] == "GET, OPTIONS, POST"
        delete = await c.delete("/v1/training-jobs")
        assert delete.status_code == 405 and delete.headers["Allow"] == "GET, OPTIONS, POST"
        assert (await c.options("/v1/nowhere")).status_code == 404


def test_every_422_is_documented_as_the_field_message_list_the_routes_send() -> None:
    doc = document()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            if "422" in operation["responses"]:
                schema = operation["responses"]["422"]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/FieldErrors"}, (method, path)
            if path not in ("/healthz", "/metrics"):
                assert {"401", "503"} <= set(operation["responses"]), (method, path)


def test_every_response_of_every_operation_has_a_schema() -> None:
    """A generated client types each answer from its schema: none may be missing or empty (a file's bytes are
    `type: string, format: binary`); only a 204 has no body to describe."""
    missing = []
    for path, operations in document()["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if status == "204":
                    assert "content" not in response, (method, path)
                    continue
                content = response.get("content") or {"(no content)": {}}
                missing += [(method, path, status, media) for media, body in content.items() if not body.get("schema")]
    assert missing == []
    files = document()["paths"]["/v1/registry/artifacts/{export_id}/files/{name}"]["get"]["responses"]["200"]
    assert files["content"] == {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


def test_the_document_carries_the_constraints_the_server_enforces() -> None:
    schemas = document()["components"]["schemas"]
    model_config = schemas["SubmittedSpec"]["properties"]["modelConfig"]["anyOf"]
    assert {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9._-]*$",
            "maxLength": 128, "examples": ["gpt-tiny@v1"]} in model_config
    assert schemas["SubmittedTraining"]["properties"]["seed"]["maximum"] == 2**53 - 1
    assert schemas["PlanRequest"]["properties"]["devices"]["anyOf"][0]["maximum"] == 65_536
    assert "recommendation" not in schemas["PlanResponse"]["required"]


async def test_a_query_parameter_given_twice_is_a_422_and_unknown_ones_are_ignored() -> None:
    resp = await as_tenant("GET", "/v1/plan/calibration?limit=false&limit=true&limit=%2B0.0")
    assert resp.status_code == 422 and [p["field"] for p in resp.json()["detail"]] == ["query.limit"]
    down = StateStore(FailingRedis(redis_errors.ConnectionError("down")))  # type: ignore[arg-type]  # a test double
    app = create_app(ApiContext(ApiSettings(api_metrics_token="t"), down, None))  # type: ignore[arg-type]  # a test double
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                 headers={"Authorization": "Bearer t"}) as c:
        assert (await c.get("/metrics?x=1&x=2")).status_code == 200


async def test_the_event_contract_is_served_without_a_token_and_without_redis() -> None:
    import yaml

    from trainyard_contract import asyncapi as contract

    app = create_app(ApiContext(ApiSettings(), StateStore(FailingRedis(AssertionError("no command"))), None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
        as_yaml, as_json = await c.get("/v1/asyncapi.yaml"), await c.get("/v1/asyncapi.json")
    assert as_yaml.status_code == 200 and as_yaml.headers["content-type"].startswith("application/yaml")
    assert yaml.safe_load(as_yaml.text) == contract.asyncapi() == as_json.json()
    assert as_yaml.text == contract.asyncapi_yaml()  # what docs/asyncapi.yaml holds
    assert "/v1/asyncapi.yaml" not in document()["paths"]  # like /openapi.json, not an operation of the API


@pytest.mark.parametrize(("page", "script"), [("/docs", b"SwaggerUIBundle"), ("/redoc", b"Redoc")])
async def test_the_api_docs_pages_load_everything_from_the_api_itself(page: str, script: bytes) -> None:
    """On a cluster without internet the docs pages work: every script, style and icon they name is served by
    the app (they named a CDN: a blank page offline), and the HTML names no other host."""
    app = create_app(ApiContext(ApiSettings(), StateStore(FailingRedis(AssertionError("no command"))), None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
        html = await c.get(page)
        assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
        assert re.findall(r"\w+://|//[\w.-]+\.\w+/", html.text) == []  # no URL with a scheme or another host
        urls = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html.text) + re.findall(r"url: '([^']+)'", html.text)
        kinds = {}
        for url in urls:
            assert url.startswith("/") and not url.startswith("//"), url
            asset = await c.get(url)
            assert asset.status_code == 200 and asset.content, url
            kinds[url.rsplit(".", 1)[-1]] = asset
        assert {"js", "json", "png"} <= set(kinds) and script in kinds["js"].content
        assert kinds["js"].headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")
        assert kinds["json"].json()["openapi"].startswith("3.1")
        if page == "/docs":
            assert kinds["css"].headers["content-type"].startswith("text/css")
            assert b"isOAS31" in kinds["js"].content  # Swagger UI 5: 4.x cannot render an OpenAPI 3.1 document
            assert '"validatorUrl": null' in html.text  # no badge fetched from validator.swagger.io


async def test_a_full_connection_pool_is_called_overload_not_a_redis_outage() -> None:
    import json

    from redis import exceptions as redis_errors

    from trainyard_api.http_errors import on_redis

    busy = await on_redis(None, redis_errors.MaxConnectionsError("Too many connections"))  # type: ignore[arg-type]
    down = await on_redis(None, redis_errors.ConnectionError("Connection refused"))  # type: ignore[arg-type]
    assert busy.status_code == down.status_code == 503
    assert busy.headers["retry-after"] == "1"
    assert "overloaded" in json.loads(busy.body)["detail"] and "unavailable" not in json.loads(busy.body)["detail"]
    assert "unavailable" in json.loads(down.body)["detail"]
