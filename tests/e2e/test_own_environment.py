"""A job's own packages on the local stack, as a user submits them: `trainyard submit spec.yaml --code DIR` where
DIR holds a hash-pinned requirements.txt → the API pins its sha256 → every node builds the environment once with
uv from the operator's index (here a directory of wheels made by the test: nothing comes from the network) →
the script's ranks import a package the base does not have, in a sandbox where the environment is read-only.

* the first job builds on every node and succeeds; the second with the same lock reuses it on every node
  (nothing built: each node says cached); a changed lock builds a new one and both are in the lineage;
* a bad lock fails `config` at once, in the installer's words, on its first attempt: an unknown package, two
  pins of one package, a lock replacing the node's own pydantic or torch;
* an environment tampered with on one node is rebuilt there, never run (the script checks what it imports).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.cli import trainyard
from tests.support.stack import running_stack
from tests.support.wheels import Wheel, probe_wheel, requirements_lock
from trainyard_cli.stack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]
TERMINAL = {"succeeded", "failed", "cancelled"}
RANKS = 5  # four on one node, one on the other: every node builds

SCRIPT = '''"""Imports a package the node's base does not have, from the job's environment."""
import os
import pathlib

import torch
import torch.nn as nn

import trainyard
import tydep  # noqa: F401 - needs typrobe: the lock brings both
import typrobe

assert typrobe.VALUE == os.environ["EXPECT_VALUE"], f"imported {typrobe.VALUE!r} from {typrobe.__file__}"
try:  # the environment is read-only inside the sandbox: no rank changes what the next job imports
    pathlib.Path(typrobe.__file__).write_text("VALUE = 'changed by a rank'\\n")
except OSError:
    pass
else:
    raise SystemExit("a rank could write into its environment")

with trainyard.init() as run:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": trainyard.ModelState(model), "optimizer": trainyard.OptimizerState(model, optimizer)}
    step = run.restore(state)
    while step < run.max_steps:
        torch.manual_seed(step)  # the same batch on every rank: replicas stay equal without a collective
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        run.report(step, loss=loss.item())
        run.checkpoint(step, state)
        if run.should_stop():
            break
'''


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Wheel]:
    where = tmp_path_factory.mktemp("wheels")
    return {"probe1": probe_wheel(where, "1.0.0"), "probe2": probe_wheel(where, "2.0.0"),
            "dep": probe_wheel(where, "1.0.0", name="tydep", requires=["typrobe>=1"])}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, index: dict[str, Wheel]) -> Iterator[LocalStack]:
    wheels = str(index["probe1"].path.parent)
    yield from running_stack(tmp_path_factory, "env-stack",
                             extra_env={"TRAINYARD_ENV_FIND_LINKS": wheels, "TRAINYARD_ENV_NO_INDEX": "true"})


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Iterator[httpx.Client]:
    token = stack.token_file.read_text().strip()
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        yield c


def code_tree(tmp: Path, name: str, lock: str, expect: str) -> tuple[Path, Path]:
    """A code tree with the script and ``lock`` as requirements.txt, and its spec file."""
    tree = tmp / name
    tree.mkdir()
    (tree / "train.py").write_text(SCRIPT)
    (tree / "requirements.txt").write_text(lock)
    spec = {"specVersion": "v1", "name": name, "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1",
            "codeRevision": name, "code": {"entrypoint": ["python", "train.py"], "env": {"EXPECT_VALUE": expect}},
            "resources": {"gpuType": "cpu", "gpuCount": RANKS}, "parallelism": {"data": RANKS},
            "checkpointPolicy": {"everySteps": 2, "keepLast": 2},
            "training": {"seed": 0, "sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": RANKS,
                         "learningRate": 0.1, "maxSteps": 4}}
    spec_file = tmp / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    return tree, spec_file


def submit(stack: LocalStack, tree: Path, spec_file: Path) -> str:
    done = trainyard(stack, "submit", str(spec_file), "--code", str(tree))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "environment requirements.txt sha256:" in done.stderr, done.stderr  # the CLI says what it found
    return done.stdout.split()[1]


def finished(client: httpx.Client, job_id: str, timeout_s: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        if job["state"] in TERMINAL:
            return job
        time.sleep(0.5)
    raise AssertionError(f"{job_id} did not finish: {json.dumps(job)[:3000]}")


def lock_sha(lock: str) -> str:
    return "sha256:" + hashlib.sha256(lock.encode()).hexdigest()


def per_node(job: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """node → (state, cached) of the last attempt's environment."""
    return {n: (e["state"], e["cached"]) for n, e in job["attempts"][-1]["environment"].items()}


