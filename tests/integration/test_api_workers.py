"""More than one HTTP worker on the API's port (TRAINYARD_API_WORKERS): every worker answers, a retried
submission is one job whichever worker each try reaches (the Idempotency-Key is checked in Redis, not in a
process), what a worker accepted is published (its own outbox), and a worker that dies is started again."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import pytest

from tests.support.api import TOKEN_A, running_api, spec_with
from tests.integration.test_scheduler_stack import EventTap
from trainyard_contract.events import JobSubmitted

pytestmark = pytest.mark.integration


def fresh(url: str, token: str | None = None) -> httpx.AsyncClient:
    """A client that opens a new connection per request, so the kernel hands each to whichever worker accepts."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0,
                             limits=httpx.Limits(max_keepalive_connections=0))


async def workers_seen(url: str, want: set[int], *, tries: int = 2000) -> set[int]:
    """Which workers answered /healthz, asking until every one of ``want`` has (or ``tries`` requests)."""
    seen: set[int] = set()
    async with fresh(url) as client:
        for _ in range(tries):
            resp = await client.get("/healthz")
            assert resp.status_code == 200, resp.text
            seen.add(resp.json()["worker"])
            if want <= seen:
                break
            await asyncio.sleep(0.01)
    return seen


async def test_two_workers_share_the_port_and_idempotency(env: dict[str, Any]) -> None:
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    await tap.start()
    try:
        async with running_api(env, api_workers=2) as api:
            assert await workers_seen(api.url, {0, 1}) == {0, 1}

            spec = spec_with(name="once")
            async with fresh(api.url, TOKEN_A) as client:
                tries = await asyncio.gather(*(client.post("/v1/training-jobs", json=spec,
                                                           headers={"Idempotency-Key": "retry-me"})
                                               for _ in range(12)))
                assert {r.status_code for r in tries} == {202}, [r.text for r in tries]
                job_ids = {r.json()["jobId"] for r in tries}
                assert len(job_ids) == 1, job_ids
                listed = (await client.get("/v1/training-jobs", params={"limit": 100})).json()["jobs"]
                assert [j["jobId"] for j in listed if j["name"] == "once"] == list(job_ids)
                # jobs accepted by either worker are announced (each worker relays its own outbox)
                others = [await client.post("/v1/training-jobs", json=spec_with(name=f"n{i}")) for i in range(8)]
                assert {r.status_code for r in others} == {202}
            want = job_ids | {r.json()["jobId"] for r in others}
            for job_id in want:
                (announced,) = await tap.wait(JobSubmitted, 1, timeout_s=60, job_id=job_id)
                assert announced.job_id == job_id

            (pid,) = api.worker_pids.values()
            os.kill(pid, signal.SIGKILL)

            async def restarted() -> int:
                while (now := api.worker_pids.get(1)) in (None, pid):
                    await asyncio.sleep(0.1)
                return now

            assert await asyncio.wait_for(restarted(), 60) != pid
            assert await workers_seen(api.url, {1}) >= {1}
            pids = list(api.worker_pids.values())
        assert pids and not any(_alive(p) for p in pids)  # closing the API stops its workers
    finally:
        await tap.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
