"""The checkpoint coordinator (and the registry behind it) against the real broker and Redis.

Both services run in-process through their ServiceRuntime; the test publishes ShardWritten
for shard files it wrote itself, and reads the results from Redis, the disk and the topics.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from trainyard_checkpoint_coordinator import CoordinatorSettings
from trainyard_checkpoint_coordinator import build_service as build_coordinator
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.manifest import CheckpointManifest, tensors_hash
from trainyard_contract.records import AttemptRecord, CheckpointRecord, DatasetRecord, JobRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout, path_to_uri, sha256_file, uri_to_path
from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_registry import RegistrySettings
from trainyard_registry import build_service as build_registry
from trainyard_telemetry import TelemetryService, TelemetrySettings

TENANT = "acme"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
SPEC = {
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "rev-42",
    "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
    "checkpointPolicy": {"everySteps": 20, "keepLast": 3},
    "training": {"sequenceLength": 64, "microBatchSize": 8, "globalBatchSize": 32, "learningRate": 0.003,
                 "maxSteps": 40},
}


async def wait_for(probe: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    """Poll ``probe`` (sync or async) until it returns something truthy."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.1)


class TopicTail:
    """Reads every message of some topics from the beginning (no consumer group), with headers."""

    def __init__(self, bootstrap: str, namespace: str, topics: tuple[str, ...]) -> None:
        self.namespace = namespace
        self.consumer = AIOKafkaConsumer(*(namespace + t for t in topics), bootstrap_servers=bootstrap,
                                         group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
        self.messages: list[tuple[str, ev.Event | None, dict[str, str], bytes]] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.consumer.start()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for record in self.consumer:
            topic = record.topic[len(self.namespace):]
            headers = {k: v.decode() for k, v in record.headers or []}
            try:
                event: ev.Event | None = ev.decode_event(topic, record.value or b"")
            except ValueError:
                event = None
            self.messages.append((topic, event, headers, record.value or b""))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()

    def of(self, cls: type[ev.Event], **match: object) -> list[tuple[Any, dict[str, str]]]:
        return [(e, h) for _, e, h, _ in self.messages
                if isinstance(e, cls) and all(getattr(e, k) == v for k, v in match.items())]


@dataclass
class Stack:
    env: dict[str, Any]
    bus: Bus
    store: StateStore
    tail: TopicTail
    layout: ArtifactLayout
    runtimes: list[ServiceRuntime | TelemetryService] = field(default_factory=list)

    @property
    def redis(self):  # noqa: ANN201 - redis.asyncio.Redis
        return self.store.redis

    async def record(self, job_id: str, step: int, attempt: int = 1) -> CheckpointRecord | None:
        raw = await self.redis.hget(Keys.checkpoints(job_id), f"step-{step:09d}-a{attempt}")
        return CheckpointRecord.model_validate_json(raw) if raw else None

    async def settled(self, job_id: str, step: int, attempt: int = 1) -> CheckpointRecord | None:
        record = await self.record(job_id, step, attempt)
        return record if record and record.state != "PENDING" else None


async def start_stack(env: dict[str, Any], *, with_registry: bool = False, registry: dict[str, Any] | None = None,
                      with_telemetry: bool = False, tail_topics: tuple[str, ...] = (ev.CHECKPOINTS, ev.DEADLETTER),
                      **coordinator: object) -> Stack:
    """The coordinator (and, when asked, the registry, with ``registry`` settings, and the telemetry service,
    whose step-timing read model the interval advice reads) running in-process, plus a publisher and a tail
    of ``tail_topics``.

    Each consumer group join costs the broker a few seconds, so the registry runs only where
    a test looks at its records.
    """
    runtimes = [build_coordinator(CoordinatorSettings(**env, **coordinator))]
    if with_registry:
        runtimes.append(build_registry(RegistrySettings(**env, **(registry or {}))))
    if with_telemetry:
        runtimes.append(TelemetryService(TelemetrySettings(**env)))
    await runtimes[0].start()  # creates the namespaced topics too
    await asyncio.gather(*(runtime.start() for runtime in runtimes[1:]))
    bus = Bus(env["kafka_bootstrap"], service_name="test-ranks", group_prefix=env["group_prefix"],
              topic_namespace=env["topic_namespace"])
    await bus.start()
    tail = TopicTail(env["kafka_bootstrap"], env["topic_namespace"], tail_topics)
    await tail.start()
    return Stack(env, bus, StateStore(connect_redis(env["redis_url"])), tail,
                 ArtifactLayout(env["artifact_root"]), runtimes)


async def stop_stack(stack: Stack) -> None:
    await stack.tail.stop()
    await stack.bus.aclose()
    for runtime in stack.runtimes:
        await runtime.aclose()
    await stack.redis.aclose()


@pytest.fixture
async def stack(env: dict[str, Any]) -> AsyncIterator[Stack]:
    s = await start_stack(env)
    try:
        yield s
    finally:
        await stop_stack(s)


@pytest.fixture
async def full_stack(env: dict[str, Any]) -> AsyncIterator[Stack]:
    s = await start_stack(env, with_registry=True)
    try:
        yield s
    finally:
        await stop_stack(s)


# --------------------------------------------------------------------------- helpers


async def given_job(stack: Stack, job_id: str, *, allocations: int = 1) -> int:
    """A running job with its dataset registered; returns the fencing epoch of its lease."""
    spec = TrainingSpec.model_validate(SPEC)
    leases = LeaseManager(stack.redis)
    epoch = 0
    for n in range(1, allocations + 1):
        devices = [Device(f"node-{job_id}-{n}", 0), Device(f"node-{job_id}-{n}", 1)]
        epoch = await leases.acquire(job_id, f"{job_id}-alloc-{n}", devices)
    job = JobRecord(job_id=job_id, tenant=TENANT, spec=spec, spec_hash=spec.spec_hash(), state="running",
                    traceparent=TRACEPARENT,
                    attempts=[AttemptRecord(attempt=1, allocation_id=f"{job_id}-alloc-1", epoch=epoch, world_size=2)])
    assert await stack.store.create_job(job)
    await stack.store.put_dataset(DatasetRecord(
        name="tinycorpus", version="v1", manifest_uri="file:///data/tinycorpus/v1/manifest.json",
        sha256="ab" * 32, tokenizer="byte-bpe@v1"))
    return epoch


def write_shards(stack: Stack, job_id: str, step: int, *, attempt: int = 1, world: int = 2) -> list[Path]:
    """Real shard files (as DCP names them) plus the shared .metadata, in the checkpoint directory."""
    directory = stack.layout.checkpoint_dir(TENANT, job_id, attempt, step)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"__{rank}_0.distcp" for rank in range(world)] + [directory / ".metadata"]
    for path in paths:
        path.write_bytes(os.urandom(32 * 1024 + len(path.name)))
    return paths


