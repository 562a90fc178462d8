"""The planner's calibration loop through the real API, broker and Redis: rank 0's StepMetrics and
failed attempts become samples, a periodic refit stores the calibration, ``POST /v1/plan`` answers
calibrated estimates next to the raw ones, ``GET /v1/plan/calibration`` and ``trainyard plan
calibration`` show predicted against measured."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

import pytest
from typer.testing import CliRunner

from trainyard_api import ApiServer
from trainyard_telemetry.calibration import StoredCalibration
from trainyard_cli.main import app as cli
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys
from tests.support.api import TOKEN_A, TOKEN_B, client_for, running_api, spec_with

T = TypeVar("T")

# what the synthetic platform "measures": 50 ms steps with a little noise, a 300 ms checkpoint stall
# at the save step, and the 2 ms a background save costs the step after it (the ranks agreeing that
# the write is done): that step is neither a step-time nor a checkpoint sample
STEP_SECONDS = 0.05
JITTER = [1.00, 0.97, 1.03, 0.99, 1.02, 0.98, 1.01, 1.04, 0.96, 1.00, 0.99, 1.01]
CHECKPOINT_STEP, CHECKPOINT_SECONDS, POLL_SECONDS = 10, 0.3, 0.002
SAMPLED = [s for s in range(3, 13) if s not in (CHECKPOINT_STEP, CHECKPOINT_STEP + 1)]  # warm-up: 2 steps
# the example job's shape, as POST /v1/plan takes it (the trainer: fp32 AdamW, DDP, fused attention)
EXAMPLE_PLAN = {"model": "gpt-tiny@v1", "device": "cpu", "sequenceLength": 64, "precision": "fp32",
                "layout": {"dp": 2, "microBatch": 8, "microbatches": 2, "recompute": "selective"},
                "checkpoint": {"writeBandwidth": 500e6}}


@pytest.fixture
async def api(env: dict) -> AsyncIterator[ApiServer]:
    async with running_api(env, calibration_refresh_s=0.3, calibration_min_samples=3, calibration_warmup_steps=2,
                           calibration_sample_every=1, calibration_max_samples=50) as server:
        yield server


async def eventually(probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (found := await probe()) is not None:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def step_metrics(job_id: str, step: int) -> ev.StepMetrics:
    checkpoint = {CHECKPOINT_STEP: CHECKPOINT_SECONDS, CHECKPOINT_STEP + 1: POLL_SECONDS}.get(step, 0.0)
    return ev.StepMetrics(job_id=job_id, tenant="tenant-a", attempt=1, rank=0, step=step, max_steps=40, loss=2.0,
                          consumed_tokens=step * 2048, step_seconds=STEP_SECONDS * JITTER[step - 1] + checkpoint,
                          checkpoint_seconds=checkpoint)


async def fitted(api: ApiServer, device_type: str, *, steps: int = 0, failures: int = 0) -> StoredCalibration | None:
    stored = await api.context.calibrations.load()  # the telemetry service's fit, as POST /v1/plan reads it
    device = stored.fitted.devices.get(device_type) if stored else None
    if device and device.step_time_samples >= steps and device.failure_samples >= failures:
        return stored
    return None


async def test_measured_steps_calibrate_the_plan_of_their_device_type(api: ApiServer, env: dict) -> None:
    redis = api.runtime.redis
    async with client_for(api.url, TOKEN_A) as alice, client_for(api.url, TOKEN_B) as bob:
        # 1. a job as the API stores it, then rank 0's (and rank 1's) metrics, one redelivered
        spec = spec_with(**{"checkpointPolicy.everySteps": CHECKPOINT_STEP})
        job_id = (await alice.post("/v1/training-jobs", json=spec)).json()["jobId"]
        async with Bus(env["kafka_bootstrap"], service_name="calibration-test",
                       topic_namespace=env["topic_namespace"]) as bus:
            for step in range(1, 13):
                await bus.publish(step_metrics(job_id, step))
                if step == 5:
                    await bus.publish(step_metrics(job_id, step))  # a duplicate samples nothing
                await bus.publish(step_metrics(job_id, step).model_copy(update={"rank": 1, "step_seconds": 9.0}))

        # 2. the samples: steps 3..12 but the checkpoint's and the next (warm-up 2), and the checkpoint's stall
        step_key, write_key = Keys.calibration_samples("cpu", "step_time"), Keys.calibration_samples(
            "cpu", "checkpoint_write")

        async def all_samples() -> bool | None:
            return True if await redis.llen(step_key) == len(SAMPLED) and await redis.llen(write_key) == 1 else None

        await eventually(all_samples, "the step and checkpoint samples")
        assert await redis.smembers(Keys.calibration_devices) == {"cpu"}
        newest = json.loads(await redis.lindex(step_key, 0))
        assert newest["jobId"] == job_id and newest["step"] == 12 and newest["sample"]["deviceType"] == "cpu"
        measured = [STEP_SECONDS * JITTER[s - 1] for s in SAMPLED]
        assert sorted(json.loads(r)["sample"]["measured"] for r in await redis.lrange(step_key, 0, -1)) == \
            pytest.approx(sorted(measured))

        # 3. the periodic refit stores the calibration (Calibration.to_dict)
        stored = await eventually(lambda: fitted(api, "cpu", steps=len(SAMPLED)), "the refit")
        cpu = stored.fitted.devices["cpu"]
        assert cpu.checkpoint_write_samples == 0  # one stall is below the 3 samples a factor needs
        raw_key = json.loads(await redis.get(Keys.calibration))
        assert raw_key["calibration"]["devices"]["cpu"]["stepTimeSamples"] == len(SAMPLED)

        # 4. POST /v1/plan for the same configuration: calibrated is closer to what was measured
        resp = await alice.post("/v1/plan", json=EXAMPLE_PLAN)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        raw, calibrated = body["step"]["stepSeconds"], body["calibrated"]["calibratedStepSeconds"]
        median = statistics.median(measured)
        assert abs(calibrated - median) < abs(raw - median)
        assert abs(calibrated - median) / median < 0.15, (raw, calibrated, median)
        applied = body["calibrated"]["calibration"]
        assert applied["deviceType"] == "cpu" and applied["factors"]["stepTimeSamples"] == len(SAMPLED)
        assert applied["factors"]["stepTimeFactor"] == pytest.approx(calibrated / raw)
        assert body["calibrated"]["rawStepSeconds"] == raw and body["calibrated"]["notes"]
        raw_only = (await alice.post("/v1/plan", json={**EXAMPLE_PLAN, "calibrate": False})).json()
        assert "calibrated" not in raw_only and raw_only["step"]["stepSeconds"] == raw
        assert "calibrated" not in (await alice.post("/v1/plan", json={**EXAMPLE_PLAN, "device": "h100"})).json()

        # 5. GET /v1/plan/calibration: factors and predicted vs measured, job ids for their tenant only
        resp = await alice.get("/v1/plan/calibration", params={"deviceType": "CPU", "limit": 4})
        assert resp.status_code == 200, resp.text
        (device,) = resp.json()["devices"]
        steps = device["kinds"][0]
        assert steps["kind"] == "step_time" and steps["storedSamples"] == steps["fittedSamples"] == len(SAMPLED)
        assert [r["step"] for r in steps["rows"]] == [12, 9, 8, 7]
        for row in steps["rows"]:
            assert row["jobId"] == job_id and row["predicted"] == pytest.approx(raw)
            assert row["calibrated"] == pytest.approx(calibrated)
            assert row["errorPct"] == pytest.approx((raw - row["measured"]) / row["measured"] * 100)
        assert steps["calibratedMeanAbsErrorPct"] < steps["meanAbsErrorPct"]
        write = device["kinds"][1]["rows"][0]
        assert write["measured"] == pytest.approx(CHECKPOINT_SECONDS) and write["step"] == CHECKPOINT_STEP
        theirs = (await bob.get("/v1/plan/calibration")).json()["devices"][0]["kinds"][0]["rows"]
        assert theirs and all(r["jobId"] is None for r in theirs)
        assert (await alice.get("/v1/plan/calibration", params={"deviceType": "a100"})).json()["devices"] == []
    async with client_for(api.url, None) as anonymous:
        assert (await anonymous.get("/v1/plan/calibration")).status_code == 401

    # 6. the CLI shows the same (it asks the API; run off the event loop the API serves on)
    runner = CliRunner()
    args = ["--api-url", api.url, "--token", TOKEN_A, "plan", "calibration", "--device", "cpu"]
    as_json = await asyncio.to_thread(runner.invoke, cli, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["devices"][0]["kinds"][0]["storedSamples"] == len(SAMPLED)
    table = await asyncio.to_thread(runner.invoke, cli, args)
    assert table.exit_code == 0, table.output
    assert "cpu: calibration" in table.output and "predicted vs measured" in table.output and job_id in table.output


async def test_failed_attempts_give_the_measured_mtbf_once_each(api: ApiServer) -> None:
    store = api.runtime.store
    spec = TrainingSpec.model_validate(spec_with(**{
        "resources": {"gpuType": "h100", "gpuCount": 8}, "parallelism": {"data": 8},
        "training.globalBatchSize": 64}))
    job = JobRecord(job_id="job-failing00001", tenant="tenant-a", spec=spec, spec_hash="h")
    assert await store.create_job(job)  # as the API stores it
    started = job.created_at
    attempts = []
    for n, minutes in enumerate((10, 20, 30), start=1):  # as the scheduler records them
        attempts.append(AttemptRecord(attempt=n, allocation_id=f"a{n}", epoch=n, state="failed", world_size=8,
                                      started_at=started, ended_at=started + timedelta(minutes=minutes),
                                      failure_reason="nccl"))
    attempts.append(AttemptRecord(attempt=4, allocation_id="a4", epoch=4, state="running", world_size=8))
    await store.put_job(job.model_copy(update={"attempts": attempts, "state": "running"}))

    stored = await eventually(lambda: fitted(api, "h100-80gb", failures=3), "the failure samples")
    mtbf = (10 + 20 + 30) / 3 * 60 * 8  # device-seconds per failure
    assert stored.fitted.devices["h100-80gb"].mtbf_seconds == pytest.approx(mtbf)
    await asyncio.sleep(1.0)  # several refits later each failure is still counted once
    key = Keys.calibration_samples("h100-80gb", "failure_interval")
    assert await api.runtime.redis.llen(key) == 3
    assert await api.runtime.redis.zcard(Keys.calibration_failures_seen) == 3

    async with client_for(api.url, TOKEN_A) as alice:
        resp = await alice.post("/v1/plan", json={"model": "gpt-tiny@v1", "device": "h100", "devices": 8,
                                                  "checkpoint": {"writeBandwidth": 10e9}})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["calibrated"]["checkpoint"]["mtbfSeconds"] == pytest.approx(mtbf / 8)
        assert body["checkpoint"]["mtbfSeconds"] > 1000 * mtbf  # the raw plan assumes 50,000 h per device
        failures = (await alice.get("/v1/plan/calibration")).json()["devices"][0]["kinds"][2]
        assert failures["mtbfSeconds"] == pytest.approx(mtbf)
        assert sorted(r["measured"] for r in failures["rows"]) == pytest.approx([4800, 9600, 14400])
        assert all(r["calibrated"] == pytest.approx(mtbf) for r in failures["rows"])
