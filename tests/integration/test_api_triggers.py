"""Triggers against real Redis and, for the consumer, the whole API process over the real broker: the
routes (template checked like a submission, tenant-scoped, roles), and a registered dataset version
submitting exactly one job per matching trigger, with lineage, whatever is delivered again."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from trainyard_api import ApiServer, ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_api.schemas import EXAMPLE_TEMPLATE
from trainyard_contract.events import ArtifactRegistered
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import DELETED_TENANT_SETTINGS, DatasetRecord, TriggerRecord
from trainyard_runtime.store import Keys, StateStore
from tests.support.api import TOKEN_A, TOKEN_B, client_for, running_api, seed

TOKEN_VIEWER = "token-tenant-a-viewer"


def trigger_body(name: str = "tiny", dataset: str = "tiny*", sources: list[str] | None = None,
                 **template: Any) -> dict[str, Any]:
    return {"name": name, "dataset": dataset, "sources": sources or ["platform"],
            "template": {**EXAMPLE_TEMPLATE, **template}}


@pytest.fixture
async def app(env: dict, redis) -> AsyncIterator[httpx.ASGITransport]:
    """The bare app over real Redis (the routes need no broker)."""
    store = StateStore(redis)
    await seed(store)
    await store.add_token(TOKEN_VIEWER, "tenant-a", "vera", role="viewer")
    yield httpx.ASGITransport(app=create_app(ApiContext(ApiSettings(**env), store, Outbox(redis, "api"))))


async def test_a_trigger_is_created_listed_read_and_deleted_by_its_tenant_only(app) -> None:
    async with client_for("http://api", TOKEN_A, transport=app) as a, \
            client_for("http://api", TOKEN_B, transport=app) as b:
        resp = await a.post("/v1/triggers", json=trigger_body())
        assert resp.status_code == 201, resp.text
        created = resp.json()
        trigger_id = created["triggerId"]
        assert (created["tenant"], created["dataset"], created["sources"], created["enabled"]) == (
            "tenant-a", "tiny*", ["platform"], True)
        assert "dataset" not in created["template"] and created["jobs"] == [] and created["lastFailure"] is None

        assert (await a.post("/v1/triggers", json=trigger_body())).status_code == 409  # one name per tenant
        assert [t["triggerId"] for t in (await a.get("/v1/triggers")).json()["triggers"]] == [trigger_id]
        assert (await a.get(f"/v1/triggers/{trigger_id}")).json()["name"] == "tiny"

        # another tenant's trigger is as invisible as a missing one; the same name is its own to use
        assert (await b.get("/v1/triggers")).json()["triggers"] == []
        assert (await b.get(f"/v1/triggers/{trigger_id}")).status_code == 404
        assert (await b.delete(f"/v1/triggers/{trigger_id}")).status_code == 404
        assert (await b.post("/v1/triggers", json=trigger_body())).status_code == 201

        resp = await a.delete(f"/v1/triggers/{trigger_id}")
        assert resp.status_code == 200 and resp.json()["triggerId"] == trigger_id
        assert (await a.get(f"/v1/triggers/{trigger_id}")).status_code == 404
        assert (await a.post("/v1/triggers", json=trigger_body())).status_code == 201  # the name is free again


async def test_a_viewer_may_read_triggers_but_not_create_or_delete_them(app) -> None:
    async with client_for("http://api", TOKEN_A, transport=app) as a, \
            client_for("http://api", TOKEN_VIEWER, transport=app) as viewer:
        trigger_id = (await a.post("/v1/triggers", json=trigger_body())).json()["triggerId"]
        resp = await viewer.post("/v1/triggers", json=trigger_body(name="other"))
        assert resp.status_code == 403 and "submitter" in resp.json()["detail"]
        assert (await viewer.delete(f"/v1/triggers/{trigger_id}")).status_code == 403
        assert (await viewer.get(f"/v1/triggers/{trigger_id}")).status_code == 200


async def test_the_template_is_checked_as_a_submission_is_and_its_problems_named_under_template(app) -> None:
    async with client_for("http://api", TOKEN_A, transport=app) as a:
        async def problems(body: dict[str, Any]) -> dict[str, str]:
            resp = await a.post("/v1/triggers", json=body)
            assert resp.status_code == 422, resp.text
            return {d["field"]: d["message"] for d in resp.json()["detail"]}

        assert "template.resources.gpus" in await problems(trigger_body(resources={"gpuType": "cpu", "gpus": 2}))
        found = await problems(trigger_body(modelConfig="gpt-huge@v9"))
        assert set(found) == {"template.modelConfig"} and "unknown model" in found["template.modelConfig"], found
        found = await problems(trigger_body(training={**EXAMPLE_TEMPLATE["training"], "sequenceLength": 100_000}))
        assert "template.training.sequenceLength" in found, found
        assert "template.dataset" in await problems(trigger_body(dataset="tiny*") | {
            "template": {**EXAMPLE_TEMPLATE, "dataset": "tinycorpus@v1"}})
        assert {"dataset", "sources[0]"} <= set(await problems(trigger_body(dataset="a/b", sources=["all"])))
        assert (await a.get("/v1/triggers")).json()["triggers"] == []  # nothing stored


# ----------------------------------------------------------------------------- the consumer


async def eventually(what: str, probe: Callable[[], Awaitable[Any]], timeout_s: float = 60.0) -> Any:
    """``probe()``'s first truthy answer, polled within ``timeout_s`` (then a failure saying ``what``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answer := await probe():
            return answer
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s")


