"""Time from a READY checkpoint to its evaluation result, on the local stack (a benchmark: it prints figures).

    python bench/experiments/eval_latency.py [--steps 60] [--every 10] [--batches 4] [--nodes 2] [--eval-ranks 1]
                                             [--json out.json]

One 2-rank job (examples/tiny.yaml: gpt-tiny on tinycorpus@v1, CPU ranks) checkpoints every ``--every`` steps;
a ``checkpointReady`` trigger on it (``everySteps`` the same) submits one evaluation job per READY checkpoint
(the built-in evaluator: held-out loss and perplexity over ``--batches`` batches, ``--eval-ranks`` CPU ranks), and
the registry attaches each result to its checkpoint. Measured per checkpoint, from the records: its ``readyAt`` (the
coordinator's CheckpointReady) to the result's ``finishedAt`` (the registry's EvaluationResult) — the registry
feed, the trigger's submission, scheduling, the evaluation ranks' start, restore and evaluation, the relay.
Printed: the median and the maximum, and the job's own training time for scale. The stack has ``--nodes`` nodes of
4 CPU devices (2: the training job and three evaluations run at once; 1: the evaluations queue for devices behind
the training job and each other, and the figure is mostly that wait).

The same scenario is the e2e test's (tests/e2e/test_evaluation_trigger.py), which asserts on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402 - after the sys.path set-up
import yaml  # noqa: E402

TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Scenario:
    """What one run of the scenario saw."""

    job_id: str
    trigger_id: str
    ready_steps: list[int]
    evaluation_jobs: dict[str, str]  # checkpoint artifact → evaluation job
    evaluations: list[dict[str, Any]]
    latencies_s: dict[int, float] = field(default_factory=dict)  # step → readyAt → finishedAt
    train_seconds: float = 0.0


def tenant_of(client: httpx.Client) -> str:
    return str(client.get("/v1/whoami").raise_for_status().json()["tenant"])


def job_id_for(tenant: str, key: str) -> str:
    """The id the API derives from an Idempotency-Key (``trainyard_api.jobs.new_job_id``): known before the job is
    submitted, so the trigger can watch it from its first checkpoint on."""
    from trainyard_api.jobs import new_job_id

    return new_job_id(tenant, key)


def training_spec(*, steps: int, every: int) -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["name"] = "evaluated"
    spec["training"]["maxSteps"] = steps
    spec["checkpointPolicy"] = {"everySteps": every, "keepLast": 1000}  # every checkpoint stays loadable
    return spec


def evaluation_template(*, batches: int, ranks: int = 2) -> dict[str, Any]:
    """The trigger's template: the tiny model's spec as an evaluation (no dataset, no initFrom: the trigger fills
    both in from each checkpoint)."""
    spec = training_spec(steps=1, every=1000)
    spec.pop("dataset")
    spec["name"] = "evaluation"
    spec["evaluation"] = {"batches": batches}
    spec["resources"] = {**spec["resources"], "gpuCount": ranks}
    spec["parallelism"] = {"data": ranks, "tensor": 1, "pipeline": 1}
    return spec


def wait(what: str, probe: Any, timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        if answer := probe():
            return answer
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(every_s)


def state_of(client: httpx.Client, job_id: str) -> str:
    return str(client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()["state"])


def trigger_jobs(client: httpx.Client, trigger_id: str) -> dict[str, str]:
    view = client.get(f"/v1/triggers/{trigger_id}").raise_for_status().json()
    return {j["dataset"]: j["jobId"] for j in view["jobs"]}


def run_scenario(client: httpx.Client, *, steps: int = 60, every: int = 10, batches: int = 4, ranks: int = 2,
                 timeout_s: float = 600) -> Scenario:
    """Train one job with a checkpointReady trigger on it; wait for every evaluation; measure."""
    tenant = tenant_of(client)
    key = f"eval-latency-{uuid.uuid4().hex[:8]}"
    job_id = job_id_for(tenant, key)
    trigger = client.post("/v1/triggers", json={
        "name": f"eval-{key[-8:]}", "on": "checkpointReady", "job": job_id, "everySteps": every,
        "template": evaluation_template(batches=batches, ranks=ranks)})
    trigger.raise_for_status()
    trigger_id = trigger.json()["triggerId"]
    started = time.monotonic()
    resp = client.post("/v1/training-jobs", json=training_spec(steps=steps, every=every),
                       headers={"Idempotency-Key": key})
    resp.raise_for_status()
    assert resp.json()["jobId"] == job_id, (resp.json()["jobId"], job_id)
    wait("the trained job", lambda: state_of(client, job_id) in TERMINAL, timeout_s)
    train_seconds = time.monotonic() - started
    if (state := state_of(client, job_id)) != "succeeded":
        raise RuntimeError(f"the trained job {job_id} ended {state}")
    checkpoints = client.get(f"/v1/training-jobs/{job_id}/checkpoints").raise_for_status().json()["checkpoints"]
    ready = {c["globalStep"]: c for c in checkpoints if c["state"] == "READY"}
    expected = sorted(s for s in ready if s % every == 0)

    def all_evaluated() -> list[dict[str, Any]] | None:
        found = client.get(f"/v1/training-jobs/{job_id}/evaluations").raise_for_status().json()["evaluations"]
        return found if {e["globalStep"] for e in found} >= set(expected) else None

    evaluations = wait("an evaluation of every READY checkpoint", all_evaluated, timeout_s)
    scenario = Scenario(job_id=job_id, trigger_id=trigger_id, ready_steps=expected,
                        evaluation_jobs=trigger_jobs(client, trigger_id), evaluations=evaluations,
                        train_seconds=train_seconds)
    for e in evaluations:
        ready_at = datetime.fromisoformat(ready[e["globalStep"]]["readyAt"])
        scenario.latencies_s[e["globalStep"]] = (datetime.fromisoformat(e["finishedAt"]) - ready_at).total_seconds()
    return scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2, help="nodes of 4 CPU devices (default 2)")
    parser.add_argument("--eval-ranks", type=int, default=1, help="ranks of each evaluation job (default 1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from trainyard_cli import infra
    from trainyard_cli.devstack import prepare_and_publish
    from trainyard_cli.stack import LocalStack, StackSettings

    with tempfile.TemporaryDirectory(prefix="eval-latency-") as tmp:
        settings = StackSettings(state_dir=Path(tmp) / ".trainyard", kafka_port=infra.free_port(),
                                 redis_port=infra.free_port(), api_port=infra.free_port(), nodes=args.nodes,
                                 devices_per_node=4, ready_timeout_s=180)
        stack = LocalStack(settings)
        try:
            stack.up()
            prepare_and_publish(stack)
            token = stack.token_file.read_text().strip()
            with httpx.Client(base_url=settings.api_url, headers={"Authorization": f"Bearer {token}"},
                              timeout=10) as client:
                scenario = run_scenario(client, steps=args.steps, every=args.every, batches=args.batches,
                                        ranks=args.eval_ranks)
        finally:
            stack.down()
    latencies = [scenario.latencies_s[s] for s in sorted(scenario.latencies_s)]
    print(f"job {scenario.job_id}: {args.steps} steps on 2 CPU ranks in {scenario.train_seconds:.1f} s, "
          f"{len(latencies)} READY checkpoints (every {args.every} steps), one evaluation each "
          f"({args.batches} held-out batches, {args.eval_ranks} CPU rank(s)); {args.nodes} node(s) of 4 devices")
    for step in sorted(scenario.latencies_s):
        metrics = next(e["metrics"] for e in scenario.evaluations if e["globalStep"] == step)
        print(f"  step {step:5d}: READY → result {scenario.latencies_s[step]:6.2f} s   "
              f"loss {metrics['loss']:.4f} perplexity {metrics['perplexity']:.2f}")
    print(f"READY → evaluation result: median {statistics.median(latencies):.2f} s, max {max(latencies):.2f} s")
    if args.json:
        args.json.write_text(json.dumps({"latencies_s": scenario.latencies_s, "train_seconds": scenario.train_seconds,
                                         "median_s": statistics.median(latencies)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
