"""The registry's export worker against the real broker, Redis and conversion command: a spec's export is
requested with the final model in one MULTI; a checkpoint that cannot be converted fails with the command's
reason and leaves no directory (also the whole one a crash left behind); a retired checkpoint is refused;
a ready or failed export is a no-op under redelivery.

The checkpoints here are the coordinator's real READY ones over random shard bytes (no trainer runs), so
the conversion refuses them: tests/e2e/test_exports.py converts trained ones and loads them in
transformers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_contract import events as ev
from trainyard_contract.records import ExportRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys
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


@pytest.fixture
async def stack(env: dict[str, Any]) -> AsyncIterator[Stack]:
    s = await start_stack(env, with_registry=True, registry={"retire_interval_s": 0.5, "export_timeout_s": 120},
                          tail_topics=(ev.REGISTRY, ev.EXPORTS, ev.DEADLETTER))
    try:
        yield s
    finally:
        await stop_stack(s)


async def ready_artifact(stack: Stack, job_id: str, step: int, epoch: int) -> str:
    """A READY checkpoint of ``job_id`` at ``step``, recorded by the registry; its artifact id."""
    await publish(stack, *shard_events(job_id, step, write_shards(stack, job_id, step), epoch=epoch))
    artifact_id = f"{job_id}/checkpoint/step-{step:09d}-a1"
    await wait_for(lambda: stack.store.get_artifact(job_id, artifact_id), what=f"{artifact_id} recorded")
    return artifact_id


def export_failed(stack: Stack, export_id: str) -> list[ev.ExportFailed]:
    return [e for e, _ in stack.tail.of(ev.ExportFailed, export_id=export_id)]


async def settled(stack: Stack, export_id: str) -> ExportRecord | None:
    record = await stack.store.get_export(export_id)
    return record if record is not None and record.state != "requested" else None


async def test_a_spec_export_is_requested_with_the_model_and_an_unconvertible_checkpoint_fails_cleanly(
        stack: Stack) -> None:
    job_id = "job-export-spec"
    epoch = await given_job(stack, job_id)
    job = await stack.store.get_job(job_id)
    spec = TrainingSpec.model_validate(SPEC | {"export": {"format": "hf"}})
    await stack.store.put_job(job.model_copy(update={"spec": spec, "spec_hash": spec.spec_hash()}))
    await ready_artifact(stack, job_id, 40, epoch)
    # a whole directory an earlier run left without its record (a crash after the rename): redone, not kept
    leftover = stack.layout.export_dir(TENANT, job_id, "step-000000040-a1", "hf")
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")

    success = ev.JobStateChanged(job_id=job_id, tenant=TENANT, state="succeeded", previous_state="running", attempt=1)
    await publish(stack, success, success.model_copy(update={"event_id": ev.uuid4()}))
    export_id = f"{job_id}/export/step-000000040-a1/hf"
    (requested,) = await wait_for(lambda: stack.tail.of(ev.ExportRequested, export_id=export_id),
                                  what="the spec's ExportRequested")
    assert (requested[0].requested_by, requested[0].checkpoint_artifact_id) == (
        "spec", f"{job_id}/model/step-000000040-a1")

    record = await wait_for(lambda: settled(stack, export_id), timeout_s=180, what="the export settled")
    assert record.state == "failed" and record.reason and record.requested_by == "spec", record
    # the command ran and refused the random bytes (DCP cannot read them); not a command that was not found
    assert record.problems and "No module named" not in record.reason, record
    (failed,) = await wait_for(lambda: export_failed(stack, export_id), what="ExportFailed")
    assert (failed.reason, failed.problems) == (record.reason, record.problems)
    assert not leftover.exists() and list(leftover.parent.iterdir()) == []  # nothing half-written, nothing stale
    assert {a.type for a in await stack.store.list_artifacts(job_id)} == {"checkpoint", "model"}  # no export

    # redelivered after the failure: nothing more happens (a new POST …/export retries instead)
    assert len(stack.tail.of(ev.ExportRequested)) == 1  # the success was delivered twice, the model made once
    await publish(stack, requested[0])
    await exports_marker(stack, job_id)
    assert len(export_failed(stack, export_id)) == 1
    assert stack.tail.of(ev.DeadLetter) == []


async def exports_marker(stack: Stack, job_id: str) -> None:
    """An ExportRequested on the job's key for a checkpoint it never had, published after what a test
    re-delivered: once its ExportFailed is out, the export worker has handled everything before it."""
    missing = f"{job_id}/checkpoint/step-000009999-a1"
    marker = ev.ExportRequested(export_id=ev.export_id(missing, "hf"), checkpoint_artifact_id=missing, job_id=job_id,
                                tenant=TENANT, format="hf", requested_by="marker")
    await publish(stack, marker)
    (failed,) = await wait_for(lambda: export_failed(stack, marker.export_id), what="the marker's ExportFailed")
    assert "no checkpoint artifact" in failed.reason


async def test_a_retired_checkpoint_is_refused_and_a_ready_export_is_left_alone(stack: Stack) -> None:
    job_id = "job-export-retired"
    epoch = await given_job(stack, job_id)
    retired = await ready_artifact(stack, job_id, 20, epoch)
    kept = await ready_artifact(stack, job_id, 40, epoch)
    record = await stack.record(job_id, 20)
    await stack.store.put_checkpoint(record.model_copy(update={"state": "DELETED", "reason": "keepLast 1"}))
    await wait_for(lambda: stack.tail.of(ev.ArtifactRetired, artifact_id=retired), what="step 20 retired")

    asked = ev.ExportRequested(export_id=ev.export_id(retired, "hf"), checkpoint_artifact_id=retired, job_id=job_id,
                               tenant=TENANT, format="hf", requested_by="tok_test")
    # an export recorded ready already: a redelivered request converts nothing and announces nothing
    ready = ExportRecord(export_id=ev.export_id(kept, "hf"), checkpoint_artifact_id=kept, job_id=job_id,
                         tenant=TENANT, format="hf", state="ready", requested_by="tok_test",
                         uri="file:///elsewhere", hash="sha256:" + "e" * 64)
    await stack.redis.set(Keys.export(ready.export_id), ready.dumps())
    await publish(stack, asked, asked, asked.model_copy(update={"event_id": ev.uuid4()}), asked.model_copy(update={
        "event_id": ev.uuid4(), "export_id": ready.export_id, "checkpoint_artifact_id": kept}))
    await exports_marker(stack, job_id)

    record = await stack.store.get_export(asked.export_id)
    assert record.state == "failed" and record.reason.startswith("retired: checkpoint step-000000020-a1 deleted")
    assert [e.reason for e in export_failed(stack, asked.export_id)] == [record.reason]  # once
    assert await stack.store.get_export(ready.export_id) == ready
    assert export_failed(stack, ready.export_id) == []
    assert not stack.layout.exports_dir(TENANT, job_id).exists()  # nothing was converted