def tensor_digests(rank: int, step: int) -> list[ev.TensorDigest]:
    """What a rank reports it saved: rank 0 the (de-duplicated) weights, every rank its own RNG state."""
    mine = [ev.TensorDigest(key=f"rng.rank_{rank}.torch", offset=[0], sha256=sha256_hex(f"rng {rank} {step}"))]
    if rank == 0:
        mine.append(ev.TensorDigest(key="model.w", offset=[0, 0], sha256=sha256_hex(f"w {step}")))
    return mine


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def shard_events(job_id: str, step: int, paths: list[Path], *, epoch: int, attempt: int = 1) -> list[ev.ShardWritten]:
    """One ShardWritten per rank, digests taken from the files; rank 0 reports .metadata."""
    *shards, metadata = paths
    meta = ev.FileDigest(uri=path_to_uri(metadata), size_bytes=metadata.stat().st_size,
                         sha256=sha256_file(metadata))
    return [
        ev.ShardWritten(
            job_id=job_id, tenant=TENANT, attempt=attempt, epoch=epoch, global_step=step, rank=rank,
            world_size=len(shards), uri=path_to_uri(path), size_bytes=path.stat().st_size,
            sha256=sha256_file(path), extra_files=[meta] if rank == 0 else [],
            consumed_tokens=step * 2048, consumed_samples=step * 32, spec_hash="sha256:spec",
            parallelism={"dp": len(shards), "tp": 1, "pp": 1}, tensor_digests=tensor_digests(rank, step),
        )
        for rank, path in enumerate(shards)
    ]


async def publish(stack: Stack, *events: ev.Event) -> None:
    for event in events:
        await stack.bus.publish(event, traceparent=TRACEPARENT)


def trace_id(headers: dict[str, str]) -> str:
    return headers.get("traceparent", "--").split("-")[1]


# --------------------------------------------------------------------------- tests


