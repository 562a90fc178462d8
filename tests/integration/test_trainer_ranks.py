"""Real torch ranks (``python -m trainyard_trainer``, gloo) on a real dataset: resume, fallback, elasticity.

One uninterrupted 2-rank run writes checkpoints at steps 2, 4 and 6 (asynchronously, the
default). Against it:

- a second attempt resumed from step 2 ends bitwise identical (parameters, optimizer state,
  schedule, sampler, counters, every rank's RNG), with the LR schedule and the token count
  continuing where they were;
- an attempt whose start checkpoint (step 4) has a corrupted shard refuses it, falls back to
  the previous READY checkpoint (step 2; a directory without a manifest is passed over) and
  still ends bitwise identical; with no checkpoint that verifies it exits CHECKPOINT;
- 2 ranks -> 1 rank -> 2 ranks (elastic) ends within float tolerance of the uninterrupted run
  (bitwise is not expected: the gradient reduction order changes with the DP size), with the
  same loss at every step and the sampler positions continuing exactly: nothing skipped or repeated.

Manifests are written the way the checkpoint coordinator writes them. No broker or Redis is
involved: ranks hand events to their spool files.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainyard.checkpoint import save_checkpoint
from trainyard.tensorhash import read_tensor_digests
from trainyard_checkpoint_coordinator.assembly import CheckpointKey, Complete, ShardReport, assess
from trainyard_cli import infra
from trainyard_contract import exitcodes
from trainyard_contract.events import (
    CheckpointRef,
    CheckpointRefused,
    GangAllocated,
    NodeAssignment,
    RankAssignment,
    ShardWritten,
    StepMetrics,
)
from trainyard_contract.manifest import CheckpointManifest, ParallelLayout, ShardEntry, content_hash, tensors_hash
from trainyard_contract.spec import InitFrom, TrainingSpec
from trainyard_contract.storage import ArtifactLayout, atomic_write_bytes, path_to_uri, sha256_file, uri_to_path
from trainyard.data import STDLIB_SOURCES, prepare_dataset
from tests.support.otlp import OtlpSink

WORLD = 2
MAX_STEPS = 6
EVERY = 2
TENANT = "acme"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


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
    record: dict[str, Any] | None = None  # rank 0's run-record.json

    def of(self, cls: type) -> list[Any]:
        name = cls.model_fields["event_type"].default
        return [cls.model_validate(r["payload"]) for rank in self.events for r in rank
                if r["payload"]["eventType"] == name]


def run_attempt(
    root: Path, job_id: str, attempt: int, start: CheckpointRef | None = None, otlp_endpoint: str | None = None,
    *, world: int = WORLD, spec: TrainingSpec | None = None, env: dict[str, str] | None = None,
    during: Callable[[list[subprocess.Popen[bytes]], ArtifactLayout], None] | None = None,
) -> RunResult:
    """Launch ``world`` rank processes with the node agent's env contract and wait for them
    (``during(procs, layout)`` runs once they are all started)."""
    spec = spec or small_spec()
    layout = ArtifactLayout(root)
    port = infra.free_port()
    allocation = GangAllocated(
        job_id=job_id, tenant=TENANT, attempt=attempt, allocation_id=f"alloc-{attempt}", epoch=attempt,
        world_size=world, master_addr="127.0.0.1", master_port=port, start_checkpoint=start,
        nodes=[NodeAssignment(node_id="n0", host="localhost",
                              ranks=[RankAssignment(rank=r, local_rank=r, device_index=r) for r in range(world)])],
        spec=spec, spec_hash=spec.spec_hash(),
    )
    alloc_file = layout.attempt_dir(TENANT, job_id, attempt) / "allocation.json"
    atomic_write_bytes(alloc_file, allocation.to_bytes())
    procs, logs = [], []
    for rank in range(world):
        rank_env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OTEL_"))}
        rank_env.update({
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRAINYARD_BACKEND": "gloo",
            "TRAINYARD_DEVICE_INDEX": str(rank), "TRAINYARD_JOB_ID": job_id, "TRAINYARD_TENANT": TENANT,
            "TRAINYARD_ATTEMPT": str(attempt), "TRAINYARD_EPOCH": str(attempt),
            "TRAINYARD_ALLOCATION_ID": allocation.allocation_id, "TRAINYARD_ARTIFACT_ROOT": str(root),
            "TRAINYARD_ALLOCATION_FILE": str(alloc_file),
            "TRAINYARD_EVENTS_FILE": str(layout.rank_events(TENANT, job_id, attempt, rank)),
            "TRAINYARD_COLLECTIVE_TIMEOUT_S": "120", "TRACEPARENT": TRACEPARENT,
            # a fixed figure: no rank spends its time on a CPU matmul probe (tested in the unit tests)
            "TRAINYARD_PEAK_FLOPS": "1e11",
            "TRAINYARD_EXIT_NOTE_FILE": str(exit_note(layout, job_id, attempt, rank)),
        })
        rank_env.update(env or {})
        if otlp_endpoint:
            rank_env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
                             "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        else:
            rank_env["OTEL_TRACES_EXPORTER"] = "none"
        log_path = layout.rank_log(TENANT, job_id, attempt, rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "trainyard_trainer"], env=rank_env,
                                          stdout=log, stderr=subprocess.STDOUT))
        logs.append(log_path)
    codes = []
    try:
        if during is not None:
            during(procs, layout)
        for p in procs:
            codes.append(p.wait(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    events = []
    for rank in range(world):
        path = layout.rank_events(TENANT, job_id, attempt, rank)
        lines = path.read_text().splitlines() if path.exists() else []
        events.append([json.loads(line) for line in lines])
    record_path = layout.attempt_dir(TENANT, job_id, attempt) / "run-record.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    return RunResult(codes=codes, logs=[p.read_text() for p in logs], events=events, record=record)


def exit_note(layout: ArtifactLayout, job_id: str, attempt: int, rank: int) -> Path:
    return layout.attempt_dir(TENANT, job_id, attempt) / "exit" / f"rank-{rank}.note.json"


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


def copy_checkpoint(layout: ArtifactLayout, source: Path, job_id: str, shards: list[ShardWritten]) -> Path:
    """A READY copy of a checkpoint under another job (its manifest rewritten for the copy's paths)."""
    copy = layout.checkpoints_dir(TENANT, job_id) / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("manifest.json"))
    moved = [
        s.model_copy(update={
            "job_id": job_id, "uri": path_to_uri(copy / uri_to_path(s.uri).name),
            "extra_files": [f.model_copy(update={"uri": path_to_uri(copy / ".metadata")}) for f in s.extra_files],
        })
        for s in shards
    ]
    return write_manifest(moved)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))


