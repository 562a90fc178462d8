"""The registry against the real broker and Redis: datasets, checkpoint and model artifacts.

The coordinator runs too (in-process), so checkpoints reach READY the real way.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from trainyard_contract import events as ev
from trainyard_contract.events import CheckpointRef
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import path_to_uri, sha256_file
from tests.support.datasets import published, write_dataset
from tests.integration.test_coordinator import (
    SPEC,
    TENANT,
    Stack,
    publish,
    shard_events,
    start_stack,
    stop_stack,
    wait_for,
    write_shards,
)

@pytest.fixture
async def stack(env: dict[str, Any]) -> AsyncIterator[Stack]:
    s = await start_stack(env, with_registry=True)
    try:
        yield s
    finally:
        await stop_stack(s)


def registry_group(stack: Stack, topic: str) -> str:
    """The registry reads all its topics in one consumer group."""
    return f"{stack.env['group_prefix']}.registry"


def dataset_event(stack: Stack, name: str = "tinycorpus", **kw: object) -> ev.DatasetVersionPublished:
    """A well-formed platform version written under the stack's artifact root, and its announcement."""
    return published(write_dataset(stack.layout, name, "v1"), tokenizer="byte-bpe@v1", **kw)


async def resumed_job(stack: Stack, job_id: str) -> tuple[int, str]:
    """A job on its second attempt, resumed from attempt 1's step-20 checkpoint."""
    from trainyard_runtime.leases import Device, LeaseManager

    leases = LeaseManager(stack.redis)
    epochs = [await leases.acquire(job_id, f"{job_id}-alloc-{n}", [Device(f"n{n}", 0), Device(f"n{n}", 1)])
              for n in (1, 2)]
    parent = path_to_uri(stack.layout.checkpoint_dir(TENANT, job_id, 1, 20) / "manifest.json")
    spec = TrainingSpec.model_validate(SPEC)
    await stack.store.create_job(JobRecord(
        job_id=job_id, tenant=TENANT, spec=spec, spec_hash=spec.spec_hash(), state="running",
        attempts=[
            AttemptRecord(attempt=1, allocation_id=f"{job_id}-alloc-1", epoch=epochs[0], world_size=2,
                          state="failed"),
            AttemptRecord(attempt=2, allocation_id=f"{job_id}-alloc-2", epoch=epochs[1], world_size=2,
                          start_checkpoint=CheckpointRef(manifest_uri=parent, global_step=20, attempt=1)),
        ],
    ))
    return epochs[1], parent


