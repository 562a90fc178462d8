"""Real torch ranks (``python -m trainyard_trainer``, gloo, 2 processes) on a real dataset.

One uninterrupted run writes checkpoints at steps 3 and 6; a second attempt resumes from the
step-3 checkpoint (its manifest written the way the coordinator writes it) and must end with
exactly the same bits; a corrupted shard must be refused with exit code CHECKPOINT.
No broker or Redis is involved: ranks hand events to their spool files.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainyard_common import exitcodes
from trainyard_common.events import CheckpointRef, GangAllocated, NodeAssignment, RankAssignment, ShardWritten, StepMetrics
from trainyard_common.manifest import CheckpointManifest, ParallelLayout, ShardEntry, content_hash
from trainyard_common.spec import TrainingSpec
from trainyard_common.storage import ArtifactLayout, atomic_write_bytes, path_to_uri, sha256_file, uri_to_path
from trainyard_trainer.data import STDLIB_SOURCES, prepare_dataset
from tests.support.otlp import OtlpSink

WORLD = 2
MAX_STEPS = 6
EVERY = 3
TENANT = "acme"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_spec() -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1",
        # gpt-tiny's shape, with dropout: the RNG streams then shape the weights, so a resume
        # that lost a rank's generator state could not end bitwise identical.
        "modelConfig": {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 64, "maxSeqLen": 64,
                        "dropout": 0.1},
        "dataset": "tinycorpus@v1",
        "codeRevision": "test",
        "resources": {"gpuType": "cpu", "gpuCount": WORLD},
        "parallelism": {"data": WORLD},
        "checkpointPolicy": {"everySteps": EVERY},
        "training": {
            "seed": 7, "sequenceLength": 32, "microBatchSize": 4, "globalBatchSize": 16,
            "learningRate": 3e-3, "lrSchedule": {"name": "cosine", "warmupSteps": 2}, "maxSteps": MAX_STEPS,
        },
    })


@dataclass
class RunResult:
    codes: list[int]
    logs: list[str]
    events: list[list[dict[str, Any]]]  # per rank: spool records

    def of(self, cls: type) -> list[Any]:
        name = cls.model_fields["event_type"].default
        return [cls.model_validate(r["payload"]) for rank in self.events for r in rank if r["payload"]["eventType"] == name]


def run_attempt(
    root: Path, job_id: str, attempt: int, start: CheckpointRef | None = None, otlp_endpoint: str | None = None
) -> RunResult:
    """Launch WORLD rank processes with the node agent's env contract and wait for them."""
    spec = small_spec()
    layout = ArtifactLayout(root)
    port = free_port()
    allocation = GangAllocated(
        job_id=job_id, tenant=TENANT, attempt=attempt, allocation_id=f"alloc-{attempt}", epoch=attempt,
        world_size=WORLD, master_addr="127.0.0.1", master_port=port, start_checkpoint=start,
        nodes=[NodeAssignment(node_id="n0", host="localhost",
                              ranks=[RankAssignment(rank=r, local_rank=r, device_index=r) for r in range(WORLD)])],
        spec=spec, spec_hash=spec.spec_hash(),
    )
    alloc_file = layout.attempt_dir(TENANT, job_id, attempt) / "allocation.json"
    atomic_write_bytes(alloc_file, allocation.to_bytes())
    procs, logs = [], []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OTEL_"))}
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRAINYARD_BACKEND": "gloo",
            "TRAINYARD_DEVICE_INDEX": str(rank), "TRAINYARD_JOB_ID": job_id, "TRAINYARD_TENANT": TENANT,
            "TRAINYARD_ATTEMPT": str(attempt), "TRAINYARD_EPOCH": str(attempt),
            "TRAINYARD_ALLOCATION_ID": allocation.allocation_id, "TRAINYARD_ARTIFACT_ROOT": str(root),
            "TRAINYARD_ALLOCATION_FILE": str(alloc_file),
            "TRAINYARD_EVENTS_FILE": str(layout.rank_events(TENANT, job_id, attempt, rank)),
            "TRAINYARD_COLLECTIVE_TIMEOUT_S": "120", "TRACEPARENT": TRACEPARENT,
        })
        if otlp_endpoint:
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        else:
            env["OTEL_TRACES_EXPORTER"] = "none"
        log_path = layout.rank_log(TENANT, job_id, attempt, rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "trainyard_trainer"], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
        logs.append(log_path)
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    events = []
    for rank in range(WORLD):
        path = layout.rank_events(TENANT, job_id, attempt, rank)
        lines = path.read_text().splitlines() if path.exists() else []
        events.append([json.loads(line) for line in lines])
    return RunResult(codes=codes, logs=[p.read_text() for p in logs], events=events)


