"""examples/gpt-sdk/train.py (plain PyTorch + ``import trainyard``) as real torch ranks (2, gloo, CPU).

The ranks get the environment a node agent sets and nothing else is faked: they read the
allocation file, write their spools, exit notes and checkpoints; manifests are written the way
the checkpoint coordinator writes them. Against one uninterrupted run:

- ranks SIGKILLed after a checkpoint, restarted from it, end bitwise identical (weights, AdamW
  state, data position, counters, every rank's RNG);
- a pause (the request file, present from the start) saves step 1, exits 7 with an exit note
  naming the step, and the attempt resumed from it ends bitwise identical;
- outside trainyard the script says so and exits 2 (no traceback); in local mode it trains as a
  world of one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trainyard_contract import exitcodes
from trainyard_contract.events import (
    CheckpointRef,
    GangAllocated,
    NodeAssignment,
    RankAssignment,
    ShardWritten,
    StepMetrics,
)
from trainyard_cli import infra
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout, atomic_write_bytes
from trainyard.data import STDLIB_SOURCES, prepare_dataset
from tests.integration.test_trainer_ranks import (
    RunResult,
    assert_bitwise_equal,
    load_whole,
    ref_for,
    shards_of,
    write_manifest,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt-sdk"
WORLD, MAX_STEPS, EVERY, TENANT = 2, 10, 2, "acme"


def example_spec() -> TrainingSpec:
    spec = TrainingSpec.model_validate({
        "specVersion": "v1",
        "modelConfig": {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 64, "maxSeqLen": 64, "dropout": 0.1},
        "dataset": "tinycorpus@v1", "codeRevision": "test",
        "code": {"archive": "sha256:" + "ab" * 32, "entrypoint": ["python", "train.py"]},
        "resources": {"gpuType": "cpu", "gpuCount": WORLD}, "parallelism": {"data": WORLD},
        "checkpointPolicy": {"everySteps": EVERY},
        "training": {"seed": 7, "sequenceLength": 32, "microBatchSize": 4, "globalBatchSize": 16,
                     "learningRate": 3e-3, "lrSchedule": {"warmupSteps": 2}, "maxSteps": MAX_STEPS},
    })
    assert spec.code is not None and spec.code.entrypoint == ["python", "train.py"]
    return spec


def launch(root: Path, job_id: str, attempt: int, start: CheckpointRef | None = None, *,
           during: Callable[[list[subprocess.Popen[bytes]], ArtifactLayout], None] | None = None) -> RunResult:
    """``python train.py`` per rank in the example's directory, with the node agent's rank environment."""
    spec, layout, port = example_spec(), ArtifactLayout(root), infra.free_port()
    allocation = GangAllocated(
        job_id=job_id, tenant=TENANT, attempt=attempt, allocation_id=f"alloc-{attempt}", epoch=attempt,
        world_size=WORLD, master_addr="127.0.0.1", master_port=port, start_checkpoint=start, spec=spec,
        spec_hash=spec.spec_hash(), nodes=[NodeAssignment(node_id="n0", host="localhost", ranks=[
            RankAssignment(rank=r, local_rank=r, device_index=r) for r in range(WORLD)])],
    )
    attempt_dir = layout.attempt_dir(TENANT, job_id, attempt)
    atomic_write_bytes(attempt_dir / "allocation.json", allocation.to_bytes())
    procs, logs = [], []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OTEL_"))}
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRAINYARD_BACKEND": "gloo",
            "TRAINYARD_JOB_ID": job_id, "TRAINYARD_TENANT": TENANT, "TRAINYARD_ATTEMPT": str(attempt),
            "TRAINYARD_EPOCH": str(attempt), "TRAINYARD_ALLOCATION_ID": allocation.allocation_id,
            "TRAINYARD_ARTIFACT_ROOT": str(root), "TRAINYARD_ALLOCATION_FILE": str(attempt_dir / "allocation.json"),
            "TRAINYARD_EVENTS_FILE": str(layout.rank_events(TENANT, job_id, attempt, rank)),
            "TRAINYARD_EXIT_NOTE_FILE": str(attempt_dir / "exit" / f"rank-{rank}.note.json"),
            "TRAINYARD_COLLECTIVE_TIMEOUT_S": "120", "OTEL_TRACES_EXPORTER": "none",
        })
        log_path = layout.rank_log(TENANT, job_id, attempt, rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "train.py"], cwd=EXAMPLE, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        logs.append(log_path)
    try:
        if during is not None:
            during(procs, layout)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    events = []
    for rank in range(WORLD):
        path = layout.rank_events(TENANT, job_id, attempt, rank)
        events.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return RunResult(codes=codes, logs=[p.read_text() for p in logs], events=events)


def exit_notes(root: Path, job_id: str, attempt: int) -> list[dict[str, Any]]:
    attempt_dir = ArtifactLayout(root).attempt_dir(TENANT, job_id, attempt)
    return [json.loads((attempt_dir / "exit" / f"rank-{r}.note.json").read_text()) for r in range(WORLD)]


def final_state(root: Path, job_id: str, attempt: int, tmp: Path) -> dict[str, Any]:
    return load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, job_id, attempt, MAX_STEPS), tmp)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sdk") / "artifacts"
    prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:6])
    return root


@pytest.fixture(scope="module")
def uninterrupted(root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, dict[str, Any]]:
    result = launch(root, "job-a", 1)
    assert result.codes == [0] * WORLD, "\n".join(result.logs)
    return result, final_state(root, "job-a", 1, tmp_path_factory.mktemp("whole"))


def test_the_example_checkpoints_and_reports_like_the_trainer(root: Path,
                                                              uninterrupted: tuple[RunResult, dict[str, Any]]) -> None:
    result, whole = uninterrupted
    assert [s.global_step for s in shards_of(result, EVERY)] == [EVERY] * WORLD
    saved = sorted({e.global_step for e in result.of(ShardWritten)})
    assert saved == list(range(EVERY, MAX_STEPS + 1, EVERY))
    assert all(s.consumed_tokens == s.global_step * 16 * 32 and s.stall_seconds is not None
               for s in result.of(ShardWritten))
    metrics = result.of(StepMetrics)
    for rank in range(WORLD):
        mine = sorted((m for m in metrics if m.rank == rank), key=lambda m: m.step)
        assert [m.step for m in mine] == list(range(1, MAX_STEPS + 1))
        assert all(m.compute_seconds > 0 and m.collective_seconds > 0 and m.lr is not None for m in mine)
        assert [m.consumed_tokens for m in mine] == [s * 512 for s in range(1, MAX_STEPS + 1)]
    assert set(whole) >= {"model", "optimizer", "loader", "progress", "rng"}
    assert whole["progress"]["global_step"] == MAX_STEPS and whole["loader"]["position"] == MAX_STEPS * 16
    assert [n["exitCode"] for n in exit_notes(root, "job-a", 1)] == [0, 0]
    user_metrics = ArtifactLayout(root).attempt_dir(TENANT, "job-a", 1) / "metrics" / "rank0.jsonl"
    assert [json.loads(line)["step"] for line in user_metrics.read_text().splitlines()] == list(
        range(1, MAX_STEPS + 1))


def test_killed_ranks_resume_bitwise_identically(root: Path, uninterrupted: tuple[RunResult, dict[str, Any]],
                                                 tmp_path: Path) -> None:
    _, whole = uninterrupted

    def kill_after_the_first_checkpoint(procs: list[subprocess.Popen[bytes]], layout: ArtifactLayout) -> None:
        spools = [layout.rank_events(TENANT, "job-k", 1, r) for r in range(WORLD)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                p.exists() and "ShardWritten" in p.read_text() for p in spools):
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.01)
        for p in procs:
            p.send_signal(signal.SIGKILL)

    killed = launch(root, "job-k", 1, during=kill_after_the_first_checkpoint)
    assert killed.codes == [-signal.SIGKILL] * WORLD, "\n".join(killed.logs)
    durable = sorted({e.global_step for e in killed.of(ShardWritten)
                      if len(shards_of(killed, e.global_step)) == WORLD})
    assert durable and durable[-1] < MAX_STEPS
    manifest = write_manifest(shards_of(killed, durable[-1]))

    resumed = launch(root, "job-k", 2, start=ref_for(manifest))
    assert resumed.codes == [0] * WORLD, "\n".join(resumed.logs)
    assert min(m.step for m in resumed.of(StepMetrics)) == durable[-1] + 1
    assert_bitwise_equal(final_state(root, "job-k", 2, tmp_path), whole)


def test_a_pause_exits_7_at_a_saved_step_and_resumes_bitwise(root: Path,
                                                             uninterrupted: tuple[RunResult, dict[str, Any]],
                                                             tmp_path: Path) -> None:
    _, whole = uninterrupted
    request = ArtifactLayout(root).attempt_dir(TENANT, "job-p", 1) / "checkpoint-request.json"
    atomic_write_bytes(request, json.dumps({"allocationId": "alloc-1", "epoch": 1, "reason": "pause"}).encode())

    paused = launch(root, "job-p", 1)  # seen at step 1's boundary, agreed (and saved) at step 2's
    assert paused.codes == [exitcodes.PREEMPTED] * WORLD, "\n".join(paused.logs)
    assert [(n["reason"], n["globalStep"]) for n in exit_notes(root, "job-p", 1)] == [("preempted", 2)] * WORLD
    assert [s.global_step for s in shards_of(paused, 2)] == [2, 2]
    assert max(m.step for m in paused.of(StepMetrics)) == 2

    resumed = launch(root, "job-p", 2, start=ref_for(write_manifest(shards_of(paused, 2))))
    assert resumed.codes == [0] * WORLD, "\n".join(resumed.logs)
    assert_bitwise_equal(final_state(root, "job-p", 2, tmp_path), whole)


def test_outside_trainyard_the_script_says_so_and_exits_config() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_") and k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "train.py"], cwd=EXAMPLE, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == exitcodes.CONFIG
    assert "not running under trainyard" in done.stderr and "TRAINYARD_LOCAL=1" in done.stderr
    assert "Traceback" not in done.stderr


def test_local_mode_trains_a_world_of_one(root: Path, tmp_path: Path) -> None:
    spec = example_spec().model_copy(update={"training": example_spec().training.model_copy(update={
        "max_steps": 3, "global_batch_size": 8})})
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps(spec.wire()))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update({"TRAINYARD_LOCAL": "1", "TRAINYARD_LOCAL_SPEC": str(spec_file), "TRAINYARD_ARTIFACT_ROOT": str(root),
                "TRAINYARD_JOB_ID": "local-test", "OTEL_TRACES_EXPORTER": "none"})
    done = subprocess.run([sys.executable, "train.py"], cwd=EXAMPLE, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    final = ArtifactLayout(root).checkpoint_dir("local", "local-test", 1, 3)
    assert (final / ".metadata").exists()
