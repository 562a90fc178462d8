"""What a job's own environment (``code.environment``) costs at its start, on the live path: POST → the scheduler
→ a node agent (verifying the cached environment, binding it into the sandbox) → the rank's first reported step.
Prints figures, never fails.

A private local stack (1 node agent × 2 CPU devices, no warm interpreters: user code starts cold either way) and
a package index of the bench's own (wheels made here: nothing from the network). The same one-rank SDK script is
submitted from two code trees, interleaved: one with a hash-pinned requirements.txt (two packages the base does
not have), one without. The first job with the lock builds the environment (its build time is reported); every
later one finds it cached.

    python bench/environment/run.py [--runs 10] [--pypi]

``--pypi`` also builds examples/own-environment's lock (einops, from PyPI: needs the network) once, outside the
stack, and reports that build's seconds: a first build as a user meets it.

Figures: the median start (POST → first step) of each, and cached ÷ none as a speed ratio (start without an
environment ÷ start with a cached one: ≥ 0.95 means the environment costs a job at most about 5 % of its start);
the first build's seconds on the node, and that first job's start.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.stack import local_stack  # noqa: E402 - after the sys.path set-up
from tests.support.wheels import probe_wheel, requirements_lock  # noqa: E402
from trainyard_cli.stack import LocalStack  # noqa: E402
from trainyard_contract import codetree  # noqa: E402

SCRIPT = '''import torch
import trainyard
try:
    import tydep, typrobe  # noqa: F401 - from the job's environment, when it has one
except ImportError:
    pass

with trainyard.init() as run:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": trainyard.ModelState(model), "optimizer": trainyard.OptimizerState(model, optimizer)}
    step = run.restore(state)
    while step < run.max_steps:
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        run.report(step, loss=loss.item())
        run.checkpoint(step, state)
'''


def spec(name: str, archive: str, lock: str | None) -> dict[str, Any]:
    code: dict[str, Any] = {"archive": archive, "entrypoint": ["python", "train.py"]}
    if lock is not None:
        code["environment"] = {"lock": lock}
    return {"specVersion": "v1", "name": name, "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1",
            "codeRevision": "bench-environment", "code": code,
            "resources": {"gpuType": "cpu", "gpuCount": 1}, "parallelism": {"data": 1},
            "checkpointPolicy": {"everySteps": 1000},
            "training": {"seed": 0, "sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 1,
                         "learningRate": 0.1, "maxSteps": 2}}


@contextmanager
def private_stack(index: Path) -> Iterator[LocalStack]:
    """1 node agent x 2 CPU devices installing environments from ``index`` only, no warm interpreters."""
    root = Path(tempfile.mkdtemp(prefix="trainyard-bench-env-"))
    try:
        with local_stack(root / ".trainyard", nodes=1, devices_per_node=2, extra_env={
                "TRAINYARD_ENV_FIND_LINKS": str(index), "TRAINYARD_ENV_NO_INDEX": "true",
                "TRAINYARD_WARM_RANKS": "0"}) as stack:
            yield stack
    finally:
        shutil.rmtree(root, ignore_errors=True)


def upload(api: httpx.Client, tree: Path) -> str:
    data = codetree.pack(tree, sorted(p.name for p in tree.iterdir()))
    archive = codetree.archive_id(data)
    api.put(f"/v1/code/{archive}", content=data, headers={"Content-Type": "application/gzip"}).raise_for_status()
    return archive


def start(api: httpx.Client, body: dict[str, Any], timeout_s: float = 300) -> tuple[float, dict[str, Any]]:
    """Seconds from the POST to the rank's first reported step; the job, once it ended."""
    began = time.perf_counter()
    job_id = api.post("/v1/training-jobs", json=body).raise_for_status().json()["jobId"]
    first = None
    deadline = began + timeout_s
    while time.perf_counter() < deadline:
        job = api.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        if first is None and job["progress"]["globalStep"] >= 1:
            first = time.perf_counter() - began
        if job["state"] in ("succeeded", "failed", "cancelled"):
            if job["state"] != "succeeded":
                raise SystemExit(f"{job_id} {job['state']}: {job.get('reason')}")
            if first is None:
                raise SystemExit(f"{job_id} ended without a step being seen")
            return first, job
        time.sleep(0.02)
    raise SystemExit(f"{job_id} did not finish within {timeout_s}s")


def pypi_build() -> float:
    """Seconds to build the example's lock (from PyPI) into an empty environment cache."""
    import asyncio
    import hashlib

    from trainyard_contract.spec import Environment
    from trainyard_node_agent.envcache import EnvCache, Installer, base_environment, find_uv

    tree = REPO / "examples" / "own-environment"
    lock = (tree / "requirements.txt").read_bytes()
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-env-pypi-") as tmp:
        cache = EnvCache(Path(tmp), max_bytes=10**10, installer=Installer(find_uv()), base=base_environment())
        plan = cache.plan(Environment(lock="requirements.txt", sha256="sha256:" + hashlib.sha256(lock).hexdigest()),
                          tree)
        began = time.perf_counter()
        asyncio.run(cache.acquire(plan, lambda _line: None))
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="jobs of each kind (interleaved)")
    parser.add_argument("--pypi", action="store_true", help="also build examples/own-environment's lock from PyPI")
    args = parser.parse_args()
    if args.pypi:
        print(f"first build of examples/own-environment's lock from PyPI: {pypi_build():.2f} s")
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-env-src-") as tmp:
        work = Path(tmp)
        wheels = [probe_wheel(work / "index", "1.0.0"), probe_wheel(work / "index", "1.0.0", name="tydep",
                                                                    requires=["typrobe>=1"])]
        plain, locked = work / "plain", work / "locked"
        for tree in (plain, locked):
            tree.mkdir()
            (tree / "train.py").write_text(SCRIPT)
        (locked / "requirements.txt").write_text(requirements_lock(wheels))
        with private_stack(work / "index") as stack:
            token = stack.token_file.read_text().strip()
            with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"},
                              timeout=60) as api:
                archives = {"none": upload(api, plain), "cached": upload(api, locked)}
                start(api, spec("bench-env-warmup", archives["none"], None))  # the stack's own first start
                first_start, first_job = start(api, spec("bench-env-first-build", archives["cached"],
                                                         "requirements.txt"))
                (node_env,) = first_job["attempts"][-1]["environment"].values()
                times: dict[str, list[float]] = {"none": [], "cached": []}
                for i in range(args.runs):
                    for kind in ("none", "cached") if i % 2 == 0 else ("cached", "none"):
                        took, job = start(api, spec(f"bench-env-{kind}-{i}", archives[kind],
                                                    "requirements.txt" if kind == "cached" else None))
                        if kind == "cached":
                            assert all(e["cached"] for e in job["attempts"][-1]["environment"].values())
                        times[kind].append(took)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"start, no environment       median {med['none'] * 1e3:7.0f} ms  ({args.runs} jobs)")
    print(f"start, cached environment   median {med['cached'] * 1e3:7.0f} ms  ({args.runs} jobs)")
    print(f"speed ratio (none ÷ cached): {med['none'] / med['cached']:.3f}   (goal ≥ 0.95)")
    print(f"first build of a 2-package lock on the node: {node_env['elapsedSeconds']:.2f} s; "
          f"that job's start {first_start * 1e3:.0f} ms")
    print(json.dumps({"runs": args.runs, "median_start_s": med, "speed_ratio": med["none"] / med["cached"],
                      "first_build_s": node_env["elapsedSeconds"], "first_build_job_start_s": first_start,
                      "starts_s": times}))


if __name__ == "__main__":
    main()
