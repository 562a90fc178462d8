"""A tenant's viewer cannot keep watching after its token is taken away, and the cluster queue tells one tenant
nothing of another; through a real API process, broker and Redis.

Attacks: keep an open ``GET /v1/events`` stream after the token is revoked (or expires) and read the events of
a job submitted afterwards; read another tenant's name and quota from the queued reason in ``GET /v1/cluster``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import pytest

from trainyard_api import ApiServer
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_contract.events import utcnow
from trainyard_contract.records import JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys
from tests.support.api import TOKEN_A, TOKEN_ADMIN, client_for, running_api, spec_with

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(env: dict) -> AsyncIterator[ApiServer]:
    async with running_api(env, admin=True) as server:
        yield server


@pytest.fixture
async def bus(env: dict) -> AsyncIterator[Bus]:
    b = Bus(env["kafka_bootstrap"], service_name="test-live-tokens", group_prefix=env["group_prefix"],
            topic_namespace=env["topic_namespace"])
    await b.start()
    try:
        yield b
    finally:
        await b.aclose()


async def queued_job(api: ApiServer, job_id: str, tenant: str, reason: str, kind: str, priority: int = 0) -> JobRecord:
    spec = TrainingSpec.model_validate(spec_with())
    job = JobRecord(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash(), state="queued",
                    priority=priority, queued_reason=reason, queued_reason_kind=kind)
    await api.runtime.store.create_job(job)
    return job


async def events_of(response: httpx.Response) -> AsyncIterator[tuple[str, dict]]:
    event = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event:
            yield event, json.loads(line[6:])


async def viewer_token(api: ApiServer) -> tuple[str, str, str]:
    """A fresh viewer token of tenant-a issued through the API: (secret, token id, sha256)."""
    async with client_for(api.url, TOKEN_ADMIN) as admin:
        resp = await admin.post("/v1/admin/tenants/tenant-a/tokens", json={"name": "watcher", "role": "viewer"})
        assert resp.status_code == 201, resp.text
    secret = resp.json()["token"]
    return secret, resp.json()["tokenId"], hashlib.sha256(secret.encode()).hexdigest()


async def watch_until_live(api: ApiServer, bus: Bus, seen: AsyncIterator[tuple[str, dict]]) -> None:
    """Announce a job of tenant-a until the stream passes it on: the hub has joined the bus."""
    job = await queued_job(api, "job-warmup", "tenant-a", "waiting for 2 x cpu", "capacity")

    async def answer() -> None:
        while True:
            name, data = await anext(seen)
            if name == "job" and data["jobId"] == job.job_id:
                return

    waiting = asyncio.ensure_future(answer())
    while not waiting.done():
        await bus.publish(ev.JobStateChanged(job_id=job.job_id, tenant="tenant-a", state="queued"))
        await asyncio.wait({waiting}, timeout=1.0)
    await waiting


async def rest_of(seen: AsyncIterator[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return [item async for item in seen]


async def test_a_revoked_viewer_tokens_open_stream_closes_with_the_reason_and_sends_nothing_after(
    api: ApiServer, bus: Bus,
) -> None:
    secret, token_id, _ = await viewer_token(api)
    async with client_for(api.url, secret) as viewer:
        async with viewer.stream("GET", "/v1/events") as stream:
            seen = events_of(stream)
            await asyncio.wait_for(watch_until_live(api, bus, seen), timeout=60)
            async with client_for(api.url, TOKEN_ADMIN) as admin:
                resp = await admin.delete(f"/v1/admin/tenants/tenant-a/tokens/{token_id}")
                assert resp.status_code == 200 and resp.json()["state"] == "revoked"
            async with client_for(api.url, TOKEN_A) as submitter:
                resp = await submitter.post("/v1/training-jobs", json=spec_with())
                assert resp.status_code in (201, 202), resp.text
                after = resp.json()["jobId"]
            for state in ("running", "succeeded"):
                await bus.publish(ev.JobStateChanged(job_id=after, tenant="tenant-a", state=state))
            rest = await asyncio.wait_for(rest_of(seen), timeout=60)  # the stream ends by itself
    assert not [data for name, data in rest if name == "job" and data.get("jobId") == after], rest
    name, data = rest[-1]
    assert name == "closed" and data["kind"] == "revoked" and "revoked" in data["reason"], rest
    assert [n for n, _ in rest].count("closed") == 1


async def test_an_expired_tokens_open_stream_closes_with_the_reason(api: ApiServer) -> None:
    secret, _, digest = await viewer_token(api)
    async with client_for(api.url, secret) as viewer:
        async with viewer.stream("GET", "/v1/events") as stream:
            assert stream.status_code == 200
            seen = events_of(stream)
            # expiry is the record's own instant: move it into the past rather than waiting for it
            record = (await api.runtime.store.token_records())[digest]
            await api.runtime.redis.hset(Keys.tokens, digest, record.model_copy(
                update={"expires_at": utcnow() - timedelta(seconds=1)}).dumps())
            rest = await asyncio.wait_for(rest_of(seen), timeout=60)
    assert rest and rest[-1][0] == "closed" and rest[-1][1]["kind"] == "expired", rest
    assert "expired" in rest[-1][1]["reason"]
    async with client_for(api.url, secret) as viewer:
        assert (await viewer.get("/v1/events")).status_code == 401


async def test_the_queue_says_nothing_of_another_tenants_name_quota_or_jobs(api: ApiServer) -> None:
    # the scheduler's own wording (planner.py): it names the tenant, its quota and the jobs ahead
    await queued_job(api, "job-b0b0b0b0b0b0", "tenant-b",
                     "quota: tenant tenant-b holds 6 cpu devices and may hold 7 (5 guaranteed + 2 borrowable); "
                     "this job needs 2 more", "quota", priority=5)
    await queued_job(api, "job-b1b1b1b1b1b1", "tenant-b",
                     "cohort secret-cohort holds 3 cpu devices of its limit 9; this job needs 2 more", "quota",
                     priority=4)
    await queued_job(api, "job-a0a0a0a0a0a0", "tenant-a",
                     "priority: the free cpu devices are held for job-b0b0b0b0b0b0, which is ahead in the queue",
                     "priority")
    async with client_for(api.url, TOKEN_A) as client:
        resp = await client.get("/v1/cluster")
        assert resp.status_code == 200
    text = resp.text
    for secret in ("tenant-b", "secret-cohort", "job-b0b0b0b0b0b0", "job-b1b1b1b1b1b1", "guaranteed", "borrowable",
                   "5 guaranteed", "limit 9"):
        assert secret not in text, (secret, text)
    theirs, _, mine = resp.json()["queue"]
    assert (theirs["tenant"], theirs["jobId"], theirs["queuedReasonKind"]) == (None, None, "quota")
    assert theirs["queuedReason"] == "waiting for its tenant's quota"
    assert mine["jobId"] == "job-a0a0a0a0a0a0"
    assert mine["queuedReason"] == ("priority: the free cpu devices are held for another tenant's job, "
                                    "which is ahead in the queue")
