"""A READY checkpoint refused at restore, and one deleted by retention, against the real broker
and Redis: the coordinator marks the refused one FAILED, the registry retires both artifacts, and a
late CheckpointReady for a retired checkpoint is recorded retired instead of dead-lettered."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_contract import events as ev
from trainyard_runtime.store import Keys
from tests.integration.test_coordinator import (
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


@pytest.fixture
async def stack(env: dict[str, Any]) -> AsyncIterator[Stack]:
    s = await start_stack(env, with_registry=True, registry={"retire_interval_s": 0.5})
    try:
        yield s
    finally:
        await stop_stack(s)


async def ready_checkpoint(stack: Stack, job_id: str, step: int, epoch: int) -> ev.CheckpointReady:
    await publish(stack, *shard_events(job_id, step, write_shards(stack, job_id, step), epoch=epoch))
    record = await wait_for(lambda: stack.settled(job_id, step), what=f"step {step} settled")
    assert record.state == "READY", record.reason
    ready, _ = (await wait_for(lambda: stack.tail.of(ev.CheckpointReady, job_id=job_id, global_step=step),
                               what="CheckpointReady"))[0]
    return ready


async def artifact(stack: Stack, job_id: str, step: int) -> Any:
    return next((a for a in await stack.store.list_artifacts(job_id) if a.global_step == step), None)


async def test_a_refused_ready_checkpoint_becomes_failed_and_its_artifact_retired(stack: Stack) -> None:
    job_id = "job-refused"
    epoch = await given_job(stack, job_id)
    ready20 = await ready_checkpoint(stack, job_id, 20, epoch)
    ready40 = await ready_checkpoint(stack, job_id, 40, epoch)
    await wait_for(lambda: artifact(stack, job_id, 40), what="artifact of step 40")
    assert (await stack.store.latest_ready_checkpoint(job_id)).global_step == 40

    refused = ev.CheckpointRefused(job_id=job_id, tenant=TENANT, attempt=2, manifest_uri=ready40.manifest_uri,
                                   global_step=40, checkpoint_attempt=1, problems=["rank 1: sha256 mismatch"])
    await publish(stack, refused, refused.model_copy(update={"event_id": ev.uuid4()}))  # a duplicate, too

    record = await wait_for(lambda: _failed(stack, job_id, 40), what="step 40 FAILED")
    assert record.reason == "refused at restore by attempt 2: rank 1: sha256 mismatch"
    assert record.content_hash == ready40.content_hash  # the READY record's identity stays
    latest = await stack.store.latest_ready_checkpoint(job_id)
    assert latest is not None and latest.global_step == 20

    retired = await wait_for(lambda: _retired(stack, job_id, 40), what="artifact retired")
    assert "refused at restore by attempt 2" in (retired.retired_reason or "")
    assert (await artifact(stack, job_id, 20)).retired_at is None

    # A late re-delivery of the READY event (a new event id) is not dead-lettered. The marker after it
    # (step 20's READY again, its artifact removed first) shows the registry has handled it: same key, in order.
    await stack.redis.hdel(Keys.artifacts(job_id), f"{job_id}/checkpoint/step-000000020-a1")
    await publish(stack, ready40.model_copy(update={"event_id": ev.uuid4()}),
                  ready20.model_copy(update={"event_id": ev.uuid4()}))
    await wait_for(lambda: artifact(stack, job_id, 20), what="the marker handled")
    assert stack.tail.of(ev.DeadLetter) == []
    assert (await artifact(stack, job_id, 40)).retired_at == retired.retired_at


async def test_a_checkpoint_deleted_by_retention_retires_its_artifact_and_a_late_ready_is_not_dead_lettered(
    stack: Stack,
) -> None:
    job_id = "job-retained"
    epoch = await given_job(stack, job_id)
    ready20 = await ready_checkpoint(stack, job_id, 20, epoch)
    await wait_for(lambda: artifact(stack, job_id, 20), what="artifact of step 20")

    # What retention does to the record (the collector's own test covers the files).
    record = await stack.record(job_id, 20)
    await stack.store.put_checkpoint(record.model_copy(update={"state": "DELETED", "reason": "keepLast 3"}))
    retired = await wait_for(lambda: _retired(stack, job_id, 20), what="artifact retired by the sweep")
    assert "deleted by retention" in (retired.retired_reason or "")

    # A job whose artifact is only known late: the READY arrives after the deletion.
    other = "job-late"
    epoch2 = await given_job(stack, other)
    late = await ready_checkpoint(stack, other, 20, epoch2)
    await wait_for(lambda: artifact(stack, other, 20), what="artifact of the late job")
    await stack.redis.hdel(Keys.artifacts(other), f"{other}/checkpoint/step-000000020-a1")
    rec = await stack.record(other, 20)
    await stack.store.put_checkpoint(rec.model_copy(update={"state": "DELETED", "reason": "keepLast 3"}))
    await publish(stack, late.model_copy(update={"event_id": ev.uuid4()}))
    recorded = await wait_for(lambda: _retired(stack, other, 20), what="late READY recorded retired")
    assert recorded.hash == late.content_hash and recorded.uri == late.manifest_uri
    assert stack.tail.of(ev.DeadLetter) == []
    assert ready20.global_step == 20


async def _failed(stack: Stack, job_id: str, step: int) -> Any:
    record = await stack.record(job_id, step)
    return record if record and record.state == "FAILED" else None


async def _retired(stack: Stack, job_id: str, step: int) -> Any:
    a = await artifact(stack, job_id, step)
    return a if a and a.retired_at is not None else None