def lineage_environments(client: httpx.Client, job_id: str) -> set[str | None]:
    deadline = time.monotonic() + 120
    while True:
        arts = client.get("/v1/registry/artifacts", params={"jobId": job_id}).raise_for_status().json()
        arts = arts.get("artifacts", arts) if isinstance(arts, dict) else arts
        if arts or time.monotonic() > deadline:
            return {a["lineage"].get("environment") for a in arts}
        time.sleep(0.5)


def test_a_job_runs_with_its_own_packages_built_once_per_node_and_in_its_lineage(
        stack: LocalStack, client: httpx.Client, index: dict[str, Wheel], tmp_path: Path) -> None:
    lock1 = requirements_lock([index["probe1"], index["dep"]])
    first = finished(client, submit(stack, *code_tree(tmp_path, "env-first", lock1, "typrobe 1.0.0")))
    assert first["state"] == "succeeded", first.get("reason")
    assert first["spec"]["code"]["environment"] == {"lock": "requirements.txt", "sha256": lock_sha(lock1)}
    assert per_node(first) == {"node-0": ("ready", False), "node-1": ("ready", False)}  # built on both nodes
    assert first["attempts"][-1]["starts"] == {"cold": RANKS}
    assert lock_sha(lock1) in first["attempts"][-1]["startDetail"]

    second = finished(client, submit(stack, *code_tree(tmp_path, "env-again", lock1, "typrobe 1.0.0")))
    assert second["state"] == "succeeded", second.get("reason")
    assert per_node(second) == {"node-0": ("ready", True), "node-1": ("ready", True)}  # nothing built

    lock2 = requirements_lock([index["probe2"], index["dep"]])
    changed = finished(client, submit(stack, *code_tree(tmp_path, "env-changed", lock2, "typrobe 2.0.0")))
    assert changed["state"] == "succeeded", changed.get("reason")
    assert per_node(changed) == {"node-0": ("ready", False), "node-1": ("ready", False)}
    assert lineage_environments(client, first["jobId"]) == {lock_sha(lock1)}
    assert lineage_environments(client, changed["jobId"]) == {lock_sha(lock2)}

    shown = trainyard(stack, "jobs", "get", first["jobId"])
    assert "environment" in shown.stdout and lock_sha(lock1)[:19] in shown.stdout, shown.stdout

    # tamper with the environment on one node: that node rebuilds it, and the ranks import the real package
    caches = sorted(stack.s.state_dir.rglob("env-cache"))
    module = next(caches[0].glob(f"{lock_sha(lock1).removeprefix('sha256:')}/tree/typrobe/__init__.py"))
    module.chmod(0o644)
    module.write_text("VALUE = 'tampered'\n")
    after = finished(client, submit(stack, *code_tree(tmp_path, "env-tampered", lock1, "typrobe 1.0.0")))
    assert after["state"] == "succeeded", after.get("reason")
    assert sorted(cached for _, cached in per_node(after).values()) == [False, True]  # rebuilt where tampered


@pytest.mark.parametrize(("lock", "says"), [
    ("nonexistent-pkg==1.0 --hash=sha256:" + "0" * 64 + "\n",
     "nonexistent-pkg was not found in the provided package locations"),
    ("{probe1}{probe2}", "Because you require typrobe==1.0.0 and typrobe==2.0.0"),
    ("pydantic==1.10.13 --hash=sha256:" + "1" * 64 + "\n", "would replace the node's own pydantic==1.10.13"),
    ("torch==2.0.0 --hash=sha256:" + "1" * 64 + "\n", "would replace the node's own torch==2.0.0"),
], ids=["unknown-package", "conflicting-pins", "replaces-pydantic", "replaces-torch"])
def test_a_bad_lock_fails_config_at_once_in_the_installers_words(
        stack: LocalStack, client: httpx.Client, index: dict[str, Wheel], tmp_path: Path, lock: str,
        says: str) -> None:
    text = lock.format(probe1=index["probe1"].pin() + "\n", probe2=index["probe2"].pin() + "\n")
    job = finished(client, submit(stack, *code_tree(tmp_path, "env-bad", text, "-")))
    assert job["state"] == "failed" and len(job["attempts"]) == 1, job.get("reason")  # not retried
    assert "code.environment" in job["reason"] and says in job["reason"], job["reason"]
    # the first node to fail ends the attempt; the other's word may come after it ended (then it is not noted)
    assert "failed" in {e["state"] for e in job["attempts"][-1]["environment"].values()}
