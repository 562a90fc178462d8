"""Training that does not stop for a failure (``faultTolerance``), on the local stack with gloo: real node agents,
the job's torchft Lighthouse run by the node of rank 0, real rank processes joined per step by torchft.

* 2 replicas (``batch: reduced``), then 3 (``batch: accumulate``): one replica's rank killed -9 mid-run → the
  job's attempt count stays 1, the other replicas' step counters never stop for longer than the quorum timeout,
  no step is applied by two quorums, the platform starts the rank again (generation 1), it heals from a healthy
  peer and ends with weights bitwise equal to its peers'; the final model is close to an uninterrupted run's;
  no checkpoint is lost or made READY twice (the 2-replica case also runs the spec uninterrupted to compare);
* the built-in trainer (no code of the user's) the same way;
* below ``minReplicas`` the attempt ends and the next one resumes from the latest READY checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.chaos.invariants import ReplicaLog, check_one_quorum_per_step
from tests.e2e.test_user_code import (
    final_state,
    finished,
    rank_pids,
    ready_steps,
    submit,
    wait_for,
)
from tests.support.cli import trainyard
from tests.support.stack import api_client, running_stack
from tests.support.waiting import wait_for as poll
from trainyard_cli.stack import LocalStack

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]
QUORUM_TIMEOUT_S = 30  # the example's faultTolerance.quorumTimeoutSeconds
STEPS = 400
#: a step of ~50 ms: the others still train when the newcomer has started (a new python, torch, the sandbox)
PAUSE = {"EXAMPLE_STEP_PAUSE_SECONDS": "0.04"}
#: The faulted run's final model against the uninterrupted run's: its loss on the same held-out batches (the
#: example prints it). The steps a replica missed ran with a smaller batch (``batch: reduced``), so the weights
#: differ (AdamW amplifies any difference); what they learned does not, much: the faulted run's shortfall is at
#: most this fraction of what the reference learned (its first step's loss down to its held-out loss), plus the
#: share of the samples the faulted run never saw. How many steps ran degraded depends on how long the newcomer
#: took to start (a new python, torch, the sandbox), which a loaded machine decides, not the platform.
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "ft-stack")


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Iterator[httpx.Client]:
    yield from api_client(stack)


def attempt_dir(stack: LocalStack, j: dict[str, Any], attempt: int = 1) -> Path:
    root = stack.s.state_dir / "artifacts"
    return root / "tenants" / j["tenant"] / "jobs" / j["jobId"] / "attempts" / str(attempt)


def digests(stack: LocalStack, j: dict[str, Any], attempt: int = 1) -> dict[str, str]:
    """Each rank log's final weights digest (``rank-1.g1.log``: rank 1's first replacement)."""
    found = {}
    for log in sorted((attempt_dir(stack, j, attempt) / "logs").glob("rank-*.log")):
        match = re.search(r"final weights sha256 ([0-9a-f]{64}) at step (\d+)", log.read_text(errors="replace"))
        if match:
            found[log.name] = match.group(1)
    return found


def replica_logs(stack: LocalStack, j: dict[str, Any], attempt: int = 1) -> list[ReplicaLog]:
    return [ReplicaLog.parse(log.name, log.read_text(errors="replace"))
            for log in sorted((attempt_dir(stack, j, attempt) / "logs").glob("rank-*.log"))]


def step_times(stack: LocalStack, j: dict[str, Any], rank: int) -> list[tuple[int, float]]:
    """(step, wall time) of every step the rank reported (the example reports ``at``)."""
    path = attempt_dir(stack, j) / "metrics" / f"rank{rank}.jsonl"
    return [(int(e["step"]), float(e["at"])) for e in map(json.loads, path.read_text().splitlines())]


def held_out_loss(stack: LocalStack, j: dict[str, Any]) -> float:
    """Replica 0's final loss on the held-out batches (the example prints it when it ends)."""
    log = (attempt_dir(stack, j, len(j["attempts"])) / "logs" / "rank-0.log").read_text(errors="replace")
    match = re.search(r"final held-out loss ([0-9.]+)", log)
    assert match, log[-2000:]
    return float(match.group(1))