def shards_of(result: RunResult, step: int) -> list[ShardWritten]:
    return sorted((e for e in result.of(ShardWritten) if e.global_step == step), key=lambda e: e.rank)


def write_manifest(shards: list[ShardWritten]) -> Path:
    """What the checkpoint coordinator does once every rank reported: manifest.json beside the shards."""
    entries = [ShardEntry(rank=s.rank, uri=s.uri, size_bytes=s.size_bytes, sha256=s.sha256) for s in shards]
    extra = [f for s in shards for f in s.extra_files]
    first = shards[0]
    manifest = CheckpointManifest(
        job_id=first.job_id, tenant=first.tenant, attempt=first.attempt, epoch=first.epoch,
        global_step=first.global_step, world_size=first.world_size, parallelism=ParallelLayout(**first.parallelism),
        consumed_tokens=first.consumed_tokens, consumed_samples=first.consumed_samples, spec_hash=first.spec_hash,
        shards=entries, extra_files=extra, content_hash=content_hash(entries, extra),
    )
    path = uri_to_path(first.uri).parent / "manifest.json"
    atomic_write_bytes(path, manifest.to_bytes())
    return path


def ref_for(manifest_path: Path) -> CheckpointRef:
    m = CheckpointManifest.model_validate_json(manifest_path.read_bytes())
    return CheckpointRef(manifest_uri=path_to_uri(manifest_path), global_step=m.global_step,
                         attempt=m.attempt, content_hash=m.content_hash)


def load_whole(directory: Path, tmp: Path) -> dict[str, Any]:
    """Every saved value of a DCP checkpoint, in this single process (no process group)."""
    out = tmp / f"{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)


def assert_bitwise_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        raw_a, raw_b = (t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(raw_a, raw_b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer") / "artifacts"
    # A few stdlib files are plenty for 6 steps; the tokenizer still has 1024 entries or fewer.
    prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:6])
    return root


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with OtlpSink() as s:
        yield s


@pytest.fixture(scope="module")
def first_run(root: Path, sink: OtlpSink) -> RunResult:
    return run_attempt(root, "job-a", attempt=1, otlp_endpoint=sink.endpoint)


# ----------------------------------------------------------------------------- tests


def test_uninterrupted_run_checkpoints_and_reports(root: Path, first_run: RunResult) -> None:
    assert first_run.codes == [0] * WORLD, "\n".join(first_run.logs)
    layout = ArtifactLayout(root)
    for step in (EVERY, MAX_STEPS):
        directory = layout.checkpoint_dir(TENANT, "job-a", 1, step)
        assert directory.is_dir() and not directory.with_name(directory.name + ".tmp").exists()
        shards = shards_of(first_run, step)
        assert [s.rank for s in shards] == list(range(WORLD))
        for s in shards:
            path = uri_to_path(s.uri)
            assert path.parent == directory and path.name == f"__{s.rank}_0.distcp"
            assert path.stat().st_size == s.size_bytes and sha256_file(path) == s.sha256
            assert (s.world_size, s.consumed_samples, s.parallelism) == (WORLD, step * 16, {"dp": 2, "tp": 1, "pp": 1})
            assert s.consumed_tokens == step * 16 * 32 and s.spec_hash == small_spec().spec_hash()
        (meta,) = shards[0].extra_files
        assert uri_to_path(meta.uri) == directory / ".metadata" and sha256_file(directory / ".metadata") == meta.sha256
        assert shards[1].extra_files == []
    assert len(shards_of(first_run, 1)) == 0

    metrics = first_run.of(StepMetrics)
    for rank in range(WORLD):
        mine = sorted((m for m in metrics if m.rank == rank), key=lambda m: m.step)
        assert [m.step for m in mine] == list(range(1, MAX_STEPS + 1))
        assert all(m.max_steps == MAX_STEPS and m.loss > 0 and m.step_seconds > 0 for m in mine)
        assert [m.consumed_tokens for m in mine] == [s * 16 * 32 for s in range(1, MAX_STEPS + 1)]
        assert mine[EVERY - 1].checkpoint_seconds > 0 and mine[0].checkpoint_seconds == 0
    # The loss is the global-batch mean: every rank reports the same number.
    by_step = {}
    for m in metrics:
        by_step.setdefault(m.step, set()).add(m.loss)
    assert all(len(losses) == 1 for losses in by_step.values())


