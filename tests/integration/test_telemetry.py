"""The telemetry service as its own process (``python -m trainyard_telemetry``) over the real broker and Redis:
every rank's StepMetrics and a StragglerDetected published on the bus become the read models the API serves
(progress, per-rank timing, stragglers, the metric history, rank 0's step ledger), while the API itself runs
no consumer of them — an API alone leaves the job at step 0 (docs/design.md, Telemetry)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import env_vars
from tests.support.api import TOKEN_A, client_for, running_api, spec_with
from trainyard_api import ApiServer
from trainyard_contract import events as ev
from trainyard_contract.records import AttemptRecord
from trainyard_runtime.bus import Bus
from trainyard_runtime.store import Keys

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(env: dict[str, Any]) -> AsyncIterator[ApiServer]:
    async with running_api(env, telemetry=False) as server:  # the API alone: commands and queries
        yield server


def step(job_id: str, n: int, rank: int) -> ev.StepMetrics:
    stall = 2.0 if n == 5 else 0.0  # step 5 saved a checkpoint: 2 s of it stood still
    return ev.StepMetrics(job_id=job_id, tenant="tenant-a", attempt=1, rank=rank, step=n, max_steps=10,
                          loss=4.0 - n * 0.1, tokens_per_second=1000.0, consumed_tokens=n * 512,
                          step_seconds=0.5 + 0.1 * rank + stall, compute_seconds=0.4, checkpoint_seconds=stall)


async def test_the_telemetry_process_ingests_step_metrics_into_what_the_api_serves(
        api: ApiServer, env: dict[str, Any]) -> None:
    async with client_for(api.url, TOKEN_A) as client:
        job_id = (await client.post("/v1/training-jobs", json=spec_with(name="ingested"))).json()["jobId"]
        job = await api.runtime.store.get_job(job_id)  # placed and running: the scheduler's part, played here
        assert job is not None
        await api.runtime.store.put_job(job.model_copy(update={"state": "running", "attempts": [
            AttemptRecord(attempt=1, allocation_id="a1", epoch=1, world_size=2, state="running")]}))
        bus = Bus(env["kafka_bootstrap"], service_name="test-ranks", group_prefix=env["group_prefix"],
                  topic_namespace=env["topic_namespace"])
        async with bus:
            for n in range(1, 6):
                for rank in (0, 1):
                    await bus.publish(step(job_id, n, rank))
            await bus.publish(ev.StragglerDetected(job_id=job_id, attempt=1, rank=1, node_id="node-b", slowdown=1.2,
                                                   window_steps=5, from_step=1, to_step=5))
            await asyncio.sleep(2.0)
            alone = (await client.get(f"/v1/training-jobs/{job_id}")).json()
            assert alone["progress"]["globalStep"] == 0 and alone["rankTiming"] == []  # nobody ingested

            proc = subprocess.Popen([sys.executable, "-m", "trainyard_telemetry"], stdin=subprocess.DEVNULL,
                                    env={**os.environ, **env_vars(env), "TRAINYARD_LOG_LEVEL": "WARNING"})
            try:
                body = await _job_when(client, job_id, lambda b: b["progress"]["globalStep"] == 5
                                       and len(b["rankTiming"]) == 2 and b["stragglers"])
                progress = body["progress"]
                assert progress["lastLoss"] == pytest.approx(3.5) and progress["consumedTokens"] == 5 * 512
                assert [r["step"] for r in body["rankTiming"]] == [5, 5]
                assert body["stragglers"][0]["nodeId"] == "node-b"

                history = (await client.get(f"/v1/training-jobs/{job_id}/metrics",
                                            params={"series": "loss,checkpointSeconds"})).json()
                assert history["series"]["loss"]["steps"] == [1, 2, 3, 4, 5]
                assert history["series"]["checkpointSeconds"]["values"][-1] == 2.0

                # rank 0's step ledger, split once: the save step's stall is not work
                ledger = await api.runtime.redis.hgetall(Keys.attempt_steps(job_id, 1))
                assert float(ledger["workSeconds"]) == pytest.approx(5 * 0.5)
                assert float(ledger["checkpointSeconds"]) == pytest.approx(2.0)
                assert float(ledger["recentWorkSeconds"]) == pytest.approx(0.5)
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=30) == 0
    assert not [k async for k in api.runtime.redis.scan_iter(match=Keys.health("telemetry", "*"))]


async def _job_when(client: Any, job_id: str, until: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = (await client.get(f"/v1/training-jobs/{job_id}")).json()
        if until(body):
            return body
        await asyncio.sleep(0.2)
    raise AssertionError(f"the read models never caught up; last: {body.get('progress')}, {body.get('rankTiming')}")
