"""The Lab's routes through the app over the real Redis (tokens, roles): ``POST /v1/lab/memory``,
``/scaling`` and ``/checkpoint`` answer any token with the read right, viewer included, with the
planner's numbers; bad input is a 422 naming the field; no token is a 401."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import StateStore
from trainyard_planner import Transformer, estimate_memory, Layout, ZeroStage, young_interval
from tests.support.api import TOKEN_A, client_for, seed

VIEWER = "token-viewer-a"
BODIES = {
    "memory": {"model": {"parameters": 7e9}, "devices": 8, "sharding": "fsdp", "device": "h100-80gb"},
    "scaling": {"model": "gpt-1b@v1", "nodes": 16, "devicesPerNode": 8, "interconnectGBps": 5, "globalBatch": 512},
    "checkpoint": {"mtbfHours": 3.1, "writeSeconds": 60, "restartSeconds": 600, "stepSeconds": 5},
}


@pytest.fixture
async def transport(env: dict, redis) -> AsyncIterator[httpx.ASGITransport]:
    store = StateStore(redis)
    await seed(store)
    await store.add_token(VIEWER, "tenant-a", "vera", role="viewer")
    yield httpx.ASGITransport(app=create_app(ApiContext(ApiSettings(**env), store, Outbox(redis, "api"))))


async def test_a_viewer_runs_the_three_experiments_on_the_planners_numbers(transport) -> None:
    async with client_for("http://api", VIEWER, transport=transport) as c:
        memory = await c.post("/v1/lab/memory", json=BODIES["memory"])
        assert memory.status_code == 200, memory.text
        body = memory.json()
        model = Transformer.from_parameters(7e9)
        expected = estimate_memory(model, Layout(dp=8, zero_stage=ZeroStage.PARAMETERS))
        assert body["perDevice"]["totalBytes"] == pytest.approx(expected.used_bytes_per_device)
        assert body["perDevice"]["parametersBytes"] == pytest.approx(2 * 7e9 / 8)
        assert body["bytesPerParameter"]["total"] == 16 and body["shardingNeededAbove"] > 0

        scaling = await c.post("/v1/lab/scaling", json=BODIES["scaling"])
        assert scaling.status_code == 200, scaling.text
        points = scaling.json()["points"]
        assert [p["devices"] for p in points] == [8, 16, 32, 64, 128]
        faster = await c.post("/v1/lab/scaling", json={**BODIES["scaling"], "interconnectGBps": 50})
        assert all(f["commToCompute"] < s["commToCompute"] for f, s in zip(faster.json()["points"][1:], points[1:]))

        checkpoint = await c.post("/v1/lab/checkpoint", json=BODIES["checkpoint"])
        assert checkpoint.status_code == 200, checkpoint.text
        assert checkpoint.json()["optimumSeconds"] == pytest.approx(young_interval(60, 3.1 * 3600))


@pytest.mark.parametrize(("path", "body", "field"), [
    ("memory", {**BODIES["memory"], "sharding": "zero9"}, "sharding"),
    ("memory", {**BODIES["memory"], "model": "nope@v1"}, "model"),
    ("memory", {**BODIES["memory"], "device": "tpu-v9"}, "device"),
    ("scaling", {**BODIES["scaling"], "tensor": 3}, "tensor"),
    ("scaling", {**BODIES["scaling"], "interconnectGBps": 0}, "interconnectGBps"),
    ("scaling", {**BODIES["scaling"], "nodes": []}, "nodes"),
    ("checkpoint", {**BODIES["checkpoint"], "mtbfHours": -1}, "mtbfHours"),
    ("checkpoint", {"writeSeconds": 60}, "mtbfHours"),
])
async def test_bad_input_is_a_422_naming_the_field(transport, path: str, body: dict, field: str) -> None:
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        resp = await c.post(f"/v1/lab/{path}", json=body)
    assert resp.status_code == 422, resp.text
    assert any(p["field"] == field or p["field"].startswith(f"{field}.") for p in resp.json()["detail"]), resp.text


async def test_no_token_is_refused(transport) -> None:
    async with client_for("http://api", None, transport=transport) as c:
        for path, body in BODIES.items():
            assert (await c.post(f"/v1/lab/{path}", json=body)).status_code == 401