def first_loss(client: httpx.Client, j: dict[str, Any]) -> float:
    """The job's training loss at its first step (the metric history's): where its learning started."""
    def stored() -> float | None:
        r = client.get(f"/v1/training-jobs/{j['jobId']}/metrics", params={"series": "loss", "toStep": 1})
        loss = r.json()["series"]["loss"] if r.status_code == 200 else {}
        return loss["values"][0] if loss.get("steps") == [1] else None
    value = poll(stored, f"{j['jobId']}'s loss at step 1", timeout_s=120)
    assert value is not None
    return value


def kill_replica(stack: LocalStack, client: httpx.Client, job_id: str, rank: int, after_step: int) -> None:
    """kill -9 the rank's process once the job is past ``after_step`` (its latest READY checkpoint at least)."""
    wait_for(client, job_id, f"step {after_step}", lambda j: j["state"] == "running"
             and (j.get("progress") or {}).get("globalStep", 0) >= after_step and ready_steps(j))
    pids = wait_for(client, job_id, "rank pids", lambda _: (p := rank_pids(stack, job_id, 1)) and rank in p and p)
    os.kill(pids[rank], signal.SIGKILL)


@pytest.mark.parametrize(("replicas", "batch"), [
    (2, "reduced"),
    # accumulate's arithmetic (each replica's share, the weights) is unit-tested (tests/unit/trainyard_sdk/
    # test_replicas.py); its whole run on three replicas is a long one (CI time)
    pytest.param(3, "accumulate", marks=[pytest.mark.long, pytest.mark.skipif(
        os.environ.get("TRAINYARD_LONG_TESTS") != "1", reason="3 replicas end to end: TRAINYARD_LONG_TESTS=1")]),
])
def test_a_killed_replica_is_replaced_while_the_others_train_on(
        stack: LocalStack, client: httpx.Client, tmp_path: Path, replicas: int, batch: str) -> None:
    shape = {"resources__gpuCount": replicas, "parallelism__data": replicas, "faultTolerance__replicas": replicas,
             "faultTolerance__batch": batch, "training__globalBatchSize": 8 * replicas, "training__maxSteps": STEPS,
             "checkpointPolicy__everySteps": 100, "code__env": PAUSE}
    # the model of the first case is compared with an uninterrupted run of the same spec (the second's is not:
    # one comparison states the tolerance, and a reference run costs a whole job's time)
    reference = submit(stack, tmp_path, "fault-tolerant", name=f"ft-reference-{replicas}", **shape) \
        if replicas == 2 else None
    faulted = submit(stack, tmp_path, "fault-tolerant", name=f"ft-faulted-{replicas}", **shape)
    victim = replicas - 1
    kill_replica(stack, client, faulted, victim, after_step=40)

    got = finished(client, faulted)
    assert got["state"] == "succeeded", json.dumps(got)[:4000]
    # the attempt went on: one attempt, the victim replaced once (generation 1), on the node that held it
    (attempt,) = got["attempts"]
    assert attempt["generations"] == {str(victim): 1}, attempt
    (replacement,) = attempt["replacements"]
    assert replacement["rank"] == victim and replacement["reason"] == "killed", replacement
    assert replacement["startedAt"] is not None, replacement
    # no step was applied by two quorums (a survivor whose allreduce failed heals forward to a peer's commit)
    assert check_one_quorum_per_step(replica_logs(stack, got)) == []
    # the survivors never stopped for longer than a quorum timeout, and reached the end
    for rank in range(replicas - 1):
        times = step_times(stack, got, rank)
        assert times[-1][0] == STEPS, times[-5:]
        gap = max(b - a for (_, a), (_, b) in zip(times, times[1:], strict=False))
        assert gap < QUORUM_TIMEOUT_S, f"rank {rank} stood still for {gap:.1f}s"
    # some steps ran with fewer replicas, and the survivors said so
    reported = [json.loads(line) for line in
                (attempt_dir(stack, got) / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert any(e["replicas"] < replicas for e in reported) and reported[-1]["replicas"] == replicas
    # the newcomer healed from a peer: every replica ends with the same weights, bit for bit
    final = digests(stack, got)
    assert f"rank-{victim}.g1.log" in final and len(final) == replicas, final
    assert len(set(final.values())) == 1, final
    # checkpoints: each step READY once, the last at maxSteps, none of them lost
    steps = [c["globalStep"] for c in got["checkpoints"] if c["state"] == "READY"]
    assert len(steps) == len(set(steps)) and max(steps) == STEPS, got["checkpoints"]
    assert all(c["state"] in ("READY", "DELETED") for c in got["checkpoints"]), got["checkpoints"]
    # the checkpoint at maxSteps holds the model; it is close to an uninterrupted run's
    assert "model" in final_state(got, tmp_path)
    if reference is not None:
        ref = finished(client, reference)
        assert ref["state"] == "succeeded" and len(ref["attempts"]) == 1, json.dumps(ref)[:2000]
        reference_loss, faulted_loss = held_out_loss(stack, ref), held_out_loss(stack, got)
        start = first_loss(client, ref)
        learned = start - reference_loss
        assert learned > 0, (start, reference_loss)
        unseen = sum(replicas - e["replicas"] for e in reported) / (replicas * len(reported))
        allowed = learned * (TOLERANCE + unseen)
        assert abs(faulted_loss - reference_loss) <= allowed, {
            "faulted": faulted_loss, "reference": reference_loss, "learned": learned, "unseen": unseen}


def test_below_min_replicas_the_attempt_restarts_from_the_latest_ready_checkpoint(
        stack: LocalStack, client: httpx.Client, tmp_path: Path) -> None:
    job_id = submit(stack, tmp_path, "fault-tolerant", name="ft-below-min", faultTolerance__minReplicas=2,
                    training__maxSteps=120, checkpointPolicy__everySteps=20, code__env=PAUSE)
    kill_replica(stack, client, job_id, 1, after_step=30)
    j = finished(client, job_id)
    assert j["state"] == "succeeded", json.dumps(j)[:4000]
    first, second = j["attempts"][0], j["attempts"][1]
    assert first["state"] == "failed" and "fewer than minReplicas 2" in (first.get("failureReason") or ""), first
    assert not first.get("replacements"), first
    assert second["startCheckpoint"]["globalStep"] >= 20, second
    assert len(set(digests(stack, j, 2).values())) == 1
    assert check_one_quorum_per_step(replica_logs(stack, j, 2)) == []


def test_the_built_in_trainer_replaces_a_killed_replica_too(
        stack: LocalStack, client: httpx.Client, tmp_path: Path) -> None:
    """``examples/tiny.yaml`` (the built-in trainer's GPT, no code of the user's) with faultTolerance."""
    spec = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    spec.update(name="tiny-fault-tolerant", faultTolerance={"replicas": 2, "minReplicas": 1,
                                                             "quorumTimeoutSeconds": QUORUM_TIMEOUT_S})
    spec["training"]["maxSteps"] = 300
    spec["checkpointPolicy"]["everySteps"] = 50
    spec_file = tmp_path / "tiny-ft.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    done = trainyard(stack, "submit", str(spec_file))
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split()[1]
    kill_replica(stack, client, job_id, 1, after_step=20)
    j = finished(client, job_id)
    assert j["state"] == "succeeded", json.dumps(j)[:4000]
    (attempt,) = j["attempts"]
    assert attempt["generations"] == {"1": 1} and attempt["replacements"][0]["startedAt"], attempt
    assert check_one_quorum_per_step(replica_logs(stack, j)) == []
    newcomer = (attempt_dir(stack, j) / "logs" / "rank-1.g1.log").read_text(errors="replace")
    assert "healed from a peer at step" in newcomer, newcomer[-3000:]
    steps = [c["globalStep"] for c in j["checkpoints"] if c["state"] == "READY"]
    assert len(steps) == len(set(steps)) and max(steps) == 300
    # replica 0's run record says which steps ran with fewer replicas
    record = json.loads((attempt_dir(stack, j) / "run-record.json").read_text())
    assert record["status"] == "succeeded" and record["replicas"]["replicas"] == 2, record.get("replicas")
    assert record["replicas"]["degradedTotal"] >= 1 and len(record["replicas"]["degradedSteps"]) >= 1
