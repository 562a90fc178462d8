"""Goodput, per-rank timing, stragglers, checkpoint advice and the admin node routes through the
real API, broker and Redis: metrics events on the broker → GET shows the ledger; reinstating a
node publishes NodeReinstated through the outbox."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from typer.testing import CliRunner

from redis.asyncio import Redis

from trainyard_api import ApiServer, ApiSettings
from trainyard_telemetry.accounting import GoodputAccountant
from trainyard_api.app import ApiContext, create_app
from trainyard_telemetry.steptiming import StepTimingStore
from trainyard_cli.main import app as cli
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord, NodeRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys, StateStore
from tests.integration.test_api import event_of, find_record
from tests.support.api import TOKEN_A, TOKEN_ADMIN, TOKEN_B, client_for, running_api, seed, spec_with
from tests.integration.test_api_calibration import eventually

ADMIN = TOKEN_ADMIN
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)


@pytest.fixture
async def api(env: dict) -> AsyncIterator[ApiServer]:
    async with running_api(env, admin=True, goodput_refresh_s=0.3) as server:  # with the operator's token (ADMIN)
        yield server


@pytest.fixture
async def bus(env: dict) -> AsyncIterator[Bus]:
    b = Bus(env["kafka_bootstrap"], service_name="test-ranks", group_prefix=env["group_prefix"],
            topic_namespace=env["topic_namespace"])
    await b.start()
    try:
        yield b
    finally:
        await b.aclose()


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


async def given_failed_then_running_job(api: ApiServer, job_id: str) -> None:
    """Attempt 1 (2 ranks) ran 0-60 s and failed; attempt 2 started at 100 s and is running."""
    spec = TrainingSpec.model_validate(spec_with())
    store = api.runtime.store
    await store.create_job(JobRecord(
        job_id=job_id, tenant="tenant-a", spec=spec, spec_hash=spec.spec_hash(), state="running", attempts=[
            AttemptRecord(attempt=1, allocation_id="a1", epoch=1, world_size=2, state="failed", started_at=at(0),
                          ended_at=at(60), failure_reason="error: rank 1 exited 1",
                          placement_score=0.9, placement_detail=ev.PlacementDetail(mode="pack", nodes=1, links=2)),
            AttemptRecord(attempt=2, allocation_id="a2", epoch=2, world_size=2, state="running",
                          started_at=at(100)),
        ]))
    await store.put_checkpoint(CheckpointRecord(job_id=job_id, tenant="tenant-a", attempt=1, epoch=1, global_step=20,
                                                world_size=2, state="READY", manifest_uri="file:///m20",
                                                content_hash="h20", write_seconds=1.5))
    await store.put_checkpoint(CheckpointRecord(job_id=job_id, tenant="tenant-a", attempt=1, epoch=1, global_step=10,
                                                world_size=2, state="DELETED", reason="keepLast 1",
                                                deleted_at=at(50)))
    await api.runtime.redis.set(Keys.checkpoint_advice(job_id), json.dumps({
        "jobId": job_id, "intervalSteps": 37, "intervalSeconds": 37.0, "dalyIntervalSeconds": 37.0,
        "youngIntervalSeconds": 40.0, "checkpointCostSeconds": 0.5, "costSource": "stall", "jobMtbfSeconds": 1600.0,
        "mtbfSource": "observed", "currentIntervalSteps": 20, "auto": False, "note": "n"}))


def metrics(job_id: str, attempt: int, step: int, done_at: float, rank: int = 0, **kw: float) -> ev.StepMetrics:
    timing = {"step_seconds": 1.0, "compute_seconds": 0.7, "collective_seconds": 0.2, "data_wait_seconds": 0.1,
              "mfu": 0.3, **kw}
    return ev.StepMetrics(job_id=job_id, tenant="tenant-a", attempt=attempt, rank=rank, step=step, loss=2.0,
                          consumed_tokens=step * 2048, occurred_at=at(done_at), **timing)


async def test_metrics_on_the_broker_make_the_goodput_ledger_rank_timing_and_stragglers(
    api: ApiServer, bus: Bus,
) -> None:
    job_id = "job-goodput"
    await given_failed_then_running_job(api, job_id)
    # attempt 1: steps 1..30, 1 s each, the first done at 11 s; READY at 20 → 10 lost
    for step in range(1, 31):
        await bus.publish(metrics(job_id, 1, step, 10 + step))
    await bus.publish(metrics(job_id, 1, 30, 40))  # a duplicate changes nothing
    # attempt 2: steps 21..25, first done at 105 s; rank 1 a straggler
    for step in range(21, 26):
        await bus.publish(metrics(job_id, 2, step, 84 + step))
        await bus.publish(metrics(job_id, 2, step, 84 + step, rank=1, compute_seconds=1.4))
    await bus.publish(ev.StragglerDetected(job_id=job_id, attempt=2, rank=1, node_id="node-b", slowdown=2.0,
                                           window_steps=5, from_step=21, to_step=25))

    async with client_for(api.url, TOKEN_A) as client:
        async def settled() -> dict | None:
            body = (await client.get(f"/v1/training-jobs/{job_id}")).json()
            ranks = body["rankTiming"]
            done = body["stragglers"] and len(ranks) == 2 and all(r["step"] == 25 for r in ranks)
            return body if done and body["goodput"]["wasted"]["lostWork"] == 20.0 else None

        body = await eventually(settled, "the job view with the ledger", timeout_s=60)
        goodput = body["goodput"]
        assert goodput["productiveDeviceSeconds"] == 2 * 20  # attempt 1's 20 saved steps; attempt 2 nothing yet
        assert goodput["inFlightDeviceSeconds"] == 2 * 5
        assert goodput["wasted"]["launchRestore"] == 2 * 10 + 2 * 4
        parts = goodput["productiveDeviceSeconds"] + goodput["inFlightDeviceSeconds"] + goodput["wastedDeviceSeconds"]
        assert parts == pytest.approx(goodput["allocatedDeviceSeconds"])
        assert [r["rank"] for r in body["rankTiming"]] == [0, 1]
        assert body["rankTiming"][1]["computeSeconds"] == 1.4 and body["rankTiming"][0]["mfu"] == 0.3
        (straggler,) = body["stragglers"]
        assert (straggler["rank"], straggler["nodeId"], straggler["slowdown"]) == (1, "node-b", 2.0)
        advice = body["checkpointAdvice"]
        assert (advice["intervalSteps"], advice["method"]) == (37, "daly")
        assert advice["inputs"]["jobMtbfSeconds"] == 1600.0
        assert body["attempts"][0]["placementDetail"]["mode"] == "pack"
        by_step = {c["globalStep"]: c for c in body["checkpoints"]}
        assert by_step[10]["state"] == "DELETED" and by_step[10]["deletedAt"] is not None
        assert by_step[20]["writeSeconds"] == 1.5

        report = (await client.get("/v1/goodput")).json()
        assert report["tenant"] == "tenant-a" and report["jobs"] == 1
        assert report["ledger"]["wasted"]["lostWork"] == 20.0
        assert (await client.get("/v1/goodput", params={"all": "true"})).status_code == 403

    async with client_for(api.url, TOKEN_B) as other:
        assert (await other.get("/v1/goodput")).json()["ledger"]["allocatedDeviceSeconds"] == 0.0
    async with client_for(api.url, ADMIN) as admin:
        everyone = (await admin.get("/v1/goodput", params={"all": "true"})).json()
        assert everyone["tenants"]["tenant-a"]["wasted"]["lostWork"] == 20.0

    async def gauge() -> str | None:
        async with client_for(api.url, ADMIN) as admin:  # /metrics names tenants: a platform-admin token
            text = (await admin.get("/metrics")).text
        line = 'trainyard_goodput_device_seconds{kind="lostWork",tenant="tenant-a"} 20.0'
        return text if line in text else None

    await eventually(gauge, "the goodput gauge")


async def test_admin_lists_nodes_with_quarantine_and_reinstates_through_the_outbox(api: ApiServer, env: dict) -> None:
    store, redis = api.runtime.store, api.runtime.redis
    await store.put_node(NodeRecord(node_id="node-a", host="h-a", rack="r1",
                                    devices=[ev.DeviceInfo(index=0, type="cpu", memory_bytes=1 << 30)]))
    await store.put_node(NodeRecord(node_id="node-b", host="h-b", devices=[]))
    await redis.hset(Keys.node_quarantine, "node-a", json.dumps(
        {"reason": "3 failures in 1h", "by": "reputation", "score": 3.2, "until": None}))
    await redis.hset(Keys.node_reputation, "node-a", json.dumps({"score": 3.2, "at": at(0).isoformat()}))

    async with client_for(api.url, TOKEN_A) as tenant:
        assert (await tenant.get("/v1/admin/nodes")).status_code == 403
        assert (await tenant.post("/v1/admin/nodes/node-a/reinstate")).status_code == 403
    async with client_for(api.url, ADMIN) as admin:
        nodes = {n["nodeId"]: n for n in (await admin.get("/v1/admin/nodes")).json()["nodes"]}
        assert nodes["node-a"]["quarantined"] and nodes["node-a"]["quarantine"]["by"] == "reputation"
        assert nodes["node-a"]["reputationScore"] == 3.2
        assert not nodes["node-b"]["quarantined"] and nodes["node-b"]["reputationScore"] is None
        assert (await admin.post("/v1/admin/nodes/node-x/reinstate")).status_code == 404
        resp = await admin.post("/v1/admin/nodes/node-a/reinstate")
        assert resp.status_code == 202 and resp.json() == {"nodeId": "node-a", "accepted": True, "by": "olga"}
    record = await find_record(env, ev.NODES, lambda r: event_of(r, ev.NodeReinstated, node_id="node-a"))
    event = ev.decode_event(ev.NODES, record.value)
    assert isinstance(event, ev.NodeReinstated) and event.by == "olga" and "olga" in event.reason

    # the CLI: `trainyard admin nodes list|reinstate`
    def run(token: str, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, ["--api-url", api.url, "--token", token, "admin", "nodes", *args])
        return result.exit_code, result.output

    code, out = await asyncio.to_thread(run, ADMIN, "list")
    assert code == 0 and "node-a" in out and "reputation" in out and "3.20" in out
    code, out = await asyncio.to_thread(run, ADMIN, "reinstate", "node-b")
    assert code == 0 and "node-b reinstated by olga" in out
    code, out = await asyncio.to_thread(run, TOKEN_A, "list")
    assert code == 1 and "needs platform-admin" in out


# ----------------------------------------------------------------------------- goodput over time

H0 = datetime(2026, 1, 1, tzinfo=UTC)  # a bucket start (epoch seconds divisible by 300)


def clock_at(moment: list[datetime]) -> Callable[[], datetime]:
    return lambda: moment[0]


async def test_refresh_records_each_tenants_cumulative_ledger_and_the_route_answers_its_intervals(
    env: dict, redis: Redis,
) -> None:
    """A running 2-rank job started at 0 s: refreshed at 300 s (no step yet), again in the same bucket,
    then at 900 s after 100 one-second steps (the first done at 311 s) saved by a READY checkpoint."""
    store = StateStore(redis)
    await seed(store, admin=True)
    spec = TrainingSpec.model_validate(spec_with())
    job_id = "job-history"
    await store.create_job(JobRecord(
        job_id=job_id, tenant="tenant-a", spec=spec, spec_hash=spec.spec_hash(), state="running",
        attempts=[AttemptRecord(attempt=1, allocation_id="a1", epoch=1, world_size=2, state="running", started_at=H0)]))
    stale = int((H0 - timedelta(days=31)).timestamp())
    await redis.hset(Keys.goodput_history("tenant-a"), str(stale), json.dumps({"allocated": 1.0}))
    now = [H0 + timedelta(seconds=300)]
    timing = StepTimingStore(redis)
    accountant = GoodputAccountant(store, timing, clock=clock_at(now))

    await accountant.refresh()
    now[0] = H0 + timedelta(seconds=310)  # the same bucket: overwritten, as a second API process would
    await GoodputAccountant(store, timing, clock=clock_at(now)).refresh()
    history = await redis.hgetall(Keys.goodput_history("tenant-a"))
    bucket_300 = str(int(H0.timestamp()) + 300)
    assert list(history) == [bucket_300]  # the 31-day-old sample was trimmed in the same pass
    assert json.loads(history[bucket_300])["allocated"] == 2 * 310

    for step in range(1, 101):
        await timing.on_step_metrics(ev.StepMetrics(
            job_id=job_id, tenant="tenant-a", attempt=1, rank=0, step=step, loss=2.0, consumed_tokens=step * 2048,
            step_seconds=1.0, occurred_at=H0 + timedelta(seconds=310 + step)))
    await store.put_checkpoint(CheckpointRecord(job_id=job_id, tenant="tenant-a", attempt=1, epoch=1, global_step=100,
                                                world_size=2, state="READY", manifest_uri="file:///m100",
                                                content_hash="h100"))
    now[0] = H0 + timedelta(seconds=900)
    await accountant.refresh()

    app = create_app(ApiContext(ApiSettings(**env), store, Outbox(redis, "api")))
    transport = httpx.ASGITransport(app=app)
    async with client_for("http://api", TOKEN_A, transport=transport) as a:
        body = (await a.get("/v1/goodput/history")).json()
        assert body["tenant"] == "tenant-a" and body["bucketSeconds"] == 300
        (interval,) = body["intervals"]
        # from the instant of the 310 s sample (its bucket starts at 300 s) to the 900 s one's
        assert (interval["start"], interval["end"]) == ("2026-01-01T00:05:10Z", "2026-01-01T00:15:00Z")
        # 300 s → 900 s of 2 ranks; launch ended at 310 s (10 s more than at the 310 s sample), 100 steps saved
        assert interval["allocatedDeviceSeconds"] == 2 * (900 - 310)
        assert interval["productiveDeviceSeconds"] == 2 * 100
        assert interval["wasted"]["launchRestore"] == 0.0  # already 2 x 310 s at the 310 s sample
        assert interval["wasted"]["idle"] == 2 * (900 - 310 - 100)
        assert interval["inFlightDeviceSeconds"] == 0.0
        assert interval["goodput"] == pytest.approx(200 / 1180)
        window = {"since": "2026-01-01T00:15:00Z"}
        assert (await a.get("/v1/goodput/history", params=window)).json()["intervals"] == []
        window = {"since": "2026-01-01T01:10:00+01:00", "until": "2026-01-01T00:12:00Z"}
        assert len((await a.get("/v1/goodput/history", params=window)).json()["intervals"]) == 1
        window = {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}  # an empty window
        assert (await a.get("/v1/goodput/history", params=window)).json()["intervals"] == []
        for bad in ("1767225600", "2026-01-01T00:10:00", "yesterday"):  # epoch, naive, prose: not RFC 3339
            resp = await a.get("/v1/goodput/history", params={"since": bad})
            assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "query.since", bad
        assert (await a.get("/v1/goodput/history", params={"all": "true"})).status_code == 403
    async with client_for("http://api", TOKEN_B, transport=transport) as b:
        assert (await b.get("/v1/goodput/history")).json()["intervals"] == []
    async with client_for("http://api", TOKEN_ADMIN, transport=transport) as admin:
        everyone = (await admin.get("/v1/goodput/history", params={"all": "true"})).json()
        assert list(everyone["tenants"]) == ["tenant-a"] and everyone["intervals"] == []
        assert everyone["tenants"]["tenant-a"] == body["intervals"]
