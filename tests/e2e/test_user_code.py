"""Users' own training code on the local stack, submitted as a user does: `trainyard submit spec.yaml
--code examples/<name>` (packed, uploaded, pinned by content) → HTTP → scheduler → node agents → the
script's ranks (real torch.distributed processes) → verified checkpoints → registry lineage.

* each example under examples/ succeeds: the plain-PyTorch GPT and the `transformers` Llama through the
  rank SDK, and a torchrun-style script with no SDK at all;
* kill -9 of one rank of the `transformers` job mid-run: a new attempt resumes from the latest READY
  checkpoint and ends bitwise identical (model and optimizer) to an uninterrupted run of the same spec;
* pause → resume of an SDK job: the ranks save the step they agree on, exit 7, and the next attempt
  continues from exactly that checkpoint;
* lineage names the code archive and the git commit it was packed from.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.chaos.invariants import check_bitwise_identical
from tests.support.cli import trainyard
from tests.support.stack import api_client, rank_entries, running_stack
from trainyard_cli.stack import LocalStack
from trainyard_contract.storage import uri_to_path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]  # the dataset is built once per module
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "code-stack")


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Iterator[httpx.Client]:
    yield from api_client(stack)


def submit(stack: LocalStack, tmp: Path, example: str, **changes: Any) -> str:
    """``trainyard submit <example>/spec.yaml --code <example>``, the spec changed as asked; the job id."""
    spec = yaml.safe_load((EXAMPLES / example / "spec.yaml").read_text())
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = spec
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    spec_file = tmp / f"{example}-{len(list(tmp.iterdir()))}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    done = trainyard(stack, "submit", str(spec_file), "--code", str(EXAMPLES / example))
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split()[1]
    assert job_id.startswith("job-"), done.stdout
    return job_id


def job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()


def wait_for(client: httpx.Client, job_id: str, what: str, probe: Any, timeout_s: float = 600) -> Any:
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = job(client, job_id)
        if found := probe(last):
            return found
        if last["state"] in TERMINAL:
            break
        time.sleep(0.5)
    raise AssertionError(f"{job_id}: no {what}; last: {json.dumps(last)[:3000]}")


def finished(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return wait_for(client, job_id, "terminal state", lambda j: j if j["state"] in TERMINAL else None)


def ready_steps(j: dict[str, Any]) -> list[int]:
    return sorted(c["globalStep"] for c in j["checkpoints"] if c["state"] == "READY")


def final_state(j: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The job's READY checkpoint at maxSteps, loaded here."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    max_steps = j["spec"]["training"]["maxSteps"]
    final = next(c for c in j["checkpoints"] if c["state"] == "READY" and c["globalStep"] == max_steps)
    out = tmp / f"{j['jobId']}.pt"
    dcp_to_torch_save(uri_to_path(final["manifestUri"]).parent, out)
    return torch.load(out, weights_only=False)


def rank_log(stack: LocalStack, j: dict[str, Any], attempt: int, rank: int) -> str:
    root = stack.s.state_dir / "artifacts"
    attempt_dir = root / "tenants" / j["tenant"] / "jobs" / j["jobId"] / "attempts" / str(attempt)
    path = attempt_dir / "logs" / f"rank-{rank}.log"
    return path.read_text(errors="replace")


def rank_pids(stack: LocalStack, job_id: str, attempt: int) -> dict[int, int]:
    """Rank → pid of the attempt's running ranks, from the node agents' tables in Redis."""
    return {int(e["rank"]): int(e["pid"]) for _, e in rank_entries(stack, job_id) if int(e["attempt"]) == attempt}


def model_artifact(client: httpx.Client, job_id: str, timeout_s: float = 120) -> dict[str, Any] | None:
    """The job's ``model`` artifact, once the registry recorded it (it follows the job's success)."""
    deadline = time.monotonic() + timeout_s
    while True:
        arts = client.get("/v1/registry/artifacts", params={"jobId": job_id}).raise_for_status().json()
        arts = arts.get("artifacts", arts) if isinstance(arts, dict) else arts
        model = next((a for a in arts if a["type"] == "model"), None)
        if model is not None or time.monotonic() >= deadline:
            return model
        time.sleep(0.5)


def git_head() -> str | None:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


# --------------------------------------------------------------------------- every example succeeds


def test_each_example_runs_to_success_with_its_code_pinned_and_in_the_lineage(
        stack: LocalStack, client: httpx.Client, tmp_path: Path) -> None:
    jobs = {name: submit(stack, tmp_path, name) for name in ("gpt-sdk", "hf-llama", "torchrun-plain")}
    done = {name: finished(client, job_id) for name, job_id in jobs.items()}
    for name, j in done.items():
        assert j["state"] == "succeeded", f"{name}: {json.dumps(j)[:3000]}"
        code = j["spec"]["code"]
        assert code["archive"].startswith("sha256:") and code["entrypoint"][0] == "python"

    # the SDK jobs checkpoint as their policy says, the last one at maxSteps
    for name in ("gpt-sdk", "hf-llama"):
        j = done[name]
        every, max_steps = j["spec"]["checkpointPolicy"]["everySteps"], j["spec"]["training"]["maxSteps"]
        assert ready_steps(j)[-1] == max_steps, ready_steps(j)
        assert all(step % every == 0 or step == max_steps for step in ready_steps(j))
        assert j["progress"]["globalStep"] == max_steps
    # the plain script: no checkpoints, its own output in the rank log
    plain = done["torchrun-plain"]
    assert ready_steps(plain) == []
    assert "done: y = " in rank_log(stack, plain, 1, 0)
    # the ranks ran sandboxed (the local stack's default, TRAINYARD_NODE_SANDBOX=enforce): what they wrote
    # belongs to their job's own unprivileged user, one per job
    owners = {}
    for name in ("gpt-sdk", "hf-llama"):
        j = done[name]
        prefix = stack.s.state_dir / "artifacts" / "tenants" / j["tenant"] / "jobs" / j["jobId"] / "checkpoints"
        owners[name] = {f.stat().st_uid for f in prefix.rglob("*.distcp")} - {0}  # its shards
    assert all(len(uids) == 1 and min(uids) >= 1_000_000_000 for uids in owners.values()), owners
    assert owners["gpt-sdk"] != owners["hf-llama"], owners
    admin = {"Authorization": f"Bearer {stack.admin_token_file.read_text().strip()}"}  # a platform-admin route
    nodes = client.get("/v1/admin/nodes", headers=admin).raise_for_status().json()["nodes"]  # every node says so
    assert len(nodes) == 2 and {n["sandbox"] for n in nodes} == {"enforce"}, nodes

    # lineage: the final model of the Llama job names the code archive and the commit it was packed from
    j = done["hf-llama"]
    model = model_artifact(client, j["jobId"])
    assert model is not None, "the hf-llama job's model artifact was never recorded"
    # the plain script saved no final checkpoint: it has no model, and its success held nothing up
    assert model_artifact(client, plain["jobId"], timeout_s=0) is None
    lineage = model["lineage"]
    assert lineage["codeArchive"] == j["spec"]["code"]["archive"]
    head = git_head()
    if head is not None:  # a checkout: the archive records the commit it was packed from
        assert j["spec"]["code"]["commit"] == head
        assert lineage["codeCommit"] == head


# --------------------------------------------------------------------------- kill -9 → bitwise resume


def test_a_killed_rank_of_the_transformers_job_resumes_and_ends_bitwise_identical(
        stack: LocalStack, client: httpx.Client, tmp_path: Path) -> None:
    steps = {"training__maxSteps": 120, "checkpointPolicy__everySteps": 10}
    reference = submit(stack, tmp_path, "hf-llama", name="llama-reference", **steps)
    faulted = submit(stack, tmp_path, "hf-llama", name="llama-faulted", **steps)

    # once a checkpoint is READY (and well before the end), kill -9 one rank of the running attempt
    wait_for(client, faulted, "a READY checkpoint while running",
             lambda j: j["state"] == "running" and ready_steps(j) and ready_steps(j)[-1] < 100)
    pids = wait_for(client, faulted, "rank pids", lambda _: rank_pids(stack, faulted, 1) or None)
    os.kill(pids[max(pids)], signal.SIGKILL)

    ref, got = finished(client, reference), finished(client, faulted)
    assert ref["state"] == "succeeded" and len(ref["attempts"]) == 1, json.dumps(ref)[:2000]
    assert got["state"] == "succeeded", json.dumps(got)[:3000]
    first, second = got["attempts"][0], got["attempts"][1]
    assert first["state"] == "failed" and "killed" in (first.get("failureReason") or ""), first
    start = second.get("startCheckpoint") or {}
    assert start.get("globalStep", 0) >= 10, second  # resumed from a READY checkpoint, not from scratch
    problems = check_bitwise_identical(final_state(ref, tmp_path), final_state(got, tmp_path))
    assert problems == [], problems[:10]


# --------------------------------------------------------------------------- pause → resume


def test_a_paused_sdk_job_resumes_from_its_pause_checkpoint(
        stack: LocalStack, client: httpx.Client, tmp_path: Path) -> None:
    job_id = submit(stack, tmp_path, "gpt-sdk", name="gpt-paused", training__maxSteps=400,
                    checkpointPolicy__everySteps=1000)
    wait_for(client, job_id, "running ranks", lambda j: j["state"] == "running" and rank_pids(stack, job_id, 1))
    paused = trainyard(stack, "jobs", "pause", job_id)
    assert paused.returncode == 0, paused.stderr
    j = wait_for(client, job_id, "paused", lambda j: j if j["state"] == "paused" else None)
    (saved,) = ready_steps(j)  # everySteps 1000: the only checkpoint is the one the pause asked for
    assert 0 < saved < 400
    assert j["attempts"][0]["state"] == "revoked", j["attempts"][0]

    resumed = trainyard(stack, "jobs", "resume", job_id)
    assert resumed.returncode == 0, resumed.stderr
    j = finished(client, job_id)
    assert j["state"] == "succeeded", json.dumps(j)[:3000]
    assert j["attempts"][1]["startCheckpoint"]["globalStep"] == saved
    assert f"at step {saved}" in rank_log(stack, j, 2, 0)  # the SDK's restore says from what it resumed
    assert ready_steps(j)[-1] == 400


# ------------------------------------------------------------------ bad code: a clear reason, nothing retried in vain


def test_broken_scripts_fail_with_the_scripts_own_last_error_line(
        stack: LocalStack, client: httpx.Client, tmp_path: Path) -> None:
    """An import error fails the job at once (config, not retried); an exception mid-run fails it with
    the exception's last line once the retry budget is spent."""
    spec = yaml.safe_load((EXAMPLES / "torchrun-plain" / "spec.yaml").read_text())
    scripts = {
        "import-error": "import torch\nimport definitely_not_installed\n",
        "raises": "print('step 1', flush=True)\nraise RuntimeError('loss exploded at step 3 (user check)')\n",
    }
    jobs = {}
    for name, source in scripts.items():
        project = tmp_path / name
        project.mkdir()
        (project / "train.py").write_text(source)
        spec_file = tmp_path / f"{name}.yaml"
        spec_file.write_text(yaml.safe_dump({**spec, "name": name}))
        done = trainyard(stack, "submit", str(spec_file), "--code", str(project))
        assert done.returncode == 0, done.stdout + done.stderr
        jobs[name] = done.stdout.split()[1]

    broken = finished(client, jobs["import-error"])
    assert broken["state"] == "failed" and len(broken["attempts"]) == 1, json.dumps(broken)[:2000]
    assert broken["reason"].startswith("config: ") and "ModuleNotFoundError" in broken["reason"], broken["reason"]
    assert "not retryable" in broken["reason"]

    raising = finished(client, jobs["raises"])
    assert raising["state"] == "failed", json.dumps(raising)[:2000]
    assert len(raising["attempts"]) == raising["maxAttempts"]  # retried: a mid-run error may be transient
    assert "RuntimeError: loss exploded at step 3 (user check)" in raising["reason"], raising["reason"]
