"""The API against the real broker and Redis: auth, submission (state + event + trace),
validation, tenant isolation, the progress read model, control requests, the process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

from trainyard_api import ApiServer, ApiSettings
from trainyard_cli import infra
from trainyard_api.app import ApiContext, create_app
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import ArtifactRecord, CheckpointRecord, Lineage
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import StateStore
from tests.conftest import env_vars
from tests.support.api import TOKEN_A, TOKEN_B, client_for, running_api, seed, spec_with

# ----------------------------------------------------------------------------- helpers


async def find_record(env: dict, topic: str, match: Callable[[ConsumerRecord], bool],
                      timeout_s: float = 30.0) -> ConsumerRecord:
    """The first record on ``topic`` (this test's namespace) that ``match``es, reading from the start."""
    consumer = AIOKafkaConsumer(
        f"{env['topic_namespace']}{topic}", bootstrap_servers=env["kafka_bootstrap"],
        group_id=None, auto_offset_reset="earliest", enable_auto_commit=False,
    )
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    if match(record):
                        return record
        raise AssertionError(f"no matching record on {topic} within {timeout_s}s")
    finally:
        await consumer.stop()


def event_of(record: ConsumerRecord, cls: type[ev.Event], **fields: Any) -> bool:
    try:
        event = ev.decode_event(cls.topic, record.value)
    except ValueError:
        return False
    return isinstance(event, cls) and all(getattr(event, k) == v for k, v in fields.items())


def header(record: ConsumerRecord, name: str) -> str | None:
    for key, value in record.headers or ():
        if key == name:
            return value.decode()
    return None


async def poll_job(client: httpx.AsyncClient, job_id: str, until: Callable[[dict], bool],
                   timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        resp = await client.get(f"/v1/training-jobs/{job_id}")
        assert resp.status_code == 200, resp.text
        body = resp.json()
        if until(body):
            return body
        await asyncio.sleep(0.2)
    raise AssertionError(f"job never reached the expected state; last: {body.get('progress')}")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
async def server(env: dict) -> AsyncIterator[ApiServer]:
    """The whole API process in-process: uvicorn on a free port + a started ServiceRuntime."""
    async with running_api(env) as api:
        yield api


@pytest.fixture
async def app_url(env: dict, redis) -> AsyncIterator[tuple[httpx.ASGITransport, StateStore]]:
    """The bare app over real Redis (no broker needed): for auth, validation and read paths."""
    store = StateStore(redis)
    await seed(store)
    app = create_app(ApiContext(ApiSettings(**env), store, Outbox(redis, "api")))
    yield httpx.ASGITransport(app=app), store


# ----------------------------------------------------------------------------- auth, validation


async def test_requests_without_a_valid_token_are_401_and_say_how_to_get_one(app_url) -> None:
    transport, _ = app_url
    for token in (None, "wrong-token"):
        async with client_for("http://api", token, transport=transport) as c:
            for method, path in (("GET", "/v1/training-jobs"), ("POST", "/v1/training-jobs"),
                                 ("GET", "/v1/training-jobs/job-000000000000"), ("GET", "/v1/datasets")):
                resp = await c.request(method, path, json=EXAMPLE_SPEC if method == "POST" else None)
                assert resp.status_code == 401, (token, path, resp.text)
                assert resp.headers["www-authenticate"] == "Bearer"
                assert ".trainyard/dev-token" in resp.json()["detail"]
    async with client_for("http://api", None, transport=transport) as c:
        assert (await c.get("/openapi.json")).status_code == 200
        assert (await c.get("/metrics")).status_code == 401  # it names tenants and jobs (test_metrics_access)


async def test_invalid_specs_are_422_naming_every_bad_field(app_url) -> None:
    transport, store = app_url
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        async def problems(spec: dict) -> dict[str, str]:
            resp = await c.post("/v1/training-jobs", json=spec)
            assert resp.status_code == 422, resp.text
            return {d["field"]: d["message"] for d in resp.json()["detail"]}

        bad = spec_with(**{"training.globalBatchSize": 33})
        assert "training.globalBatchSize" in await problems(bad)

        bad = spec_with(**{"resources.gpuCount": 0, "training.learningRate": "fast",
                           "checkpointPolicy.everyMinutes": 5})
        del bad["training"]["maxSteps"]
        found = await problems(bad)
        assert {"resources.gpuCount", "training.learningRate", "training.maxSteps",
                "checkpointPolicy.everySteps"} <= set(found), found

        found = await problems(spec_with(modelConfig="gpt-huge@v9"))
        assert "gpt-huge@v9" in found["modelConfig"] and "gpt-tiny@v1" in found["modelConfig"]

        found = await problems(spec_with(dataset="nosuch@v1"))
        assert "nosuch@v1" in found["dataset"] and "make data" in found["dataset"]

        inline = {"vocabSize": 1024, "nLayers": 1, "nHeads": 4, "dModel": 64, "maxSeqLen": 32}
        found = await problems(spec_with(modelConfig=inline))
        assert "training.sequenceLength" in found and "maxSeqLen" in found["training.sequenceLength"]

        found = await problems(spec_with(modelConfig={**inline, "nHeads": 3}))
        assert "modelConfig.dModel" in found

        resp = await c.post("/v1/training-jobs", content=b"{not json", headers={"content-type": "application/json"})
        assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "body"
    assert await store.list_job_ids("tenant-a") == []


async def test_a_tenant_cannot_see_or_touch_another_tenants_jobs(app_url) -> None:
    transport, store = app_url
    async with client_for("http://api", TOKEN_A, transport=transport) as a, \
            client_for("http://api", TOKEN_B, transport=transport) as b:
        resp = await a.post("/v1/training-jobs", json=EXAMPLE_SPEC)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["jobId"]
        await store.put_checkpoint(CheckpointRecord(
            job_id=job_id, tenant="tenant-a", attempt=1, epoch=1, global_step=20, world_size=2, state="READY",
            manifest_uri="file:///ckpt/manifest.json", content_hash="sha256:" + "c" * 64,
        ))
        await store.put_artifact(ArtifactRecord(
            artifact_id=f"{job_id}/step-20", job_id=job_id, tenant="tenant-a", type="checkpoint",
            uri="file:///ckpt/manifest.json", hash="sha256:" + "c" * 64, producer_attempt=1, global_step=20,
            lineage=Lineage(spec_hash=resp.json()["specHash"], code_revision="local", dataset="tinycorpus@v1"),
        ))

        for path in (f"/v1/training-jobs/{job_id}", f"/v1/training-jobs/{job_id}/checkpoints",
                     f"/v1/registry/artifacts?jobId={job_id}"):
            assert (await a.get(path)).status_code == 200, path
            assert (await b.get(path)).status_code == 404, path
        assert (await b.post(f"/v1/training-jobs/{job_id}/cancel")).status_code == 404
        assert (await b.get("/v1/training-jobs")).json()["jobs"] == []

        listed = (await a.get("/v1/training-jobs")).json()["jobs"]
        assert [j["jobId"] for j in listed] == [job_id]
        ckpts = (await a.get(f"/v1/training-jobs/{job_id}/checkpoints")).json()["checkpoints"]
        assert ckpts[0]["checkpointId"] == "step-000000020-a1" and ckpts[0]["state"] == "READY"
        arts = (await a.get(f"/v1/registry/artifacts?jobId={job_id}")).json()["artifacts"]
        assert arts[0]["lineage"]["dataset"] == "tinycorpus@v1"
        job = (await a.get(f"/v1/training-jobs/{job_id}")).json()
        assert job["checkpoints"][0]["manifestUri"] == "file:///ckpt/manifest.json"
        assert (await a.patch(f"/v1/training-jobs/{job_id}", json={})).status_code == 405


async def test_jobs_started_from_a_job_are_its_children_newest_first(app_url) -> None:
    transport, store = app_url
    async with client_for("http://api", TOKEN_A, transport=transport) as a, \
            client_for("http://api", TOKEN_B, transport=transport) as b:
        parent = (await a.post("/v1/training-jobs", json=EXAMPLE_SPEC)).json()["jobId"]
        await store.put_checkpoint(CheckpointRecord(
            job_id=parent, tenant="tenant-a", attempt=1, epoch=1, global_step=20, world_size=2, state="READY",
            manifest_uri="file:///ckpt/manifest.json", content_hash="sha256:" + "c" * 64, size_bytes=4096,
        ))
        assert (await a.get(f"/v1/training-jobs/{parent}")).json()["children"] == []

        child_spec = spec_with(initFrom={"jobId": parent, "globalStep": 20}, name="child-1")
        first = await a.post("/v1/training-jobs", json=child_spec, headers={"Idempotency-Key": "child-1"})
        assert first.status_code == 202, first.text
        again = await a.post("/v1/training-jobs", json=child_spec, headers={"Idempotency-Key": "child-1"})
        assert again.json()["jobId"] == first.json()["jobId"]  # a retried submission adds no second child
        second = await a.post("/v1/training-jobs", json=spec_with(initFrom={"jobId": parent}, name="child-2"))
        assert second.status_code == 202, second.text
        # another tenant cannot start from it (422), so it never becomes a child
        assert (await b.post("/v1/training-jobs", json=spec_with(initFrom={"jobId": parent}))).status_code == 422

        view = (await a.get(f"/v1/training-jobs/{parent}")).json()
        assert view["children"] == [second.json()["jobId"], first.json()["jobId"]]
        assert view["checkpoints"][0]["sizeBytes"] == 4096
        child = (await a.get(f"/v1/training-jobs/{first.json()['jobId']}")).json()
        assert child["spec"]["initFrom"]["jobId"] == parent and child["children"] == []


# ----------------------------------------------------------------------------- with the broker


async def test_submission_stores_the_job_and_publishes_job_submitted_in_the_request_trace(
    server: ApiServer, env: dict
) -> None:
    async with client_for(server.url, TOKEN_A) as c:
        resp = await c.post("/v1/training-jobs", json=EXAMPLE_SPEC)
        assert resp.status_code == 202, resp.text
        body = resp.json()
        job_id = body["jobId"]
        assert set(body) == {"jobId", "state", "specHash"} and body["state"] == "queued"
        assert job_id.startswith("job-") and len(job_id) == 16
        assert body["specHash"] == TrainingSpec.model_validate(EXAMPLE_SPEC).spec_hash()
        assert resp.headers["location"] == f"{server.url}/v1/training-jobs/{job_id}"

        job = (await c.get(f"/v1/training-jobs/{job_id}")).json()
        assert (job["state"], job["tenant"], job["submittedBy"]) == ("queued", "tenant-a", "alice")
        assert job["progress"]["globalStep"] == 0 and job["progress"]["maxSteps"] == 40
        assert job["attempts"] == [] and job["checkpoints"] == []

        # more GPUs than any cluster has: accepted, waits in the queue
        huge = spec_with(**{"resources.gpuCount": 4096, "parallelism.data": 4096, "training.globalBatchSize": 32768})
        resp = await c.post("/v1/training-jobs", json=huge)
        assert resp.status_code == 202 and resp.json()["state"] == "queued"

        # a retried POST with the same Idempotency-Key is the same job; another spec with it is a 409
        first = await c.post("/v1/training-jobs", json=EXAMPLE_SPEC, headers={"Idempotency-Key": "k1"})
        again = await c.post("/v1/training-jobs", json=EXAMPLE_SPEC, headers={"Idempotency-Key": "k1"})
        assert first.status_code == again.status_code == 202
        assert first.json()["jobId"] == again.json()["jobId"] and again.headers["idempotent-replayed"] == "true"
        other = await c.post("/v1/training-jobs", json=spec_with(name="other"), headers={"Idempotency-Key": "k1"})
        assert other.status_code == 409

        page = (await c.get("/v1/training-jobs", params={"limit": 2})).json()
        assert len(page["jobs"]) == 2 and page["nextOffset"] == 2
        rest = (await c.get("/v1/training-jobs", params={"offset": 2})).json()
        assert len(rest["jobs"]) == 1 and rest["nextOffset"] is None
        assert len((await c.get("/v1/training-jobs", params={"state": "queued"})).json()["jobs"]) == 3
        assert (await c.get("/v1/training-jobs", params={"state": "running"})).json()["jobs"] == []

        health = await c.get("/healthz")
        assert health.status_code == 200 and health.json()["broker"] is True

    stored = await server.runtime.store.get_job(job_id)
    assert stored is not None and stored.traceparent
    record = await find_record(env, ev.JOBS, lambda r: event_of(r, ev.JobSubmitted, job_id=job_id))
    assert record.key == job_id.encode()
    published = ev.decode_event(ev.JOBS, record.value)
    assert isinstance(published, ev.JobSubmitted) and published.tenant == "tenant-a"
    assert published.spec_hash == body["specHash"] and published.submitted_by == "alice"
    trace_id = stored.traceparent.split("-")[1]
    assert header(record, "traceparent").split("-")[1] == trace_id
    deadline = time.monotonic() + 30
    while await server.runtime.outbox.pending() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await server.runtime.outbox.pending() == 0  # every staged event was relayed


async def test_progress_follows_rank0_step_metrics_and_survives_a_malformed_message(
    server: ApiServer, env: dict
) -> None:
    async with client_for(server.url, TOKEN_A) as c:
        job_id = (await c.post("/v1/training-jobs", json=EXAMPLE_SPEC)).json()["jobId"]
        bus = Bus(env["kafka_bootstrap"], service_name="metrics-test", topic_namespace=env["topic_namespace"])
        async with bus:
            def metrics(step: int, *, rank: int = 0, attempt: int = 1, loss: float = 2.0) -> ev.StepMetrics:
                return ev.StepMetrics(job_id=job_id, tenant="tenant-a", attempt=attempt, rank=rank, step=step,
                                      max_steps=40, loss=loss, lr=1e-3, consumed_tokens=step * 2048,
                                      tokens_per_second=5000.0)

            await bus.publish(metrics(5, loss=3.5))
            job = await poll_job(c, job_id, lambda j: j["progress"]["globalStep"] == 5)
            assert job["progress"]["lastLoss"] == 3.5 and job["progress"]["consumedTokens"] == 5 * 2048

            # another rank's metrics and an older step change nothing; rank 0's next step does
            await bus.publish(metrics(9, rank=1, loss=9.9))
            await bus.publish(metrics(3, loss=7.7))
            await bus.publish_raw(ev.METRICS, b'{"eventType": "StepMetrics", "step": "not-a-number"', key=job_id)
            await bus.publish(metrics(6, loss=3.0))
            job = await poll_job(c, job_id, lambda j: j["progress"]["globalStep"] >= 6)
            assert job["progress"]["globalStep"] == 6 and job["progress"]["lastLoss"] == 3.0

            # a new attempt resumed from an earlier checkpoint replaces the old attempt's progress
            await bus.publish(metrics(4, attempt=2, loss=2.5))
            job = await poll_job(c, job_id, lambda j: j["progress"]["attempt"] == 2)
            assert job["progress"]["globalStep"] == 4

    # the malformed message is dead-lettered by the consumer that keeps progress: the telemetry service's group
    # (other tests' consumers on this broker may dead-letter their own copies of malformed metrics)
    def telemetrys(r: object) -> bool:
        return event_of(r, ev.DeadLetter, source_topic=ev.METRICS) and \
            ev.decode_event(ev.DEADLETTER, r.value).consumer_group.endswith(".telemetry-metrics")  # type: ignore[attr-defined]

    letter = await find_record(env, ev.DEADLETTER, telemetrys)
    dead = ev.decode_event(ev.DEADLETTER, letter.value)
    assert isinstance(dead, ev.DeadLetter) and dead.consumer_group.endswith(".telemetry-metrics") and dead.error


async def test_cancel_and_pause_publish_control_requests_and_a_finished_job_is_409(
    server: ApiServer, env: dict
) -> None:
    async with client_for(server.url, TOKEN_A) as c:
        job_id = (await c.post("/v1/training-jobs", json=EXAMPLE_SPEC)).json()["jobId"]
        resp = await c.post(f"/v1/training-jobs/{job_id}/pause")
        assert resp.status_code == 202 and resp.json()["action"] == "pause"
        assert (await c.post(f"/v1/training-jobs/{job_id}/resume")).status_code == 409  # not paused
        resp = await c.post(f"/v1/training-jobs/{job_id}/cancel")
        assert resp.status_code == 202 and resp.json() == {
            "jobId": job_id, "action": "cancel", "state": "queued", "accepted": True}

        for action in ("pause", "cancel"):
            record = await find_record(
                env, ev.JOBS, lambda r, a=action: event_of(r, ev.JobControlRequested, job_id=job_id, action=a))
            assert record.key == job_id.encode()

        store = server.runtime.store
        job = await store.get_job(job_id)
        assert job is not None
        await store.put_job(job.model_copy(update={"state": "cancelled", "reason": "cancelled by alice"}))
        resp = await c.post(f"/v1/training-jobs/{job_id}/cancel")
        assert resp.status_code == 409 and "cancelled" in resp.json()["detail"]


# ----------------------------------------------------------------------------- the process


async def test_the_api_process_serves_refuses_a_taken_port_and_stops_cleanly_on_sigterm(env: dict) -> None:
    port = infra.free_port()
    environ = {**os.environ, **env_vars(env), "TRAINYARD_API_PORT": str(port), "TRAINYARD_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "trainyard_api"], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        healthy = False
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=2.0) as c:
            while time.monotonic() < deadline and proc.poll() is None and not healthy:
                try:
                    healthy = (await c.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.3)
        assert healthy, proc.stdout.read().decode() if proc.poll() is not None else "no /healthz within 60s"

        second = subprocess.run([sys.executable, "-m", "trainyard_api"], env=environ, capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 2
        assert f"127.0.0.1:{port}" in second.stderr and "TRAINYARD_API_PORT" in second.stderr

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_healthz_is_degraded_while_any_services_consumer_is_stuck_on_one_record(env: dict, server) -> None:
    """A service whose handler keeps failing on one record (Redis refusing it, say) reports it with its health
    beacon; /healthz names it (200: the API itself still serves) until the record is handled."""
    from trainyard_runtime.retry import RetryPolicy
    from trainyard_contract.errors import StateStoreError
    from trainyard_runtime.service import ServiceRuntime
    from trainyard_contract.settings import ServiceSettings

    failing = True

    async def on_heartbeat(e: ev.NodeHeartbeat) -> None:
        if failing:
            raise StateStoreError("refused (test)")

    probe = ServiceRuntime("probe", ServiceSettings(**env, health_interval_s=0.2), outbox_name="probe")
    probe.bus.subscribe(ev.NODES, {ev.NodeHeartbeat: on_heartbeat},
                        retry=RetryPolicy(initial_interval_s=0.01, maximum_interval_s=0.05), stuck_after=3)

    async def health() -> dict[str, Any]:
        async with client_for(server.url, None) as c:
            resp = await c.get("/healthz")
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def until(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while not pred(body := await health()):
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.1)
        return body

    async with probe:
        await probe.bus.publish(ev.NodeHeartbeat(node_id="n1", host="h", seq=1,
                                                 devices=[ev.DeviceInfo(index=0, type="cpu", memory_bytes=1)]))
        body = await until(lambda b: any(s["service"] == "probe" for s in b["stuckConsumers"]))
        assert body["status"] == "degraded"
        [stuck] = [s for s in body["stuckConsumers"] if s["service"] == "probe"]
        assert stuck["topic"] == ev.NODES and stuck["tries"] >= 3 and "refused" in stuck["error"]
        failing = False
        body = await until(lambda b: not b["stuckConsumers"])
        assert body["status"] == "ok"
