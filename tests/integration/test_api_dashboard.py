"""The data behind the dashboard, through a real API process, broker and Redis: metric history
(every rank, a resumed attempt replaying steps), rank logs, live updates (SSE), the cluster views."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import jsonschema
import pytest
from typer.testing import CliRunner

from trainyard_api import ApiServer
from trainyard_telemetry.metrics_history import MetricHistory
from trainyard_cli.main import app as cli
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_contract.records import AttemptRecord, JobRecord, NodeRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from tests.integration.test_api_calibration import eventually
from tests.support.api import TOKEN_A, TOKEN_ADMIN, TOKEN_B, client_for, running_api, spec_with

pytestmark = pytest.mark.integration
ADMIN = TOKEN_ADMIN


@pytest.fixture
async def api(env: dict) -> AsyncIterator[ApiServer]:
    async with running_api(env, admin=True) as server:  # seeded, with the operator's token (ADMIN)
        yield server


@pytest.fixture
async def bus(env: dict) -> AsyncIterator[Bus]:
    b = Bus(env["kafka_bootstrap"], service_name="test-dashboard", group_prefix=env["group_prefix"],
            topic_namespace=env["topic_namespace"])
    await b.start()
    try:
        yield b
    finally:
        await b.aclose()


async def given_job(api: ApiServer, job_id: str, *, tenant: str = "tenant-a", state: str = "running",
                    attempts: int = 2, devices: list[str] | None = None, priority: int = 0) -> JobRecord:
    spec = TrainingSpec.model_validate(spec_with())
    job = JobRecord(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash(), state=state,
                    priority=priority, queued_reason="waiting for 2 x cpu" if state == "queued" else None,
                    queued_reason_kind="capacity" if state == "queued" else None,
                    attempts=[AttemptRecord(attempt=n, allocation_id=f"a{n}", epoch=n, world_size=2,
                                            state="running" if n == attempts else "failed",
                                            devices=devices or [] if n == attempts else [])
                              for n in range(1, attempts + 1)])
    await api.runtime.store.create_job(job)
    return job


def metrics(job_id: str, attempt: int, step: int, rank: int, loss: float) -> ev.StepMetrics:
    return ev.StepMetrics(job_id=job_id, tenant="tenant-a", attempt=attempt, rank=rank, step=step, loss=loss,
                          consumed_tokens=step * 10, step_seconds=1.0 + rank, compute_seconds=0.5 + rank,
                          metrics={"gradNorm": float(step)})


async def test_metric_history_keeps_every_step_of_every_rank_and_the_newest_attempt_wins(
    api: ApiServer, bus: Bus,
) -> None:
    job_id = "job-history"
    await given_job(api, job_id)
    for step in range(1, 31):  # attempt 1: steps 1..30 on both ranks
        for rank in (0, 1):
            await bus.publish(metrics(job_id, 1, step, rank, loss=1.0))
    for step in range(21, 41):  # attempt 2 resumed from step 20 and replays 21..30
        for rank in (0, 1):
            await bus.publish(metrics(job_id, 2, step, rank, loss=2.0))
    await bus.publish(metrics(job_id, 1, 25, 0, loss=99.0))  # a late event of the old attempt
    await bus.publish(metrics(job_id, 2, 40, 0, loss=2.0))  # a redelivery

    async with client_for(api.url, TOKEN_A) as client:
        async def stored() -> dict | None:
            r = await client.get(f"/v1/training-jobs/{job_id}/metrics", params={"series": "loss,gradNorm"})
            body = r.json()
            return body if r.status_code == 200 and body["series"]["loss"]["steps"][-1:] == [40] else None

        body = await eventually(stored, "the history up to step 40", timeout_s=60)
        loss = body["series"]["loss"]
        assert loss["steps"] == list(range(1, 41)) and loss["totalPoints"] == 40 and body["method"] == "all"
        assert loss["values"] == [1.0] * 20 + [2.0] * 20
        assert body["series"]["gradNorm"]["values"] == [float(s) for s in range(1, 41)]

        small = (await client.get(f"/v1/training-jobs/{job_id}/metrics",
                                  params={"series": "loss", "maxPoints": 10, "fromStep": 5, "toStep": 35})).json()
        assert (small["method"], small["fromStep"], small["toStep"]) == ("lttb", 5, 35)
        assert len(small["series"]["loss"]["steps"]) == 10 and small["series"]["loss"]["totalPoints"] == 31
        assert small["series"]["loss"]["steps"][0] == 5 and small["series"]["loss"]["steps"][-1] == 35

        heat = (await client.get(f"/v1/training-jobs/{job_id}/metrics",
                                 params={"series": "computeSeconds", "byRank": "true", "maxPoints": 8})).json()
        assert sorted(heat["ranks"]) == ["0", "1"]
        r0, r1 = heat["ranks"]["0"]["computeSeconds"], heat["ranks"]["1"]["computeSeconds"]
        assert r0["steps"] == r1["steps"] and len(r0["steps"]) == 8
        assert set(r0["values"]) == {0.5} and set(r1["values"]) == {1.5} and r1["totalPoints"] == 40

        bad = await client.get(f"/v1/training-jobs/{job_id}/metrics", params={"series": "loss,nope"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "query.series"
        ranks = (await client.get(f"/v1/training-jobs/{job_id}/ranks")).json()
        assert ranks["reportedRanks"] == [0, 1] and [a["attempt"] for a in ranks["attempts"]] == [1, 2]
    async with client_for(api.url, TOKEN_B) as other:
        assert (await other.get(f"/v1/training-jobs/{job_id}/metrics")).status_code == 404


async def test_every_method_answers_the_least_max_points_and_the_view_always_carries_its_step_range(
    api: ApiServer,
) -> None:
    """``method=minmax&maxPoints=2`` was a 500 (a panic inside tsdownsample); an empty window dropped
    ``fromStep``/``toStep``, which the document declares required (a generated client raised KeyError)."""
    job_id = "job-small-answers"
    await given_job(api, job_id, attempts=1)
    history = MetricHistory(api.runtime.store.redis)
    losses = [3.0, 1.0, 4.0, 1.5, 9.0, 2.0, 0.5, 6.0, 5.0, 3.5]  # the extremes: 9.0 at step 5, 0.5 at step 7
    for step, loss in enumerate(losses, start=1):
        for rank in (0, 1):
            await history.on_step_metrics(metrics(job_id, 1, step, rank, loss=loss))
    url = f"/v1/training-jobs/{job_id}/metrics"
    async with client_for(api.url, TOKEN_A) as client:
        for method in ("lttb", "minmax"):
            for max_points in (2, 3):
                r = await client.get(url, params={"series": "loss", "method": method, "maxPoints": max_points})
                assert r.status_code == 200, (method, max_points, r.text)
                body, loss = r.json(), r.json()["series"]["loss"]
                assert (body["method"], body["fromStep"], body["toStep"]) == (method, 0, 10)
                assert len(loss["steps"]) <= max_points and loss["totalPoints"] == 10
                assert loss["values"] == [losses[s - 1] for s in loss["steps"]]
                if method == "minmax":
                    assert loss["steps"] == [5, 7] and loss["values"] == [9.0, 0.5]
                else:
                    assert loss["steps"][0] == 1 and loss["steps"][-1] == 10
        heat = await client.get(url, params={"series": "computeSeconds", "byRank": "true", "maxPoints": 2})
        assert heat.status_code == 200 and len(heat.json()["ranks"]["1"]["computeSeconds"]["steps"]) == 2

        # past what is stored: the range asked (null where not asked), but always both keys
        for window in ({"fromStep": 1000}, {"fromStep": 50, "toStep": 60}, {"fromStep": 11, "byRank": "true"}):
            empty = await client.get(url, params={"series": "loss", **window})
            body = empty.json()
            assert empty.status_code == 200 and body["series"]["loss"]["steps"] == [], body
            assert (body["fromStep"], body["toStep"]) == (window["fromStep"], window.get("toStep")), body
        plain = (await client.get(url, params={"series": "loss"})).json()
        assert "ranks" not in plain and "min" not in plain["series"]["loss"]  # absent, not null, when not asked


async def test_rank_logs_tail_and_follow_until_the_attempt_ends(api: ApiServer, env: dict) -> None:
    job_id = "job-logs"
    job = await given_job(api, job_id, attempts=1)
    path = ArtifactLayout(env["artifact_root"]).rank_log("tenant-a", job_id, 1, 1)
    path.parent.mkdir(parents=True)
    path.write_text("".join(f"line {i}\n" for i in range(10)))
    async with client_for(api.url, TOKEN_A) as client:
        r = await client.get(f"/v1/training-jobs/{job_id}/logs", params={"rank": 1, "tail": 2})
        assert r.status_code == 200 and r.text == "line 8\nline 9\n"
        missing = await client.get(f"/v1/training-jobs/{job_id}/logs", params={"rank": 5})
        assert missing.status_code == 404 and "rank 5" in missing.json()["detail"]
        assert (await client.get(f"/v1/training-jobs/{job_id}/logs", params={"attempt": 7})).status_code == 404

        async with client.stream("GET", f"/v1/training-jobs/{job_id}/logs",
                                 params={"rank": 1, "tail": 1, "follow": "true"}) as stream:
            chunks = stream.aiter_text()
            assert await anext(chunks) == "line 9\n"
            with path.open("a") as f:
                f.write("line 10\n")
            assert await anext(chunks) == "line 10\n"
            ended = job.model_copy(deep=True)
            ended.attempts[0].ended_at, ended.attempts[0].state = ended.updated_at, "succeeded"
            await api.runtime.store.put_job(ended)
            assert [c async for c in chunks] == []  # the stream closes once the attempt has ended
    async with client_for(api.url, TOKEN_B) as other:
        assert (await other.get(f"/v1/training-jobs/{job_id}/logs")).status_code == 404

    def run(token: str, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, ["--api-url", api.url, "--token", token, "jobs", "logs", job_id, *args])
        return result.exit_code, result.output

    code, out = await asyncio.to_thread(run, TOKEN_A, "--rank", "1", "--tail", "3")
    assert code == 0 and out == "line 8\nline 9\nline 10\n"
    code, out = await asyncio.to_thread(run, TOKEN_A, "--rank", "1", "--tail", "1", "--follow")  # attempt ended
    assert code == 0 and out == "line 10\n"
    code, out = await asyncio.to_thread(run, TOKEN_A, "--rank", "4")
    assert code == 1 and "rank 4" in out


async def frames(response: httpx.Response, document: dict | None = None) -> AsyncIterator[tuple[str, dict]]:
    """Each event of a stream; with ``document`` (the API's OpenAPI), each is held to the schema it gives."""
    event = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event:
            if document is not None:
                documented_event(document, {"event": event, "data": line[6:]})
            yield event, json.loads(line[6:])


def documented_event(document: dict, event: dict) -> None:
    """``event`` ({event, data}) against ``GET /v1/events``' schema, and its data against its contentSchema."""
    pointer = "#/paths/~1v1~1events/get/responses/200/content/text~1event-stream/schema"
    jsonschema.Draft202012Validator({**document, "$ref": pointer}).validate(event)
    responses = document["paths"]["/v1/events"]["get"]["responses"]
    branches = responses["200"]["content"]["text/event-stream"]["schema"]["oneOf"]
    (i,) = [i for i, b in enumerate(branches) if b["properties"]["event"]["const"] == event["event"]]
    data = f"{pointer}/oneOf/{i}/properties/data/contentSchema"
    jsonschema.Draft202012Validator({**document, "$ref": data}).validate(json.loads(event["data"]))


async def test_events_stream_a_job_from_queued_to_succeeded_and_only_to_its_tenant(
    api: ApiServer, bus: Bus,
) -> None:
    job_id = "job-live"
    job = await given_job(api, job_id, state="queued", attempts=0)
    async with client_for(api.url, TOKEN_A) as client, client_for(api.url, TOKEN_B) as other:
        assert (await other.get("/v1/events", params={"jobId": job_id})).status_code == 404
        document = (await client.get("/openapi.json")).json()
        async with client.stream("GET", "/v1/events", params={"jobId": job_id}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            seen = frames(stream, document)  # every event as the document describes it (not a string)
            assert (await anext(seen))[1]["state"] == "queued"  # the current summary first

            async def announce(state: str) -> None:
                record = job.model_copy(update={"state": state})
                await api.runtime.store.put_job(record)
                await bus.publish(ev.JobStateChanged(job_id=job_id, tenant="tenant-a", state=state))

            async def reaches(state: str) -> None:
                # the hub's group reads from the newest offset once it has joined: announce until it answers
                async def answer() -> None:
                    while (await anext(seen))[1]["state"] != state:
                        pass
                waiting = asyncio.ensure_future(answer())
                while not waiting.done():
                    await announce(state)
                    await asyncio.wait({waiting}, timeout=1.0)
                await waiting

            for state in ("running", "succeeded"):
                await asyncio.wait_for(reaches(state), timeout=60)


async def test_cluster_shows_capacity_and_the_queue_and_admins_the_topology(api: ApiServer) -> None:
    store = api.runtime.store
    for node, rack in (("node-a", "r1"), ("node-b", "r2")):
        await store.put_node(NodeRecord(node_id=node, host=node, rack=rack, nvlink_domain=f"{rack}-nvl",
                                        devices=[ev.DeviceInfo(index=i, type="cpu", memory_bytes=1) for i in (0, 1)]))
    await api.runtime.redis.hset("ty:sched:node-quarantine", "node-b", json.dumps({"reason": "xid 79"}))
    await given_job(api, "job-holds", attempts=1, devices=["node-a:0", "node-a:1"])
    await given_job(api, "job-mine", state="queued", attempts=0)
    await given_job(api, "job-theirs", tenant="tenant-b", state="queued", attempts=0, priority=5)
    async with client_for(api.url, TOKEN_A) as client:
        body = (await client.get("/v1/cluster")).json()
        (cpu,) = body["capacity"]
        assert (cpu["total"], cpu["held"], cpu["quarantined"], cpu["free"]) == (4, 2, 2, 0)
        theirs, mine = body["queue"]
        assert (theirs["jobId"], theirs["tenant"], theirs["position"]) == (None, None, 1)
        assert (mine["jobId"], mine["queuedReasonKind"], mine["position"]) == ("job-mine", "capacity", 2)
        assert (await client.get("/v1/admin/cluster")).status_code == 403
    async with client_for(api.url, ADMIN) as admin:
        racks = (await admin.get("/v1/admin/cluster")).json()["racks"]
        assert [r["rack"] for r in racks] == ["r1", "r2"]
        node_a = racks[0]["domains"][0]["nodes"][0]
        assert [d["jobId"] for d in node_a["devices"]] == ["job-holds", "job-holds"]
        assert racks[1]["domains"][0]["nodes"][0]["state"] == "quarantined"