async def test_all_shards_make_a_ready_checkpoint_with_manifest_event_and_artifact(full_stack: Stack) -> None:
    stack = full_stack
    job_id = "job-ready"
    epoch = await given_job(stack, job_id)
    paths = write_shards(stack, job_id, 40)
    rank0, rank1 = shard_events(job_id, 40, paths, epoch=epoch)
    await publish(stack, rank1, rank0)

    record = await wait_for(lambda: stack.settled(job_id, 40), what="checkpoint settled")
    assert record.state == "READY", record.reason
    assert record.epoch == epoch and record.consumed_tokens == 40 * 2048

    # The manifest sits next to the shards, and what it lists is what is on disk.
    manifest_path = uri_to_path(record.manifest_uri)
    assert manifest_path == paths[0].parent / "manifest.json"
    manifest = CheckpointManifest.model_validate_json(manifest_path.read_bytes())
    assert (manifest.job_id, manifest.tenant, manifest.attempt, manifest.global_step, manifest.world_size) == (
        job_id, TENANT, 1, 40, 2)
    assert manifest.epoch == epoch and manifest.parallelism.dp == 2 and manifest.spec_hash == "sha256:spec"
    assert [s.rank for s in manifest.shards] == [0, 1]
    for shard in manifest.shards:
        on_disk = uri_to_path(shard.uri)
        assert on_disk == paths[shard.rank]
        assert shard.sha256 == sha256_file(on_disk) and shard.size_bytes == on_disk.stat().st_size
    assert [Path(uri_to_path(f.uri)).name for f in manifest.extra_files] == [".metadata"]
    assert manifest.extra_files[0].sha256 == sha256_file(paths[-1])
    assert manifest.content_hash == record.content_hash
    # the ranks' entry digests, combined in canonical order: the values' hash, beside the files' one
    reported = tensor_digests(0, 40) + tensor_digests(1, 40)
    assert manifest.tensors == sorted(reported, key=lambda d: d.key)
    assert manifest.tensors_hash == tensors_hash(reported) == record.tensors_hash != manifest.content_hash
    assert record.size_bytes == sum(p.stat().st_size for p in paths)  # the shards and .metadata on disk
    assert record.size_bytes == sum(s.size_bytes for s in manifest.shards) + manifest.extra_files[0].size_bytes
    assert not [p for p in manifest_path.parent.iterdir() if p.name.startswith(".manifest.json.tmp")]

    # CheckpointReady went out, in the job's trace.
    ready, headers = (await wait_for(lambda: stack.tail.of(ev.CheckpointReady, job_id=job_id),
                                     what="CheckpointReady"))[0]
    assert (ready.global_step, ready.attempt, ready.epoch, ready.world_size) == (40, 1, epoch, 2)
    assert ready.manifest_uri == record.manifest_uri and ready.content_hash == manifest.content_hash
    assert ready.tensors_hash == manifest.tensors_hash
    assert trace_id(headers) == TRACE_ID

    # The registry recorded it with lineage.
    artifacts = await wait_for(lambda: stack.store.list_artifacts(job_id), what="checkpoint artifact")
    (artifact,) = artifacts
    assert artifact.artifact_id == f"{job_id}/checkpoint/step-000000040-a1" and artifact.type == "checkpoint"
    assert (artifact.uri, artifact.hash, artifact.producer_attempt, artifact.global_step) == (
        record.manifest_uri, manifest.content_hash, 1, 40)
    assert artifact.tensors_hash == manifest.tensors_hash
    job = await stack.store.get_job(job_id)
    assert job is not None
    lineage = artifact.lineage
    assert lineage.spec_hash == job.spec_hash and lineage.code_revision == "rev-42"
    assert (lineage.dataset, lineage.dataset_sha256, lineage.tokenizer) == ("tinycorpus@v1", "ab" * 32, "byte-bpe@v1")
    assert lineage.model_config_ref == "gpt-tiny@v1" and lineage.parent_checkpoint is None
    assert await stack.redis.zcard("ty:ckpt-pending") == 0


async def test_duplicate_shard_reports_make_one_ready_and_one_event(stack: Stack) -> None:
    job_id = "job-dup"
    epoch = await given_job(stack, job_id)
    rank0, rank1 = shard_events(job_id, 20, write_shards(stack, job_id, 20), epoch=epoch)
    again = rank0.model_copy(update={"event_id": uuid.uuid4()})  # same report, new envelope (a re-send)
    await publish(stack, rank0, rank0, rank1, rank1, again, rank0)
    # A later checkpoint of the same job (same partition, so processed after the duplicates) marks the end.
    later = shard_events(job_id, 40, write_shards(stack, job_id, 40), epoch=epoch)
    await publish(stack, *later)
    await wait_for(lambda: stack.settled(job_id, 40), what="marker checkpoint")
    await wait_for(lambda: stack.tail.of(ev.CheckpointReady, job_id=job_id, global_step=40), what="marker event")

    record = await stack.record(job_id, 20)
    assert record is not None and record.state == "READY"
    assert len(stack.tail.of(ev.CheckpointReady, job_id=job_id, global_step=20)) == 1
    assert stack.tail.of(ev.CheckpointFailed, job_id=job_id) == []
    assert await stack.redis.hlen(Keys.shards(job_id, 1, 20)) == 2


