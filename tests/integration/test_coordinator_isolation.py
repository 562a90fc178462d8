"""A malicious tenant against the real checkpoint coordinator (real broker, real Redis, a real
directory tree): issue 30, items 1 and 2.

* a rank swaps its verified step directory for a symlink to the victim's checkpoint directory, or to
  a platform dataset, before the manifest is committed: the commit is refused (FAILED, ``security:``),
  the link's target is untouched;
* a victim's ShardWritten re-published as the attacker's job, and a forged ShardWritten for the
  victim's job naming the attacker's files, are dead-lettered (``security: shard report refused``):
  nothing is recorded, the victim's checkpoints are as they were.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

import trainyard_checkpoint_coordinator.coordinator as coordinator_module
from trainyard_contract import events as ev
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import path_to_uri, sha256_file

from tests.integration.test_coordinator import SPEC, Stack, publish, start_stack, stop_stack, wait_for

VICTIM, ATTACKER = ("victim", "job-victim"), ("evil", "job-evil")


async def given_job(stack: Stack, tenant: str, job_id: str) -> int:
    spec = TrainingSpec.model_validate(SPEC)
    epoch = await LeaseManager(stack.redis).acquire(
        job_id, f"{job_id}-alloc-1", [Device(f"node-{job_id}", 0), Device(f"node-{job_id}", 1)])
    assert await stack.store.create_job(JobRecord(
        job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash(), state="running",
        attempts=[AttemptRecord(attempt=1, allocation_id=f"{job_id}-alloc-1", epoch=epoch, world_size=2)]))
    return epoch


def write_shards(stack: Stack, tenant: str, job_id: str, step: int) -> list[Path]:
    directory = stack.layout.checkpoint_dir(tenant, job_id, 1, step)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "__0_0.distcp", directory / "__1_0.distcp", directory / ".metadata"]
    for path in paths:
        path.write_bytes(os.urandom(4096 + len(path.name)))
    return paths


def shard_events(tenant: str, job_id: str, step: int, paths: list[Path], epoch: int) -> list[ev.ShardWritten]:
    *shards, metadata = paths
    meta = ev.FileDigest(uri=path_to_uri(metadata), size_bytes=metadata.stat().st_size, sha256=sha256_file(metadata))
    return [ev.ShardWritten(job_id=job_id, tenant=tenant, attempt=1, epoch=epoch, global_step=step, rank=rank,
                            world_size=2, uri=path_to_uri(path), size_bytes=path.stat().st_size,
                            sha256=sha256_file(path), extra_files=[meta] if rank == 0 else [])
            for rank, path in enumerate(shards)]


async def ready_checkpoint(stack: Stack, tenant: str, job_id: str, step: int, epoch: int,
                           published: list[ev.ShardWritten] | None = None) -> Path:
    """A READY checkpoint of ``job_id``; its manifest's path (its shard reports appended to ``published``)."""
    events = shard_events(tenant, job_id, step, write_shards(stack, tenant, job_id, step), epoch)
    await publish(stack, *events)
    (published if published is not None else []).extend(events)
    record = await wait_for(lambda: stack.settled(job_id, step), what=f"{job_id} step {step} settled")
    assert record.state == "READY", record.reason
    return stack.layout.checkpoint_dir(tenant, job_id, 1, step) / "manifest.json"


def dead_letters(stack: Stack) -> list[ev.DeadLetter]:
    return [e for e, _ in stack.tail.of(ev.DeadLetter) if e.source_topic == ev.CHECKPOINTS]


@pytest.fixture
async def stack(env: dict[str, Any]) -> Any:
    s = await start_stack(env)
    try:
        yield s
    finally:
        await stop_stack(s)


