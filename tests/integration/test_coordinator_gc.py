"""Retention, garbage collection and interval advice of the checkpoint coordinator, against the real
broker and Redis, on real files: what is removed (and in which order), and what must never be."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.integration.test_coordinator import (
    SPEC,
    TENANT,
    Stack,
    given_job,
    publish,
    shard_events,
    start_stack,
    stop_stack,
    wait_for,
    write_shards,
)
from trainyard_checkpoint_coordinator import JOBS_INDEX, CheckpointAdvice
from trainyard_contract import events as ev
from trainyard_contract.events import CheckpointRef
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.records import AttemptRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import uri_to_path
from trainyard_runtime.store import Keys
from trainyard_planner.checkpoint import daly_interval

pytestmark = pytest.mark.integration
HOUSEKEEPING = {"gc_interval_s": 0.5, "advice_interval_s": 0.5, "shard_timeout_s": 3.0, "sweep_interval_s": 0.5}


@pytest.fixture
async def stack(env: dict[str, Any]) -> AsyncIterator[Stack]:
    s = await start_stack(env, with_telemetry=True, **HOUSEKEEPING)  # the advice reads telemetry's step timing
    try:
        yield s
    finally:
        await stop_stack(s)


async def set_spec(stack: Stack, job_id: str, **policy: object) -> None:
    job = await stack.store.get_job(job_id)
    assert job is not None
    spec = TrainingSpec.model_validate({**SPEC, "checkpointPolicy": {**SPEC["checkpointPolicy"], **policy}})
    await stack.store.put_job(job.model_copy(update={"spec": spec}))


async def checkpoint(stack: Stack, job_id: str, step: int, *, epoch: int, attempt: int = 1) -> None:
    paths = write_shards(stack, job_id, step, attempt=attempt)
    await publish(stack, *shard_events(job_id, step, paths, epoch=epoch, attempt=attempt))
    record = await wait_for(lambda: stack.settled(job_id, step, attempt), what=f"step {step} settled")
    assert record.state in ("READY", "DELETED"), record.reason


async def test_retention_keeps_the_newest_and_the_live_attempts_start_and_deletes_manifest_first(stack: Stack) -> None:
    job_id = "job-keep"
    epoch1 = await given_job(stack, job_id)
    await set_spec(stack, job_id, keepLast=2)
    for step in (10, 20):
        await checkpoint(stack, job_id, step, epoch=epoch1)
    first = await stack.record(job_id, 10)
    assert first is not None and first.state == "READY"
    # attempt 1 fails; attempt 2 starts from step 10 (as if 20 had not been READY when it was placed)
    epoch2 = await LeaseManager(stack.redis).acquire(job_id, f"{job_id}-alloc-2", [Device("n2", 0), Device("n2", 1)])
    job = await stack.store.get_job(job_id)
    assert job is not None
    start = CheckpointRef(manifest_uri=first.manifest_uri or "", global_step=10, attempt=1)
    job.attempts = [job.attempts[0].model_copy(update={"state": "failed"}),
                    AttemptRecord(attempt=2, allocation_id=f"{job_id}-alloc-2", epoch=epoch2, world_size=2,
                                  state="running", start_checkpoint=start)]
    await stack.store.put_job(job)
    for step in (30, 40):
        await checkpoint(stack, job_id, step, epoch=epoch2, attempt=2)

    # keepLast=2 over READY {10, 20, 30, 40}: 20 goes; 10 stays while attempt 2 (started from it) lives
    retired = await wait_for(lambda: _deleted(stack, job_id, 20), what="step 20 retired")
    assert retired.deleted_at is not None and "keepLast=2" in (retired.reason or "")
    assert not uri_to_path(retired.manifest_uri).parent.exists()
    for step, attempt in ((10, 1), (30, 2), (40, 2)):
        kept = await stack.record(job_id, step, attempt)
        assert kept is not None and kept.state == "READY"
        assert uri_to_path(kept.manifest_uri).exists()
    latest = await stack.store.latest_ready_checkpoint(job_id)
    assert latest is not None and latest.global_step == 40

    # once attempt 2 has ended, step 10 is no longer protected
    job = await stack.store.get_job(job_id)
    assert job is not None
    job.attempts[-1] = job.attempts[-1].model_copy(update={"state": "succeeded"})
    await stack.store.put_job(job)
    gone = await wait_for(lambda: _deleted(stack, job_id, 10), what="step 10 retired after the attempt ended")
    assert not uri_to_path(gone.manifest_uri).parent.exists()
    assert [c.global_step for c in await stack.store.list_checkpoints(job_id) if c.state == "READY"] == [30, 40]


async def _deleted(stack: Stack, job_id: str, step: int, attempt: int = 1):  # noqa: ANN202 - a predicate
    record = await stack.record(job_id, step, attempt)
    return record if record and record.state == "DELETED" and record.deleted_at else None


async def test_failed_checkpoints_and_stale_leftovers_are_collected_but_live_ones_are_not(stack: Stack) -> None:
    job_id = "job-gc"
    epoch = await given_job(stack, job_id)
    # a checkpoint only rank 0 reported: it times out, becomes FAILED, and its files go
    paths = write_shards(stack, job_id, 20)
    rank0, _ = shard_events(job_id, 20, paths, epoch=epoch)
    await publish(stack, rank0)
    checkpoints = stack.layout.checkpoints_dir(TENANT, job_id)
    # leftovers: an interrupted save of an ended attempt (old), the same for the live attempt 1,
    # and a renamed directory no rank reported (ended attempt 7)
    job = await stack.store.get_job(job_id)
    assert job is not None
    job.attempts.insert(0, AttemptRecord(attempt=7, allocation_id="old", epoch=1, world_size=2, state="failed"))
    await stack.store.put_job(job)
    stale_tmp = checkpoints / "step-000000030-a7.tmp"
    live_tmp = checkpoints / "step-000000030-a1.tmp"
    orphan = checkpoints / "step-000000010-a7"
    foreign = checkpoints / "keep-me"
    for d in (stale_tmp, live_tmp, orphan, foreign):
        (d / "data").mkdir(parents=True)
        old = time.time() - 3600
        os.utime(d, (old, old))

    failed = await wait_for(lambda: _collected(stack, job_id, 20), timeout_s=60, what="FAILED files collected")
    assert failed.state == "FAILED" and "timed out" in (failed.reason or "")
    assert not paths[0].parent.exists()
    await wait_for(lambda: not stale_tmp.exists() and not orphan.exists(), what="stale leftovers swept")
    assert live_tmp.exists(), "a live attempt's save in progress must not be removed"
    assert foreign.exists(), "a directory the platform did not name is never touched"
    assert await stack.redis.zscore(JOBS_INDEX, job_id) is not None


async def _collected(stack: Stack, job_id: str, step: int):  # noqa: ANN202 - a predicate
    record = await stack.record(job_id, step)
    return record if record and record.deleted_at else None


async def test_advice_from_measured_stall_step_time_and_failures(stack: Stack) -> None:
    job_id = "job-advice"
    epoch = await given_job(stack, job_id)
    await set_spec(stack, job_id, everySteps=None, auto=True)
    # 2 ranks x 10 steps of 0.5 s compute; the checkpoint at step 10 stalls rank 1 for 2 s
    def stall(step: int, rank: int) -> float:
        return {(10, 0): 0.1, (10, 1): 2.0}.get((step, rank), 0.0)

    metrics = [
        ev.StepMetrics(job_id=job_id, attempt=1, rank=rank, step=step, loss=1.0, consumed_tokens=0,
                       step_seconds=0.5 + stall(step, rank), checkpoint_seconds=stall(step, rank))
        for step in range(1, 11) for rank in (0, 1)
    ]
    await publish(stack, *metrics)
    await publish(stack, ev.WorkerExited(job_id=job_id, attempt=1, allocation_id=f"{job_id}-alloc-1", epoch=epoch,
                                         node_id="n", rank=0, exit_code=-9, reason="killed"),
                  ev.WorkerExited(job_id=job_id, attempt=1, allocation_id=f"{job_id}-alloc-1", epoch=epoch,
                                  node_id="n", rank=1, exit_code=-15, reason="revoked"))
    await checkpoint(stack, job_id, 10, epoch=epoch)

    async def measured() -> CheckpointAdvice | None:
        raw = await stack.redis.get(Keys.checkpoint_advice(job_id))
        advice = CheckpointAdvice.model_validate_json(raw) if raw else None
        return advice if advice and advice.interval_steps and advice.failures >= 1 and \
            advice.exposure_device_seconds >= 10.1 else None

    advice = await wait_for(measured, what="interval advice")
    assert advice.auto and advice.cost_source == "stall" and advice.checkpoint_cost_seconds == pytest.approx(2.0)
    assert advice.step_seconds == pytest.approx(0.5)
    assert advice.failures == 1 and advice.mtbf_source == "observed"  # the revoked rank is not a failure
    exposure = 2 * (10 * 0.5 + 0.1)  # rank 0's step times x 2 devices
    assert advice.exposure_device_seconds == pytest.approx(exposure)
    assert advice.job_mtbf_seconds == pytest.approx(exposure / 2)
    expected = max(daly_interval(2.0, exposure / 2), 0.5)
    assert advice.interval_seconds == pytest.approx(expected)
    assert advice.interval_steps == min(max(1, round(expected / 0.5)), 40)
    raw = json.loads(await stack.redis.get(Keys.checkpoint_advice(job_id)))
    assert {"intervalSteps", "intervalSeconds", "jobMtbfSeconds", "checkpointCostSeconds"} <= set(raw)