async def test_a_shard_corrupted_after_reporting_fails_the_checkpoint_without_manifest(stack: Stack) -> None:
    job_id = "job-corrupt"
    epoch = await given_job(stack, job_id)
    paths = write_shards(stack, job_id, 40)
    rank0, rank1 = shard_events(job_id, 40, paths, epoch=epoch)
    data = bytearray(paths[1].read_bytes())
    data[100] ^= 0xFF  # same size, different content: only the sha256 can tell
    paths[1].write_bytes(bytes(data))
    await publish(stack, rank0, rank1)

    record = await wait_for(lambda: stack.settled(job_id, 40), what="checkpoint settled")
    assert record.state == "FAILED"
    assert "rank 1 shard sha256" in (record.reason or "")
    assert record.manifest_uri is None
    assert not (paths[0].parent / "manifest.json").exists()
    failed, headers = (await wait_for(lambda: stack.tail.of(ev.CheckpointFailed, job_id=job_id),
                                      what="CheckpointFailed"))[0]
    assert failed.global_step == 40 and "rank 1" in failed.reason and trace_id(headers) == TRACE_ID
    assert stack.tail.of(ev.CheckpointReady, job_id=job_id) == []


async def test_a_rank_reporting_different_content_twice_fails_the_checkpoint(stack: Stack) -> None:
    job_id = "job-conflict"
    epoch = await given_job(stack, job_id)
    paths = write_shards(stack, job_id, 40)
    rank0, rank1 = shard_events(job_id, 40, paths, epoch=epoch)
    other = rank1.model_copy(update={"event_id": uuid.uuid4(), "sha256": "0" * 64})
    await publish(stack, rank1, other, rank0)

    record = await wait_for(lambda: stack.settled(job_id, 40), what="checkpoint settled")
    assert record.state == "FAILED" and "rank 1 reported its shard twice" in (record.reason or "")
    assert not (paths[0].parent / "manifest.json").exists()
    await wait_for(lambda: stack.tail.of(ev.CheckpointFailed, job_id=job_id), what="CheckpointFailed")
    assert stack.tail.of(ev.CheckpointReady, job_id=job_id) == []


async def test_a_stale_epoch_shard_set_never_becomes_ready(stack: Stack) -> None:
    job_id = "job-zombie"
    current = await given_job(stack, job_id, allocations=2)  # a second allocation fenced the first
    zombie = current - 1
    stale_paths = write_shards(stack, job_id, 40)
    await publish(stack, *shard_events(job_id, 40, stale_paths, epoch=zombie))
    # The live attempt's checkpoint (same job, same partition) is processed after the zombie's.
    live = shard_events(job_id, 40, write_shards(stack, job_id, 40, attempt=2), epoch=current, attempt=2)
    await publish(stack, *live)
    live_record = await wait_for(lambda: stack.settled(job_id, 40, attempt=2), what="live checkpoint")
    assert live_record.state == "READY"

    await wait_for(lambda: stack.tail.of(ev.CheckpointReady, job_id=job_id), what="live CheckpointReady")

    assert await stack.record(job_id, 40, attempt=1) is None
    assert not (stale_paths[0].parent / "manifest.json").exists()
    assert [e.attempt for e, _ in stack.tail.of(ev.CheckpointReady, job_id=job_id)] == [2]
    assert await stack.redis.exists(Keys.shards(job_id, 1, 40)) == 0


