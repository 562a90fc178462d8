"""Capacity planning through the API against the real Redis and broker: ``POST /v1/plan`` and the
memory check at submission (422 naming the fields, or 202 with a warning)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from trainyard_api import ApiServer, ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract import events as ev
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import StateStore
from tests.integration.test_api import event_of, find_record
from tests.support.api import TOKEN_A, client_for, seed, spec_with

# 39B parameters: 625 GB of fp32 AdamW states on one 80 GB H100
BIG = {"vocabSize": 50304, "nLayers": 48, "nHeads": 64, "dModel": 8192, "maxSeqLen": 2048}
# 4.0B parameters: 71.9 GB on one 80 GB H100, inside the memory but not the 15 % headroom
SNUG = {"vocabSize": 50304, "nLayers": 34, "nHeads": 24, "dModel": 3072, "maxSeqLen": 2048}


def on_one_h100(model: dict) -> dict:
    return spec_with(**{
        "modelConfig": model, "resources": {"gpuType": "h100-80gb", "gpuCount": 1}, "parallelism": {"data": 1},
        "training.sequenceLength": 2048, "training.microBatchSize": 1, "training.globalBatchSize": 4,
    })


@pytest.fixture
async def app_url(env: dict, redis) -> AsyncIterator[tuple[httpx.ASGITransport, StateStore]]:
    """The bare app over real Redis (tokens, dataset registry, job store)."""
    store = StateStore(redis)
    await seed(store)
    yield httpx.ASGITransport(app=create_app(ApiContext(ApiSettings(**env), store, Outbox(redis, "api")))), store


async def test_plan_answers_memory_step_compute_and_checkpoint_in_camel_case(app_url) -> None:
    transport, _ = app_url
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        resp = await c.post("/v1/plan", json={"model": {"parameters": 70e9}, "layout": {"dp": 1, "zeroStage": 0}})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["memory"]["modelStatesBytesPerDevice"] == pytest.approx(1.12e12)
        assert body["step"]["bottleneck"] == "memory" and body["step"]["fits"] is False
        assert "recommendation" not in body and "checkpoint" not in body

        resp = await c.post("/v1/plan", json={
            "model": "gpt-1b@v1", "device": "h100-80gb", "devices": 8, "tokens": 26e9,
            "layout": {"dp": 8, "zeroStage": 3, "microBatch": 4, "microbatches": 2},
            "checkpoint": {"writeBandwidth": 2e9, "deviceMtbfHours": 50_000, "keepLast": 3, "jobs": 10},
        })
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert set(body) == {"model", "device", "devices", "topology", "memory", "step", "compute", "checkpoint"}
        assert body["step"]["layout"]["zeroStage"] == 3 and body["step"]["comm"]["dpTier"] == "nvlink"
        assert body["compute"]["trainingTime"]["days"] > 0 and body["device"]["memoryBytes"] == 80e9
        assert body["checkpoint"]["storageBytes"] == pytest.approx(30 * body["checkpoint"]["sizeBytes"])
        assert body["checkpoint"]["dalyIntervalSeconds"] < body["checkpoint"]["youngIntervalSeconds"]


async def test_plan_recommends_layouts_and_says_why_the_others_fail(app_url) -> None:
    transport, _ = app_url
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        resp = await c.post("/v1/plan", json={"model": {"parameters": 70e9}, "layout": "recommend",
                                              "device": "h100", "devices": 64, "globalBatch": 256, "limit": 2})
        assert resp.status_code == 200, resp.text
        rec = resp.json()["recommendation"]
        assert rec["acceptedCount"] > 0 and len(rec["accepted"]) == 2
        assert rec["accepted"][0]["memory"]["requiredBytesPerDevice"] <= 80e9
        assert rec["rejected"][0]["reasons"][0].endswith("GB per device, 80 GB available")


async def test_plan_input_errors_are_422_naming_the_field_and_a_token_is_required(app_url) -> None:
    transport, _ = app_url
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        async def fields(body: dict) -> dict[str, str]:
            resp = await c.post("/v1/plan", json=body)
            assert resp.status_code == 422, resp.text
            return {d["field"]: d["message"] for d in resp.json()["detail"]}

        assert "gpt-tiny@v1" in (await fields({"model": "gpt-huge@v9"}))["model"]
        assert "must equal devices" in (await fields({"model": "gpt-tiny@v1", "devices": 4,
                                                     "layout": {"dp": 2}}))["layout"]
        assert "known" in (await fields({"model": "gpt-tiny@v1", "device": "tpu-v9"}))["device"]
        assert "globalBatch" in await fields({"model": "gpt-tiny@v1", "layout": "recommend"})
        assert "layout.zeroStage" in await fields({"model": "gpt-tiny@v1", "layout": {"zeroStage": 7}})
        assert "headroom" in await fields({"model": "gpt-tiny@v1", "headroom": 1.5})
    async with client_for("http://api", None, transport=transport) as anonymous:
        assert (await anonymous.post("/v1/plan", json={"model": "gpt-tiny@v1"})).status_code == 401


async def test_a_spec_that_cannot_fit_is_422_naming_model_and_resources(app_url) -> None:
    transport, store = app_url
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        resp = await c.post("/v1/training-jobs", json=on_one_h100(BIG))
        assert resp.status_code == 422, resp.text
        found = {d["field"]: d["message"] for d in resp.json()["detail"]}
        assert set(found) == {"modelConfig", "resources.gpuType"}
        assert "needs 653.3 GB per device, 80 GB available" in found["modelConfig"]
        assert "h100-80gb has 80 GB per device" in found["resources.gpuType"]

        # other problems are reported together with the memory one
        resp = await c.post("/v1/training-jobs", json={**on_one_h100(BIG), "dataset": "nosuch@v1"})
        assert {d["field"] for d in resp.json()["detail"]} == {"modelConfig", "resources.gpuType", "dataset"}
    assert await store.list_job_ids("tenant-a") == []


async def test_a_snug_spec_is_accepted_with_a_warning_and_announced(env: dict) -> None:
    async with ApiServer(ApiSettings(**env, api_port=0)) as api:
        await seed(api.runtime.store)
        async with client_for(api.url, TOKEN_A) as c:
            resp = await c.post("/v1/training-jobs", json=on_one_h100(SNUG))
            assert resp.status_code == 202, resp.text
            body = resp.json()
            assert body["state"] == "queued" and len(body["warnings"]) == 1
            assert "71.9 GB of the 80 GB" in body["warnings"][0] and "headroom" in body["warnings"][0]

            plain = await c.post("/v1/training-jobs", json=EXAMPLE_SPEC)  # cpu ranks: nothing to say
            assert plain.status_code == 202 and "warnings" not in plain.json()

            plan = await c.post("/v1/plan", json={"model": SNUG, "layout": {"recompute": "selective"},
                                                  "precision": "fp32", "sequenceLength": 2048})
            assert plan.status_code == 200
            assert plan.json()["memory"]["usedBytesPerDevice"] == pytest.approx(71.9e9, rel=1e-3)
    await find_record(env, ev.JOBS, lambda r: event_of(r, ev.JobSubmitted, job_id=body["jobId"]))