class _Messages(logging.Handler):
    """Collects log messages (the bus logs each retry of a retryable handler error)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def bus_log() -> Iterator[_Messages]:
    handler, logger = _Messages(), logging.getLogger("trainyard_runtime.bus")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


async def test_job_success_before_ready_checkpoint_still_yields_a_model_artifact(
    stack: Stack, bus_log: _Messages
) -> None:
    job_id = "job-model"
    epoch, parent = await resumed_job(stack, job_id)
    dataset = dataset_event(stack)
    await publish(stack, dataset)
    await wait_for(lambda: stack.store.get_dataset("tinycorpus@v1"), what="dataset")

    # Topics are not ordered with each other: the success arrives before any checkpoint is READY.
    await publish(stack, ev.JobStateChanged(job_id=job_id, tenant=TENANT, state="succeeded",
                                            previous_state="running", attempt=2))
    await wait_for(lambda: any("no READY checkpoint yet" in m for m in bus_log.messages),
                   what="the registry retrying the success")
    assert await stack.store.list_artifacts(job_id) == []

    await publish(stack, *shard_events(job_id, 40, write_shards(stack, job_id, 40, attempt=2), epoch=epoch,
                                       attempt=2))
    record = await wait_for(lambda: stack.settled(job_id, 40, attempt=2), what="READY checkpoint")
    assert record.state == "READY"
    artifacts = await wait_for(lambda: _both(stack, job_id), what="checkpoint and model artifacts")
    by_type = {a.type: a for a in artifacts}
    assert by_type["model"].artifact_id == f"{job_id}/model/step-000000040-a2"
    assert by_type["checkpoint"].artifact_id == f"{job_id}/checkpoint/step-000000040-a2"
    for artifact in artifacts:
        assert (artifact.uri, artifact.hash) == (record.manifest_uri, record.content_hash)
        assert (artifact.producer_attempt, artifact.global_step, artifact.tenant) == (2, 40, TENANT)
        assert artifact.lineage.parent_checkpoint == parent
        assert (artifact.lineage.dataset_manifest_uri, artifact.lineage.dataset_sha256) == (
            dataset.manifest_uri, dataset.sha256)
        assert artifact.lineage.tokenizer == "bpe512-test"  # the verified manifest's, not the event's claim

    # A re-delivered success records nothing new.
    await publish(stack, ev.JobStateChanged(job_id=job_id, tenant=TENANT, state="succeeded", attempt=2))
    await publish(stack, dataset_event(stack, "marker"))
    await wait_for(lambda: stack.store.get_dataset("marker@v1"), what="marker")
    assert len(await stack.store.list_artifacts(job_id)) == 2


async def test_a_script_that_saved_no_final_checkpoint_succeeds_without_a_model_and_holds_nothing_up(
    stack: Stack, bus_log: _Messages
) -> None:
    """User code without the SDK saves no checkpoint: its success has no model to wait for, and
    waiting for one anyway would hold every later success on that partition behind its retries."""
    from trainyard_contract.spec import Code

    spec = TrainingSpec.model_validate(SPEC).model_copy(
        update={"code": Code(archive="sha256:" + "c" * 64, entrypoint=["python", "train.py"])})
    plain = "job-plain-script"
    await stack.store.create_job(JobRecord(
        job_id=plain, tenant=TENANT, spec=spec, spec_hash=spec.spec_hash(), state="succeeded",
        attempts=[AttemptRecord(attempt=1, allocation_id=f"{plain}-alloc-1", epoch=1, world_size=2,
                                state="succeeded", final_saved=False)]))
    await publish(stack, ev.JobStateChanged(job_id=plain, tenant=TENANT, state="succeeded", attempt=1))

    # a job with a final checkpoint, succeeding right after on the same topic, still gets its model
    job_id = "job-after-plain"
    epoch, _ = await resumed_job(stack, job_id)
    await publish(stack, *shard_events(job_id, 40, write_shards(stack, job_id, 40, attempt=2), epoch=epoch,
                                       attempt=2))
    await wait_for(lambda: stack.settled(job_id, 40, attempt=2), what="READY checkpoint")
    await publish(stack, ev.JobStateChanged(job_id=job_id, tenant=TENANT, state="succeeded", attempt=2))
    await wait_for(lambda: _both(stack, job_id), what="the model artifact of the job after the plain script")
    assert await stack.store.list_artifacts(plain) == []
    assert not any(plain in m and "no READY checkpoint yet" in m for m in bus_log.messages)


async def _both(stack: Stack, job_id: str) -> list[Any] | None:
    artifacts = await stack.store.list_artifacts(job_id)
    return artifacts if {a.type for a in artifacts} == {"checkpoint", "model"} else None


async def test_unregistered_dataset_lineage_comes_from_its_manifest_and_forged_ready_is_refused(
    stack: Stack,
) -> None:
    job_id = "job-disk-dataset"
    epoch, _ = await resumed_job(stack, job_id)
    dataset_dir = stack.layout.dataset_dir("tinycorpus", "v1")
    dataset_dir.mkdir(parents=True)
    (dataset_dir / "manifest.json").write_text(json.dumps(
        {"name": "tinycorpus", "version": "v1", "tokenizer": {"name": "byte-bpe", "version": "v1"}, "shards": []}))

    forged = ev.CheckpointReady(job_id=job_id, tenant=TENANT, attempt=2, epoch=epoch, global_step=20, world_size=2,
                                manifest_uri="file:///nowhere/manifest.json", content_hash="sha256:" + "0" * 64)
    await publish(stack, forged)
    await publish(stack, *shard_events(job_id, 40, write_shards(stack, job_id, 40, attempt=2), epoch=epoch,
                                       attempt=2))
    (artifact,) = await wait_for(lambda: stack.store.list_artifacts(job_id), what="checkpoint artifact")
    assert artifact.global_step == 40
    assert artifact.lineage.dataset_manifest_uri == path_to_uri(dataset_dir / "manifest.json")
    assert artifact.lineage.dataset_sha256 == sha256_file(dataset_dir / "manifest.json")
    assert artifact.lineage.tokenizer == "byte-bpe@v1"

    letter = (await wait_for(
        lambda: stack.tail.of(ev.DeadLetter, consumer_group=registry_group(stack, ev.CHECKPOINTS)),
        what="dead letter for the forged event"))[0][0]
    assert "no checkpoint record" in letter.error
    assert json.loads(base64.b64decode(letter.raw_b64))["eventId"] == str(forged.event_id)