def losses(result: RunResult) -> dict[int, float]:
    return {m.step: m.loss for m in result.of(StepMetrics) if m.rank == 0}


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


@pytest.fixture(scope="module")
def uninterrupted(root: Path, first_run: RunResult, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    assert first_run.codes == [0] * WORLD, "\n".join(first_run.logs)
    directory = ArtifactLayout(root).checkpoint_dir(TENANT, "job-a", 1, MAX_STEPS)
    return load_whole(directory, tmp_path_factory.mktemp("whole"))


# ----------------------------------------------------------------------------- tests


def test_uninterrupted_run_checkpoints_and_reports(root: Path, first_run: RunResult) -> None:
    assert first_run.codes == [0] * WORLD, "\n".join(first_run.logs)
    layout = ArtifactLayout(root)
    for step in range(EVERY, MAX_STEPS + 1, EVERY):
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
            assert s.write_seconds is not None and s.stall_seconds is not None
            assert s.write_seconds >= 0 and 0 <= s.stall_seconds <= s.write_seconds
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
        assert all(m.compute_seconds > 0 and m.collective_seconds > 0 and m.data_wait_seconds >= 0 for m in mine)
        assert all(m.tokens_per_second == pytest.approx(512 / m.step_seconds) for m in mine)
        # MFU with the PaLM count against the fixed peak the test sets (1e11 FLOP/s per device)
        flops = 6 * 169_728 + 12 * 2 * 64 * 32
        assert all(m.mfu == pytest.approx(flops * m.tokens_per_second / (WORLD * 1e11)) for m in mine)
        # an async save stalls its step a little (staging); the final one waits until it is durable
        assert mine[EVERY - 1].checkpoint_seconds > 0 and mine[-1].checkpoint_seconds > 0
    # The loss is the global-batch mean: every rank reports the same number.
    by_step: dict[int, set[float]] = {}
    for m in metrics:
        by_step.setdefault(m.step, set()).add(m.loss)
    assert all(len(values) == 1 for values in by_step.values())


def test_run_record(first_run: RunResult) -> None:
    record = first_run.record
    assert record is not None and record["status"] == "succeeded" and record["exitCode"] == 0
    assert record["environment"]["hostnames"] == [socket.gethostname()] * WORLD
    assert record["environment"]["torch"] == torch.__version__ and record["environment"]["codeRevision"] == "test"
    assert record["environment"]["python"] == sys.version.split()[0]
    assert record["batch"] == {
        "microBatchSize": 4, "dataParallel": 2, "gradAccumulation": 2, "globalBatchSize": 16, "sequenceLength": 32,
        "tokensPerStep": 512, "specDataParallel": 2,
        "statement": "micro batch 4 x data-parallel 2 x gradient accumulation 2 = global batch 16 sequences "
                     "(512 tokens per optimizer step)",
    }
    assert record["parallelism"]["sharding"] == "ddp" and record["parallelism"]["checkpointMode"] == "async"
    assert record["restore"]["manifestUri"] is None and record["restore"]["rng"] == "fresh"
    assert record["progress"] == {"startStep": 0, "globalStep": 6, "consumedTokens": 6 * 512, "consumedSamples": 96,
                                  "tokensThisAttempt": 6 * 512, "samplerStartPosition": 0, "samplerPosition": 96}
    assert [step for step, _ in record["lossCurve"]] == list(range(1, MAX_STEPS + 1))
    assert [c["globalStep"] for c in record["checkpoints"]] == [2, 4, 6]
    assert all(c["stallSeconds"] < c["writeSeconds"] for c in record["checkpoints"])
    assert record["checkpointPolicy"] == {"everySteps": EVERY, "everyMinutes": None, "source": "spec"}
    assert record["throughput"]["peakFlopsPerDevice"] == 1e11 and 0 < record["throughput"]["meanMfu"] < 1


def test_ranks_trace_into_the_jobs_trace(first_run: RunResult, sink: OtlpSink) -> None:
    assert first_run.codes == [0] * WORLD
    _, trace_id, parent_id, _ = TRACEPARENT.split("-")
    spans = [s for s in sink.spans if s.service == "trainyard-trainer"]  # flushed before the ranks exited
    ranks = {s.name: s for s in spans if s.name.startswith("train rank")}
    assert set(ranks) == {f"train rank {r}" for r in range(WORLD)}
    assert all(s.trace_id == trace_id and s.parent_span_id == parent_id for s in ranks.values())
    saves = [s for s in spans if s.name == "checkpoint save"]
    assert len(saves) == WORLD * 3  # steps 2, 4 and 6
    assert {s.parent_span_id for s in saves} == {s.span_id for s in ranks.values()}
    # each ShardWritten spool line carries the traceparent of the span that saved it
    records = [r for rank in first_run.events for r in rank if r["payload"]["eventType"] == "ShardWritten"]
    assert len(records) == WORLD * 3
    assert {r["traceparent"].split("-")[2] for r in records} == {s.span_id for s in saves}
    assert all(r["traceparent"].split("-")[1] == trace_id for r in records)


def test_resume_from_step2_is_bitwise_identical(
    root: Path, first_run: RunResult, uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    manifest = write_manifest(shards_of(first_run, EVERY))
    resumed = run_attempt(root, "job-a", attempt=2, start=ref_for(manifest))
    assert resumed.codes == [0] * WORLD, "\n".join(resumed.logs)
    mine = sorted((m for m in resumed.of(StepMetrics) if m.rank == 0), key=lambda m: m.step)
    before = {m.step: m for m in first_run.of(StepMetrics) if m.rank == 0}
    assert [m.step for m in mine] == list(range(EVERY + 1, MAX_STEPS + 1))
    # the LR schedule, the loss and the token count continue exactly where they were
    assert [(m.lr, m.loss, m.consumed_tokens) for m in mine] == [
        (before[m.step].lr, before[m.step].loss, before[m.step].consumed_tokens) for m in mine]
    assert "resumed from" in resumed.logs[0]
    record = resumed.record
    assert record["restore"]["manifestUri"] == path_to_uri(manifest) and record["restore"]["rng"] == "restored"
    assert record["progress"]["consumedTokens"] == MAX_STEPS * 512  # not counted twice
    assert record["progress"]["tokensThisAttempt"] == (MAX_STEPS - EVERY) * 512

    layout = ArtifactLayout(root)
    after_resume = load_whole(layout.checkpoint_dir(TENANT, "job-a", 2, MAX_STEPS), tmp_path)
    assert set(uninterrupted) == {"model", "optimizer", "lr_scheduler", "sampler", "progress", "rng"}
    assert uninterrupted["progress"]["global_step"] == MAX_STEPS
    assert set(uninterrupted["rng"]) == {f"rank_{r}" for r in range(WORLD)}
    moments = [k for k in uninterrupted["optimizer"] if k.startswith("state.") and k.endswith(".exp_avg_sq")]
    assert len(moments) == len(uninterrupted["model"])  # Adam's moments of every parameter are compared too
    assert_bitwise_equal(uninterrupted, after_resume)
    # and it trained: the step-6 weights differ from the step-2 ones
    at2 = load_whole(layout.checkpoint_dir(TENANT, "job-a", 1, EVERY), tmp_path)
    assert not torch.equal(at2["model"]["wte.weight"], uninterrupted["model"]["wte.weight"])


def test_corrupted_start_checkpoint_falls_back_to_the_previous_ready_one(
    root: Path, first_run: RunResult, uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    layout = ArtifactLayout(root)
    at2 = copy_checkpoint(layout, layout.checkpoint_dir(TENANT, "job-a", 1, 2), "job-c", shards_of(first_run, 2))
    at4 = copy_checkpoint(layout, layout.checkpoint_dir(TENANT, "job-a", 1, 4), "job-c", shards_of(first_run, 4))
    # a newer-looking directory without a manifest (an unfinished save) is never a candidate
    shutil.copytree(layout.checkpoint_dir(TENANT, "job-a", 1, 4), layout.checkpoint_dir(TENANT, "job-c", 1, 3),
                    ignore=shutil.ignore_patterns("manifest.json"))
    flip_a_byte(at4.parent / "__1_0.distcp")

    result = run_attempt(root, "job-c", attempt=2, start=ref_for(at4))
    assert result.codes == [0] * WORLD, "\n".join(result.logs)
    restore = result.record["restore"]
    assert restore["manifestUri"] == path_to_uri(at2) and restore["globalStep"] == 2
    assert restore["requestedManifestUri"] == path_to_uri(at4)
    assert [r["manifestUri"] for r in restore["refused"]] == [path_to_uri(at4)]
    assert "rank 1 shard sha256" in restore["refused"][0]["problems"][0]
    assert "fell back to the previous READY checkpoint, step 2" in restore["reason"]
    # rank 0 reports the refusal, for the coordinator to mark that checkpoint FAILED
    (refusal,) = result.of(CheckpointRefused)
    assert (refusal.manifest_uri, refusal.global_step, refusal.attempt, refusal.checkpoint_attempt) == (
        path_to_uri(at4), 4, 2, 1)
    assert "rank 1 shard sha256" in refusal.problems[0]
    assert not any(r["payload"]["eventType"] == "CheckpointRefused" for r in result.events[1])
    for log in result.logs:
        assert "refusing checkpoint step 4" in log and "fell back" in log
    assert [m.step for m in result.of(StepMetrics) if m.rank == 0] == [3, 4, 5, 6]
    final = load_whole(layout.checkpoint_dir(TENANT, "job-c", 2, MAX_STEPS), tmp_path)
    assert_bitwise_equal(uninterrupted, final)


def coordinator_manifest(shards: list[ShardWritten]) -> CheckpointManifest:
    """The manifest the checkpoint coordinator drafts from these shard reports (its pure decision)."""
    first = shards[0]
    outcome = assess(CheckpointKey(first.job_id, first.attempt, first.global_step),
                     {s.rank: ShardReport.from_event(s) for s in shards}, world_size=first.world_size,
                     current_epoch=first.epoch, created_at=first.occurred_at)
    assert isinstance(outcome, Complete), outcome
    return outcome.manifest


@pytest.fixture(scope="module")
def twin_run(root: Path) -> RunResult:
    """A second run of the same spec from scratch: it trains to the same values as job-a."""
    return run_attempt(root, "job-twin", attempt=1)


def test_identical_runs_have_equal_tensors_hashes(root: Path, first_run: RunResult, twin_run: RunResult) -> None:
    assert twin_run.codes == [0] * WORLD, "\n".join(twin_run.logs)
    layout = ArtifactLayout(root)
    by_step = {}
    for step in range(EVERY, MAX_STEPS + 1, EVERY):
        first, twin = coordinator_manifest(shards_of(first_run, step)), coordinator_manifest(shards_of(twin_run, step))
        assert first.tensors_hash is not None and first.tensors_hash == twin.tensors_hash, step
        assert first.tensors == twin.tensors
        # contentHash (the files as written, DCP's .metadata included) may differ: it is not what compares runs
        keys = {d.key for d in twin.tensors}
        assert {f"rng.rank_{r}.torch" for r in range(WORLD)} | {"model.wte.weight", "progress.global_step"} <= keys
        # every entry once, though both ranks hold the replicated weights: DCP wrote (and the ranks hashed) each once
        assert len({(d.key, tuple(d.offset)) for d in twin.tensors}) == len(twin.tensors)
        # what the ranks reported is what their files hold
        assert read_tensor_digests(layout.checkpoint_dir(TENANT, "job-twin", 1, step)) == twin.tensors
        by_step[step] = twin.tensors_hash
    assert len(set(by_step.values())) == len(by_step)  # training changed the values between checkpoints


def test_a_changed_weight_changes_the_tensors_hash(
    root: Path, twin_run: RunResult, tmp_path: Path
) -> None:
    assert twin_run.codes == [0] * WORLD, "\n".join(twin_run.logs)
    reported = coordinator_manifest(shards_of(twin_run, MAX_STEPS))
    whole = load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, "job-twin", 1, MAX_STEPS), tmp_path)

    def resave(state: dict[str, Any], name: str) -> str:
        saved = save_checkpoint(state, tmp_path / name / "step-000000006-a1", rank=0, barrier=lambda: None)
        assert saved.tensors is not None
        return tensors_hash(saved.tensors)

    # the same values saved again by one process (not the two ranks that wrote them): the same entries, same hash
    assert resave(whole, "same") == reported.tensors_hash
    weight = whole["model"]["wte.weight"]
    weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(float("inf")))  # one element, one ulp
    assert resave(whole, "changed") != reported.tensors_hash


