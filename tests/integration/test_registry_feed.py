"""The registry's public feed (trainyard.registry) against the real broker and Redis: every checkpoint
and model artifact is announced exactly once, however often its event is re-delivered, and so is
every retirement; a late READY for a checkpoint retired since announces Registered, then Retired.

The coordinator runs too (in-process), so checkpoints reach READY the real way; a tail reads the
feed from the beginning, so nothing it announced can be missed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_contract import events as ev
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import ArtifactRecord, CheckpointRecord, Lineage
from trainyard_runtime.store import StateStore, connect_redis
from trainyard_registry.lineage import registered
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
    s = await start_stack(env, with_registry=True, registry={"retire_interval_s": 0.5},
                          tail_topics=(ev.CHECKPOINTS, ev.REGISTRY, ev.DEADLETTER))
    try:
        yield s
    finally:
        await stop_stack(s)


def feed(stack: Stack, job_id: str) -> list[ev.ArtifactRegistered | ev.ArtifactRetired]:
    """What the feed said about ``job_id``, in order."""
    return [e for _, e, _, _ in stack.tail.messages
            if isinstance(e, (ev.ArtifactRegistered, ev.ArtifactRetired)) and e.job_id == job_id]


def announced(stack: Stack, cls: type, job_id: str, artifact_id: str) -> list[Any]:
    return [e for e in feed(stack, job_id) if isinstance(e, cls) and e.artifact_id == artifact_id]


async def ready_checkpoint(stack: Stack, job_id: str, step: int, epoch: int) -> ev.CheckpointReady:
    await publish(stack, *shard_events(job_id, step, write_shards(stack, job_id, step), epoch=epoch))
    record = await wait_for(lambda: stack.settled(job_id, step), what=f"step {step} settled")
    assert record.state == "READY", record.reason
    ready, _ = (await wait_for(lambda: stack.tail.of(ev.CheckpointReady, job_id=job_id, global_step=step),
                               what="CheckpointReady"))[0]
    return ready


def ckpt_id(job_id: str, step: int, kind: str = "checkpoint") -> str:
    return f"{job_id}/{kind}/step-{step:09d}-a1"


async def test_each_artifact_and_each_retirement_is_announced_once_under_redelivery(stack: Stack) -> None:
    job_id = "job-feed"
    epoch = await given_job(stack, job_id)
    ready20 = await ready_checkpoint(stack, job_id, 20, epoch)
    (first,) = await wait_for(lambda: announced(stack, ev.ArtifactRegistered, job_id, ckpt_id(job_id, 20)),
                              what="step 20 announced")
    (artifact,) = await stack.store.list_artifacts(job_id)
    assert (first.kind, first.tenant, first.global_step) == ("checkpoint", TENANT, 20)
    assert (first.uri, first.hash) == (artifact.uri, artifact.hash) == (ready20.manifest_uri, ready20.content_hash)
    assert first.consumed_tokens == artifact.consumed_tokens == 20 * 2048
    assert first.lineage is not None
    assert first.lineage.model_dump(by_alias=True, exclude_none=True) == artifact.lineage.model_dump(
        by_alias=True, exclude_none=True)

    # Re-delivered: the same message (the outbox relay crashed before deleting it) and a copy with a new
    # event id. Step 40 after them, on the same key, is the marker: once the feed has it, they were handled.
    await publish(stack, ready20, ready20.model_copy(update={"event_id": ev.uuid4()}))
    await ready_checkpoint(stack, job_id, 40, epoch)
    await wait_for(lambda: announced(stack, ev.ArtifactRegistered, job_id, ckpt_id(job_id, 40)),
                   what="step 40 announced")
    assert len(announced(stack, ev.ArtifactRegistered, job_id, ckpt_id(job_id, 20))) == 1

    # The job succeeds (twice, as a re-delivery would): one model, its latest READY checkpoint.
    success = ev.JobStateChanged(job_id=job_id, tenant=TENANT, state="succeeded", previous_state="running", attempt=1)
    await publish(stack, success, success.model_copy(update={"event_id": ev.uuid4()}))
    (model,) = await wait_for(lambda: announced(stack, ev.ArtifactRegistered, job_id, ckpt_id(job_id, 40, "model")),
                              what="model announced")
    assert model.kind == "model" and model.global_step == 40

    # Retention deletes step 20 (what it does to the record; the collector's own test covers the files).
    record = await stack.record(job_id, 20)
    await stack.store.put_checkpoint(record.model_copy(update={"state": "DELETED", "reason": "keepLast 1"}))
    (retired,) = await wait_for(lambda: announced(stack, ev.ArtifactRetired, job_id, ckpt_id(job_id, 20)),
                                what="step 20's retirement announced")
    assert (retired.kind, retired.tenant, retired.uri, retired.hash) == ("checkpoint", TENANT, first.uri, first.hash)
    assert "deleted by retention" in retired.reason and "keepLast 1" in retired.reason

    # Step 40 is refused at restore, twice: its checkpoint and its model retire, each announced once,
    # and the sweeps that ran meanwhile announced step 20's retirement no second time.
    refused = ev.CheckpointRefused(job_id=job_id, tenant=TENANT, attempt=2, manifest_uri=model.uri, global_step=40,
                                   checkpoint_attempt=1, problems=["rank 1: sha256 mismatch"])
    await publish(stack, refused, refused.model_copy(update={"event_id": ev.uuid4()}))
    await wait_for(lambda: announced(stack, ev.ArtifactRetired, job_id, ckpt_id(job_id, 40, "model")),
                   what="the model's retirement announced")
    await wait_for(lambda: announced(stack, ev.ArtifactRetired, job_id, ckpt_id(job_id, 40)),
                   what="step 40's retirement announced")
    late_marker = await ready_checkpoint(stack, job_id, 60, epoch)
    await wait_for(lambda: announced(stack, ev.ArtifactRegistered, job_id, ckpt_id(job_id, 60)),
                   what="step 60 announced")
    assert late_marker.global_step == 60
    counts = [(type(e).__name__, e.artifact_id) for e in feed(stack, job_id)]
    assert sorted(counts) == sorted(set(counts)), counts  # nothing announced twice
    assert stack.tail.of(ev.DeadLetter) == []


async def test_a_late_ready_for_a_retired_checkpoint_announces_registered_then_retired(stack: Stack) -> None:
    job_id = "job-feed-late"
    epoch = await given_job(stack, job_id)
    ready = await ready_checkpoint(stack, job_id, 20, epoch)
    await wait_for(lambda: announced(stack, ev.ArtifactRegistered, job_id, ckpt_id(job_id, 20)),
                   what="step 20 announced")

    # A checkpoint whose READY event reaches the registry only after retention deleted it: its record is
    # DELETED with the READY record's manifest and hash (as retention leaves it), the registry has none.
    late = ready.model_copy(update={"event_id": ev.uuid4(), "global_step": 30,
                                    "manifest_uri": ready.manifest_uri.replace("step-000000020", "step-000000030")})
    await stack.store.put_checkpoint(CheckpointRecord(
        job_id=job_id, tenant=TENANT, attempt=1, epoch=epoch, global_step=30, world_size=2, state="DELETED",
        manifest_uri=late.manifest_uri, content_hash=late.content_hash, reason="keepLast 1"))
    await publish(stack, late, late.model_copy(update={"event_id": ev.uuid4()}))
    await ready_checkpoint(stack, job_id, 40, epoch)  # the marker, on the same key
    await wait_for(lambda: announced(stack, ev.ArtifactRegistered, job_id, ckpt_id(job_id, 40)),
                   what="step 40 announced")

    about_30 = [e for e in feed(stack, job_id) if e.artifact_id == ckpt_id(job_id, 30)]
    assert [type(e) for e in about_30] == [ev.ArtifactRegistered, ev.ArtifactRetired]  # once each, in order
    registered, retired = about_30
    assert (registered.uri, registered.hash) == (retired.uri, retired.hash) == (late.manifest_uri, late.content_hash)
    assert "deleted by retention" in retired.reason
    recorded = next(a for a in await stack.store.list_artifacts(job_id) if a.global_step == 30)
    assert recorded.retired_at is not None  # the record and the feed agree
    assert stack.tail.of(ev.DeadLetter) == []


async def test_concurrent_creates_of_one_artifact_announce_it_once(env: dict[str, Any]) -> None:
    """Registry instances racing on one artifact (a rebalance mid-handler): one creates it and announces it."""
    store = StateStore(connect_redis(env["redis_url"]))
    outbox = Outbox(store.redis, "registry-race")
    artifact = ArtifactRecord(
        artifact_id="job-race/checkpoint/step-000000020-a1", job_id="job-race", tenant=TENANT, type="checkpoint",
        uri="file:///art/job-race/step-000000020-a1/manifest.json", hash="sha256:" + "c" * 64, producer_attempt=1,
        global_step=20, lineage=Lineage(spec_hash="sha256:spec", code_revision="rev", dataset="tinycorpus@v1"))

    def stage(pipe: Any) -> None:
        outbox.stage(pipe, registered(artifact, now=ev.utcnow()))

    try:
        created = await asyncio.gather(*(store.create_artifact(artifact, stage) for _ in range(8)))
        assert sorted(created) == [False] * 7 + [True]
        assert await outbox.pending() == 1
        assert await store.list_artifacts("job-race") == [artifact]
    finally:
        await store.redis.aclose()