@pytest.mark.parametrize("target", ["victim-checkpoint", "platform-dataset"])
async def test_a_step_directory_swapped_for_a_link_after_verification_is_not_written_through(
        stack: Stack, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    victim_epoch = await given_job(stack, *VICTIM)
    victim_manifest = await ready_checkpoint(stack, *VICTIM, 40, victim_epoch)
    dataset = stack.layout.dataset_dir("tinycorpus", "v1")
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_bytes(b'{"name": "tinycorpus"}')
    link_to = victim_manifest.parent if target == "victim-checkpoint" else dataset
    before = {p.name: p.read_bytes() for p in link_to.iterdir()}

    epoch = await given_job(stack, *ATTACKER)
    mine = stack.layout.checkpoint_dir(*ATTACKER, 1, 40)
    real_verify = coordinator_module._verify

    def verify_then_swap(manifest: Any, root: Any = None) -> list[str]:
        problems = real_verify(manifest, root) if root is not None else real_verify(manifest)
        if manifest.job_id == ATTACKER[1]:  # the rank's move, between verification and commit
            os.rename(mine, mine.with_name(mine.name + "-moved"))
            mine.symlink_to(link_to, target_is_directory=True)
        return problems

    monkeypatch.setattr(coordinator_module, "_verify", verify_then_swap)
    await publish(stack, *shard_events(*ATTACKER, 40, write_shards(stack, *ATTACKER, 40), epoch))

    record = await wait_for(lambda: stack.settled(ATTACKER[1], 40), what="the attacker's checkpoint settled")
    assert record.state == "FAILED"
    assert record.reason.startswith("security: the manifest was not committed") and "symbolic link" in record.reason
    assert {p.name: p.read_bytes() for p in link_to.iterdir()} == before  # no manifest, no temporary file
    assert (await stack.settled(VICTIM[1], 40)).state == "READY"
    assert not (mine.with_name(mine.name + "-moved") / "manifest.json").exists()


@pytest.mark.parametrize("as_tenant", ["victim", "evil"])
async def test_a_victims_shard_report_replayed_as_the_attackers_job_is_refused(stack: Stack, as_tenant: str) -> None:
    victim_epoch = await given_job(stack, *VICTIM)
    seen: list[ev.ShardWritten] = []  # what the attacker read off the broker
    victim_manifest = await ready_checkpoint(stack, *VICTIM, 40, victim_epoch, seen)
    before = victim_manifest.read_bytes()
    epoch = await given_job(stack, *ATTACKER)
    replayed = [e.model_copy(update={"event_id": uuid.uuid4(), "job_id": ATTACKER[1], "tenant": as_tenant,
                                     "epoch": epoch}) for e in seen]
    await publish(stack, *replayed)

    letters = await wait_for(lambda: len(dead_letters(stack)) >= 2 and dead_letters(stack), what="dead letters")
    assert all("security: shard report refused" in d.error for d in letters)
    assert ("tenant 'victim' is not the tenant of job 'job-evil'" if as_tenant == "victim"
            else "not in the job's checkpoint directory") in letters[0].error
    assert await stack.record(ATTACKER[1], 40) is None  # nothing assembled, not even PENDING
    assert victim_manifest.read_bytes() == before


async def test_a_forged_shard_report_for_the_victims_job_naming_the_attackers_files_is_refused(stack: Stack) -> None:
    victim_epoch = await given_job(stack, *VICTIM)
    await ready_checkpoint(stack, *VICTIM, 40, victim_epoch)
    await given_job(stack, *ATTACKER)
    mine = write_shards(stack, *ATTACKER, 80)
    forged = shard_events(*VICTIM, 80, mine, victim_epoch)  # the victim's job, the attacker's weights
    await publish(stack, *forged)

    letters = await wait_for(lambda: len(dead_letters(stack)) >= 2 and dead_letters(stack), what="dead letters")
    assert all("security: shard report refused" in d.error and "not in the job's checkpoint directory" in d.error
               for d in letters)
    assert await stack.record(VICTIM[1], 80) is None
    records = await stack.store.list_checkpoints(VICTIM[1])
    assert [(r.global_step, r.state) for r in records] == [(40, "READY")]  # the latest READY is still hers


async def test_garbage_collection_through_a_swapped_checkpoints_directory_leaves_the_victims_files(
        stack: Stack, env: dict[str, Any]) -> None:
    from trainyard_checkpoint_coordinator import CoordinatorSettings
    from trainyard_checkpoint_coordinator.collector import GarbageCollector

    victim_epoch = await given_job(stack, *VICTIM)
    victim_manifest = await ready_checkpoint(stack, *VICTIM, 40, victim_epoch)
    before = {p.name: p.read_bytes() for p in victim_manifest.parent.iterdir()}
    epoch = await given_job(stack, *ATTACKER)
    events = shard_events(*ATTACKER, 40, write_shards(stack, *ATTACKER, 40), epoch)
    await publish(stack, *(e.model_copy(update={"sha256": "0" * 64}) for e in events))  # fails verification
    record = await wait_for(lambda: stack.settled(ATTACKER[1], 40), what="the attacker's checkpoint settled")
    assert record.state == "FAILED"
    mine = stack.layout.checkpoints_dir(*ATTACKER)  # the rank swaps it for the victim's, same step names
    os.rename(mine, mine.with_name("checkpoints-moved"))
    mine.symlink_to(stack.layout.checkpoints_dir(*VICTIM), target_is_directory=True)

    await GarbageCollector(stack.redis, CoordinatorSettings(**env)).collect_job(ATTACKER[1])
    assert {p.name: p.read_bytes() for p in victim_manifest.parent.iterdir()} == before