def test_no_checkpoint_verifies_exits_checkpoint(root: Path, first_run: RunResult) -> None:
    layout = ArtifactLayout(root)
    only = copy_checkpoint(layout, layout.checkpoint_dir(TENANT, "job-a", 1, 2), "job-d", shards_of(first_run, 2))
    flip_a_byte(only.parent / ".metadata")
    # one rank is enough to show the refusal (and elastic: this checkpoint was written by two)
    result = run_attempt(root, "job-d", attempt=2, start=ref_for(only), world=1)
    assert result.codes == [exitcodes.CHECKPOINT], "\n".join(result.logs)
    assert "NoVerifiedCheckpointError" in result.logs[0] and "shared file .metadata sha256" in result.logs[0]
    assert not layout.checkpoint_dir(TENANT, "job-d", 2, MAX_STEPS).exists()
    assert not any(r["payload"]["eventType"] == "ShardWritten" for rank in result.events for r in rank)
    record = result.record
    assert (record["status"], record["exitCode"]) == ("failed", exitcodes.CHECKPOINT)
    assert record["restore"]["manifestUri"] is None and record["restore"]["requestedManifestUri"] == path_to_uri(only)
    assert [r["globalStep"] for r in record["restore"]["refused"]] == [2]
    assert [e.global_step for e in result.of(CheckpointRefused)] == [2]
    assert "no checkpoint of this job verifies" in record["error"]