def dataset_registered(ref: str, owner: str | None, shared_with: list[str] | None = None,
                       event_id: uuid.UUID | None = None) -> ArtifactRegistered:
    """What the registry publishes for a verified dataset version."""
    return ArtifactRegistered(
        **({"event_id": event_id} if event_id else {}), artifact_id=ref, kind="dataset", tenant=owner,
        uri=f"file:///data/{ref}/manifest.json", hash="sha256:" + "ab" * 32, dataset=ref,
        shared_with=shared_with or [], tokenizer="bpe-1024@v1", num_tokens=123_456)


async def verified(store: StateStore, name: str, version: str) -> None:
    """A platform dataset version recorded as the registry records one."""
    await store.put_dataset(DatasetRecord(name=name, version=version, manifest_uri=f"file:///data/{name}/{version}/"
                                          "manifest.json", sha256="ab" * 32, tokenizer="bpe-1024@v1", num_tokens=9))


@pytest.fixture
async def server(env: dict) -> AsyncIterator[ApiServer]:
    # one partition: the registry's events are handled in the order published, so the last one handled
    # says every earlier one was
    async with running_api(env, topic_partitions=1) as api:
        yield api


async def test_a_new_dataset_version_submits_one_job_per_matching_trigger_whatever_is_delivered_again(
    server: ApiServer,
) -> None:
    store, bus = server.runtime.store, server.runtime.bus
    async with client_for(server.url, TOKEN_A) as a, client_for(server.url, TOKEN_B) as b:
        tiny = (await a.post("/v1/triggers", json=trigger_body(sources=["own", "platform", "shared"]))).json()
        broken = (await a.post("/v1/triggers", json=trigger_body(name="broken", dataset="broken*"))).json()
        # the catalog moves on after creation: the stored template names a model it no longer has
        record = TriggerRecord.model_validate_json(await store.redis.hget(Keys.triggers, broken["triggerId"]))
        retired = record.model_copy(update={"template": {**record.template, "modelConfig": "gpt-retired@v1"}})
        await store.redis.hset(Keys.triggers, broken["triggerId"], retired.dumps())
        # tenant-b's trigger would match too, but tenant-b is deleted (as DELETE /v1/admin/tenants/… leaves it)
        gone = (await b.post("/v1/triggers", json=trigger_body())).json()
        await store.redis.hset(Keys.tenant_config, "tenant-b", DELETED_TENANT_SETTINGS)
        for name, version in (("tinycorpus", "v2"), ("tinycorpus", "v3"), ("brokencorpus", "v1"), ("books", "v1")):
            await verified(store, name, version)
        # tenant-a has a tinycorpus@v3 of its own: the platform's v3, unqualified, would resolve to it
        own = DatasetRecord(name="tinycorpus", version="v3", manifest_uri="file:///own/manifest.json", sha256="cd" * 32)
        await store.redis.hset(Keys.datasets, "tenant-a/tinycorpus@v3", own.dumps())

        async def jobs_of(trigger_id: str) -> dict[str, str]:
            resp = await a.get(f"/v1/triggers/{trigger_id}")
            assert resp.status_code == 200, resp.text
            return {j["dataset"]: j["jobId"] for j in resp.json()["jobs"]}

        # 1. the platform's tinycorpus@v1 is registered: the tiny trigger submits its job
        first = dataset_registered("tinycorpus@v1", None)
        await bus.publish(first)
        started = await eventually("the trigger's job", lambda: jobs_of(tiny["triggerId"]))
        assert list(started) == ["tinycorpus@v1"]
        job = (await a.get(f"/v1/training-jobs/{started['tinycorpus@v1']}")).json()
        assert job["spec"]["dataset"] == "tinycorpus@v1" and job["state"] == "queued"
        assert job["spec"]["modelConfig"] == EXAMPLE_TEMPLATE["modelConfig"]
        assert job["submittedBy"] == "trigger:tiny"
        assert job["triggeredBy"] == {"triggerId": tiny["triggerId"], "triggerName": "tiny",
                                      "dataset": "tinycorpus@v1", "eventId": str(first.event_id)}

        # 2. delivered again, published again (a fresh event; and with the trigger's record of the job lost,
        #    so that only the submission's Idempotency-Key stands between it and a second job), a name no
        #    trigger matches, another tenant's dataset not shared with tenant-a, a trigger whose template no
        #    longer validates, a platform version tenant-a's own shadows; then tinycorpus@v2, which is handled
        #    after all of them
        await store.redis.hdel(Keys.trigger_jobs(tiny["triggerId"]), "tinycorpus@v1")
        for event in (first, dataset_registered("tinycorpus@v1", None, event_id=uuid.uuid4()),
                      dataset_registered("books@v1", None),
                      dataset_registered("tenant-b/tinycorpus@v1", "tenant-b", ["tenant-c"]),
                      dataset_registered("brokencorpus@v1", None),
                      dataset_registered("tinycorpus@v3", None),
                      dataset_registered("tinycorpus@v2", None)):
            await bus.publish(event)
        await eventually("the job for tinycorpus@v2", lambda: _has(jobs_of(tiny["triggerId"]), "tinycorpus@v2"))

        second = (await jobs_of(tiny["triggerId"]))["tinycorpus@v2"]
        assert await jobs_of(tiny["triggerId"]) == {"tinycorpus@v1": started["tinycorpus@v1"],
                                                    "tinycorpus@v2": second}
        listed = (await a.get("/v1/training-jobs")).json()["jobs"]
        assert sorted(j["dataset"] for j in listed) == ["tinycorpus@v1", "tinycorpus@v2"]  # nothing else started
        assert (await b.get("/v1/training-jobs")).json()["jobs"] == []

        view = (await a.get(f"/v1/triggers/{broken['triggerId']}")).json()
        assert view["jobs"] == []
        failure = view["lastFailure"]
        assert failure["dataset"] == "brokencorpus@v1" and "does not validate" in failure["message"]
        assert [p["field"] for p in failure["problems"]] == ["modelConfig"]
        assert "gpt-retired@v1" in failure["problems"][0]["message"]
        shadowed = (await a.get(f"/v1/triggers/{tiny['triggerId']}")).json()["lastFailure"]
        assert shadowed["dataset"] == "tinycorpus@v3" and "tenant-a/tinycorpus@v3" in shadowed["message"]
        view = (await b.get(f"/v1/triggers/{gone['triggerId']}")).json()
        assert view["jobs"] == [] and "was deleted" in view["lastFailure"]["message"]


async def _has(jobs: Awaitable[dict[str, str]], dataset: str) -> bool:
    return dataset in await jobs