async def test_malformed_messages_are_dead_lettered_and_the_coordinator_carries_on(stack: Stack) -> None:
    job_id = "job-after-garbage"
    epoch = await given_job(stack, job_id)
    await stack.bus.publish_raw(ev.CHECKPOINTS, b"\x00not json at all", key=job_id)
    invalid = b'{"eventType":"ShardWritten","jobId":"%s","rank":-1}' % job_id.encode()
    await stack.bus.publish_raw(ev.CHECKPOINTS, invalid, key=job_id)
    await publish(stack, *shard_events(job_id, 40, write_shards(stack, job_id, 40), epoch=epoch))

    record = await wait_for(lambda: stack.settled(job_id, 40), what="checkpoint after garbage")
    assert record.state == "READY"
    group = f"{stack.env['group_prefix']}.checkpoint-coordinator"

    def coordinator_letters() -> list[ev.DeadLetter]:
        return [e for e, _ in stack.tail.of(ev.DeadLetter, consumer_group=group, source_topic=ev.CHECKPOINTS)]

    letters = await wait_for(lambda: len(coordinator_letters()) >= 2 and coordinator_letters(),
                             what="two dead letters from the coordinator")
    assert sorted(base64.b64decode(letter.raw_b64) for letter in letters) == sorted([b"\x00not json at all", invalid])
    assert all("invalid event" in letter.error for letter in letters)


async def test_a_checkpoint_missing_a_rank_times_out_as_failed(env: dict[str, Any]) -> None:
    stack = await start_stack(env, shard_timeout_s=1.0, sweep_interval_s=0.2)
    try:
        job_id = "job-timeout"
        epoch = await given_job(stack, job_id)
        rank0, _ = shard_events(job_id, 40, write_shards(stack, job_id, 40), epoch=epoch)
        await publish(stack, rank0)
        record = await wait_for(lambda: stack.settled(job_id, 40), what="timed-out checkpoint")
        assert record.state == "FAILED" and "timed out" in (record.reason or "") and "[1]" in (record.reason or "")
        failed, headers = (await wait_for(lambda: stack.tail.of(ev.CheckpointFailed, job_id=job_id),
                                          what="CheckpointFailed"))[0]
        assert "timed out" in failed.reason
        assert trace_id(headers) == TRACE_ID  # the sweep acts inside the job's trace
        assert await stack.redis.zcard("ty:ckpt-pending") == 0
    finally:
        await stop_stack(stack)


async def test_a_half_collected_set_of_a_fenced_attempt_fails_at_once_not_after_the_timeout(
        env: dict[str, Any]) -> None:
    """Its other ranks are gone (a newer attempt holds the job's epoch): waiting for the shard
    timeout would only keep the job's newest checkpoint PENDING for 15 minutes."""
    stack = await start_stack(env, shard_timeout_s=3600.0, sweep_interval_s=0.2)
    try:
        job_id = "job-fenced-half"
        epoch = await given_job(stack, job_id)
        rank0, _ = shard_events(job_id, 40, write_shards(stack, job_id, 40), epoch=epoch)
        await publish(stack, rank0)
        await wait_for(lambda: stack.redis.hlen(Keys.shards(job_id, 1, 40)), what="rank 0's shard recorded")
        assert (await stack.record(job_id, 40)).state == "PENDING"

        newer = await LeaseManager(stack.redis).acquire(job_id, f"{job_id}-alloc-2",
                                                        [Device(f"node-{job_id}-2", 0), Device(f"node-{job_id}-2", 1)])
        assert newer > epoch  # the next attempt was placed
        record = await wait_for(lambda: stack.settled(job_id, 40), what="the fenced checkpoint settled")
        assert record.state == "FAILED" and "fenced" in (record.reason or ""), record.reason
        failed = await wait_for(lambda: stack.tail.of(ev.CheckpointFailed, job_id=job_id), what="CheckpointFailed")
        assert "fenced" in failed[0][0].reason
        assert await stack.redis.zcard("ty:ckpt-pending") == 0
    finally:
        await stop_stack(stack)


async def test_both_services_run_as_processes_and_stop_cleanly_on_sigterm(env: dict[str, Any]) -> None:
    """``python -m`` each service, wait for its health beacon, SIGTERM it: exit 0, beacon gone."""
    import signal
    import socket
    import sys

    from tests.conftest import env_vars

    redis = connect_redis(env["redis_url"])
    services = {"checkpoint-coordinator": "trainyard_checkpoint_coordinator", "registry": "trainyard_registry"}
    procs = {
        name: await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, env={**os.environ, **env_vars(env), "TRAINYARD_LOG_LEVEL": "WARNING"},
            stderr=asyncio.subprocess.PIPE)
        for name, module in services.items()
    }
    try:
        for name, proc in procs.items():
            beacon = Keys.health(name, f"{socket.gethostname()}:{proc.pid}")
            await wait_for(lambda b=beacon: redis.exists(b), timeout_s=90, what=f"{name} health beacon")
        for name, proc in procs.items():
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, (name, stderr.decode()[-2000:])
            assert not await redis.exists(Keys.health(name, f"{socket.gethostname()}:{proc.pid}"))
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await redis.aclose()