def test_elastic_resume_2_to_1_to_2_ranks(
    root: Path, first_run: RunResult, uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    layout = ArtifactLayout(root)
    at2 = write_manifest(shards_of(first_run, 2))
    # attempt 3: one rank (accumulation 4 instead of 2), synchronous checkpoints, and the two-rank runs'
    # CPU threads (by default one rank would take all the cores: the sums' order would change with them too)
    threads = str(first_run.record["environment"]["cpuThreads"][0])
    one = run_attempt(root, "job-a", attempt=3, start=ref_for(at2), world=1,
                      env={"TRAINYARD_CHECKPOINT_MODE": "sync", "TRAINYARD_CPU_THREADS": threads})
    assert one.codes == [0], "\n".join(one.logs)
    batch = one.record["batch"]
    assert (batch["dataParallel"], batch["gradAccumulation"], batch["specDataParallel"]) == (1, 4, 2)
    assert "the spec asked for parallelism.data 2" in batch["statement"]
    assert one.record["restore"]["worldSize"] == 2 and one.record["restore"]["rng"].startswith("reseeded")
    assert one.record["parallelism"]["checkpointMode"] == "sync"
    # attempt 4: two ranks again, from the one-rank checkpoint at step 4
    at4 = write_manifest(shards_of(one, 4))
    two = run_attempt(root, "job-a", attempt=4, start=ref_for(at4))
    assert two.codes == [0] * WORLD, "\n".join(two.logs)

    # the data position continues exactly: no sample skipped or repeated
    assert (one.record["progress"]["samplerStartPosition"], two.record["progress"]["samplerStartPosition"]) == (32, 64)
    assert two.record["progress"]["samplerPosition"] == uninterrupted["sampler"]["position"] == 96
    assert two.record["progress"]["consumedTokens"] == MAX_STEPS * 512
    # the same samples in every step give the same loss at every step (to float tolerance)
    reference = losses(first_run)
    assert (sorted(losses(one)), sorted(losses(two))) == ([3, 4, 5, 6], [5, 6])
    for run in (one, two):
        for step, loss in losses(run).items():
            assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
    final = load_whole(layout.checkpoint_dir(TENANT, "job-a", 4, MAX_STEPS), tmp_path)
    assert final["progress"] == uninterrupted["progress"] and final["sampler"] == uninterrupted["sampler"]
    assert final["lr_scheduler"]["last_epoch"] == uninterrupted["lr_scheduler"]["last_epoch"] == MAX_STEPS
    for part in ("model", "optimizer"):
        flat_a, flat_b = flatten(uninterrupted[part]), flatten(final[part])
        assert flat_a.keys() == flat_b.keys()
        for key, value in flat_a.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(flat_b[key], value, rtol=1e-4, atol=1e-6, msg=f"{part}.{key}")
            else:
                assert flat_b[key] == value, f"{part}.{key}"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


# ----------------------------------------------------------------------------- checkpoint on request, then stop

PREEMPT_MAX = 24


def preempt_spec() -> TrainingSpec:
    """More steps, no scheduled save before maxSteps: a checkpoint mid-run can only come from a request."""
    data = small_spec().model_dump(by_alias=True, mode="json")
    data["training"]["maxSteps"] = PREEMPT_MAX
    data["checkpointPolicy"] = {"everySteps": 1000}
    return TrainingSpec.model_validate(data)


def wait_for_step(layout: ArtifactLayout, job_id: str, attempt: int, step: int,
                  procs: list[subprocess.Popen[bytes]]) -> None:
    path = layout.rank_events(TENANT, job_id, attempt, 0)
    deadline = time.monotonic() + 300  # generous: ranks start slowly on a loaded machine
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return  # let the assertions on the exit codes say what happened
        lines = path.read_text().splitlines() if path.exists() else []
        steps = [json.loads(line)["payload"].get("step") for line in lines]
        if any(isinstance(s, int) and s >= step for s in steps):
            return
        time.sleep(0.02)
    raise AssertionError(f"rank 0 of {job_id} attempt {attempt} never reached step {step}")


def assert_stopped_together(layout: ArtifactLayout, result: RunResult, job_id: str, attempt: int) -> int:
    """Both ranks exited 7 after the same step, whose checkpoint is durable on every rank; that step."""
    assert result.codes == [exitcodes.PREEMPTED] * WORLD, "\n".join(result.logs)
    last = {rank: max(m.step for m in result.of(StepMetrics) if m.rank == rank) for rank in range(WORLD)}
    step = last[0]
    assert last == {r: step for r in range(WORLD)} and step < PREEMPT_MAX
    shards = shards_of(result, step)
    assert [s.rank for s in shards] == list(range(WORLD)), "every rank's ShardWritten is in its spool"
    directory = layout.checkpoint_dir(TENANT, job_id, attempt, step)
    for s in shards:
        path = uri_to_path(s.uri)
        assert path.parent == directory and path.stat().st_size == s.size_bytes and sha256_file(path) == s.sha256
        assert s.write_seconds is not None and s.write_seconds >= 0
        assert s.stall_seconds is not None and s.stall_seconds >= 0
    assert {s.global_step for s in result.of(ShardWritten)} == {step}, "nothing saved but the requested step"
    record = result.record
    assert record is not None and (record["status"], record["exitCode"]) == ("preempted", 7)
    assert record["stopped"]["globalStep"] == step and record["stopped"]["saved"] is True
    assert record["progress"]["globalStep"] == step
    for rank in range(WORLD):
        note = json.loads(exit_note(layout, job_id, attempt, rank).read_text())
        assert (note["exitCode"], note["reason"], note["globalStep"]) == (7, "preempted", step)
    return step


def test_a_requested_checkpoint_stops_every_rank_at_the_same_step_and_resumes(root: Path) -> None:
    layout = ArtifactLayout(root)
    spec, job = preempt_spec(), "job-p"

    def signal_rank_1(procs: list[subprocess.Popen[bytes]], layout: ArtifactLayout) -> None:
        wait_for_step(layout, job, 1, 2, procs)
        procs[1].send_signal(signal.SIGUSR1)  # only rank 1 is asked: the agreement carries it to rank 0

    first = run_attempt(root, job, attempt=1, spec=spec, during=signal_rank_1)
    step1 = assert_stopped_together(layout, first, job, 1)
    assert first.record["stopped"]["signalled"] is False  # rank 0 learnt it from rank 1, through the all-reduce
    assert "checkpoint requested (signal)" in first.logs[1]

    # attempt 2 resumes from it; this time the request comes as the node agent's request file
    at1 = write_manifest(shards_of(first, step1))

    def request_file(procs: list[subprocess.Popen[bytes]], layout: ArtifactLayout) -> None:
        wait_for_step(layout, job, 2, step1 + 2, procs)
        atomic_write_bytes(layout.attempt_dir(TENANT, job, 2) / "checkpoint-request.json", json.dumps(
            {"allocationId": "alloc-2", "epoch": 2, "reason": "pause"}).encode())

    second = run_attempt(root, job, attempt=2, start=ref_for(at1), spec=spec, during=request_file)
    step2 = assert_stopped_together(layout, second, job, 2)
    assert step2 > step1 and second.record["restore"]["globalStep"] == step1

    # attempt 3 runs to maxSteps; the sampler positions chain without a gap or a repeat
    third = run_attempt(root, job, attempt=3, start=ref_for(write_manifest(shards_of(second, step2))), spec=spec)
    assert third.codes == [0] * WORLD, "\n".join(third.logs)
    chain = [first.record["progress"], second.record["progress"], third.record["progress"]]
    assert chain[0]["samplerStartPosition"] == 0
    for before, after in zip(chain, chain[1:]):
        assert after["startStep"] == before["globalStep"]
        assert after["samplerStartPosition"] == before["samplerPosition"]
    assert chain[2]["globalStep"] == PREEMPT_MAX and chain[2]["samplerPosition"] == PREEMPT_MAX * 16
    steps = sorted(m.step for r in (first, second, third) for m in r.of(StepMetrics) if m.rank == 0)
    assert steps == list(range(1, PREEMPT_MAX + 1)), "every step trained exactly once"


def test_init_from_another_job_takes_its_weights_and_starts_everything_else_fresh(
    root: Path, first_run: RunResult, uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    """A new configuration is a new job linked to the old one: ``initFrom`` loads only the model
    weights of job-a's final checkpoint; steps, schedule, optimizer and data position start at 0."""
    manifest = write_manifest(shards_of(first_run, MAX_STEPS))
    base = small_spec()
    training = base.training.model_copy(update={"learning_rate": 1e-9, "max_steps": EVERY})  # ~frozen weights
    spec = base.model_copy(update={"training": training, "init_from": InitFrom(job_id="job-a")})
    child = run_attempt(root, "job-child", attempt=1, start=ref_for(manifest), spec=spec)
    assert child.codes == [0] * WORLD, "\n".join(child.logs)
    assert "initialised from job job-a step 6" in child.record["restore"]["reason"]
    steps = sorted(m.step for m in child.of(StepMetrics) if m.rank == 0)
    assert steps == list(range(1, EVERY + 1))  # its own step counter
    saved = load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, "job-child", 1, EVERY), tmp_path)
    assert saved["progress"]["global_step"] == EVERY and saved["sampler"]["position"] == EVERY * 16
    for name, weight in uninterrupted["model"].items():  # job-a's trained weights, not a fresh init
        assert torch.allclose(saved["model"][name], weight, atol=1e-5), name
    at2 = load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, "job-a", 1, EVERY), tmp_path)
    assert not torch.allclose(saved["model"]["wte.weight"], at2["model"]["wte.weight"], atol=1e-5)

    # a model of another shape cannot take those weights: exit 4 with the reason
    other = spec.model_copy(update={"model_config_ref": base.model_config_ref.model_copy(update={"d_model": 32})})
    refused = run_attempt(root, "job-child-2", attempt=1, start=ref_for(manifest), spec=other)
    assert refused.codes == [exitcodes.CHECKPOINT] * WORLD, "\n".join(refused.logs)
    assert "initFrom: cannot load the weights of job job-a" in refused.logs[0]