def test_ranks_trace_into_the_jobs_trace(first_run: RunResult, sink: OtlpSink) -> None:
    assert first_run.codes == [0] * WORLD
    _, trace_id, parent_id, _ = TRACEPARENT.split("-")
    spans = [s for s in sink.spans if s.service == "trainyard-trainer"]  # flushed before the ranks exited
    ranks = {s.name: s for s in spans if s.name.startswith("train rank")}
    assert set(ranks) == {f"train rank {r}" for r in range(WORLD)}
    assert all(s.trace_id == trace_id and s.parent_span_id == parent_id for s in ranks.values())
    saves = [s for s in spans if s.name == "checkpoint save"]
    assert len(saves) == WORLD * 2  # steps 3 and 6
    assert {s.parent_span_id for s in saves} == {s.span_id for s in ranks.values()}
    # each ShardWritten spool line carries the traceparent of the span that saved it
    records = [r for rank in first_run.events for r in rank if r["payload"]["eventType"] == "ShardWritten"]
    assert len(records) == WORLD * 2
    assert {r["traceparent"].split("-")[2] for r in records} == {s.span_id for s in saves}
    assert all(r["traceparent"].split("-")[1] == trace_id for r in records)


def test_resume_from_step3_is_bitwise_identical(root: Path, first_run: RunResult, tmp_path: Path) -> None:
    assert first_run.codes == [0] * WORLD
    manifest = write_manifest(shards_of(first_run, EVERY))
    resumed = run_attempt(root, "job-a", attempt=2, start=ref_for(manifest))
    assert resumed.codes == [0] * WORLD, "\n".join(resumed.logs)
    assert [m.step for m in resumed.of(StepMetrics) if m.rank == 0] == list(range(EVERY + 1, MAX_STEPS + 1))
    assert "resumed from" in resumed.logs[0]

    layout = ArtifactLayout(root)
    uninterrupted = load_whole(layout.checkpoint_dir(TENANT, "job-a", 1, MAX_STEPS), tmp_path)
    after_resume = load_whole(layout.checkpoint_dir(TENANT, "job-a", 2, MAX_STEPS), tmp_path)
    assert set(uninterrupted) == {"model", "optimizer", "lr_scheduler", "sampler", "progress", "rng"}
    assert uninterrupted["progress"]["global_step"] == MAX_STEPS
    assert set(uninterrupted["rng"]) == {f"rank_{r}" for r in range(WORLD)}
    assert_bitwise_equal(uninterrupted, after_resume)
    # and it trained: the step-6 weights differ from the step-3 ones
    at3 = load_whole(layout.checkpoint_dir(TENANT, "job-a", 1, EVERY), tmp_path)
    assert not torch.equal(at3["model"]["wte.weight"], uninterrupted["model"]["wte.weight"])


def test_corrupted_shard_is_refused(root: Path, first_run: RunResult) -> None:
    assert first_run.codes == [0] * WORLD
    layout = ArtifactLayout(root)
    source = layout.checkpoint_dir(TENANT, "job-a", 1, EVERY)
    copy = layout.checkpoint_dir(TENANT, "job-c", 1, EVERY)
    shutil.copytree(source, copy)
    shards = [
        s.model_copy(update={
            "job_id": "job-c", "uri": path_to_uri(copy / uri_to_path(s.uri).name),
            "extra_files": [f.model_copy(update={"uri": path_to_uri(copy / ".metadata")}) for f in s.extra_files],
        })
        for s in shards_of(first_run, EVERY)
    ]
    manifest = write_manifest(shards)
    shard1 = copy / "__1_0.distcp"
    data = bytearray(shard1.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    shard1.write_bytes(bytes(data))

    result = run_attempt(root, "job-c", attempt=2, start=ref_for(manifest))
    assert result.codes == [exitcodes.CHECKPOINT] * WORLD, "\n".join(result.logs)
    assert all("CheckpointCorruptError" in log and "rank 1 shard sha256" in log for log in result.logs)
    assert not layout.checkpoint_dir(TENANT, "job-c", 2, MAX_STEPS).exists()
    assert not any(r["payload"]["eventType"] == "ShardWritten" for rank in result.events for r in rank)
