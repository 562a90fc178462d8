"""A sweep with successive halving against the same trials run to the end (a benchmark: it prints figures, never
fails).

    python bench/experiments/sweep.py [--trials 6] [--steps 120] [--min-steps 15] [--eta 3] [--concurrency 2]
                                      [--step-pause 0.04] [--json out.json]

One local stack (broker, Redis, the services, 2 node agents; free ports, a temporary directory). Two experiments of
``examples/gpt-sdk`` (one CPU rank per trial, gloo) over the same random learning rates (the same seed draws the
same points), one after the other:

    halving    earlyStopping successiveHalving (minSteps, η): a trial pauses at each rung until every trial in the
               race reached it; the best 1/η go on, the others stop with a checkpoint
    to the end no early stopping: every trial runs maxSteps (the strongest simple baseline: the same trials, the same
               concurrency, nothing stopped)

Measured from the experiments' records: device-hours (the trials' attempts, a running one to its end), wall time
(create → over), trials stopped, and whether both picked the same best trial. The ratio that matters: halving's
device-hours over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.cli import trainyard  # noqa: E402 - after the sys.path set-up
from tests.support.stack import local_stack  # noqa: E402
from trainyard_cli.stack import LocalStack  # noqa: E402


def sweep_body(args: argparse.Namespace, name: str, halving: bool) -> dict[str, Any]:
    base = yaml.safe_load((REPO / "examples/gpt-sdk/spec.yaml").read_text())
    base["resources"], base["parallelism"] = {"gpuType": "cpu", "gpuCount": 1}, {"data": 1}
    base["training"] |= {"maxSteps": args.steps, "microBatchSize": 8, "globalBatchSize": 8}
    base["checkpointPolicy"] = {"everySteps": 40, "keepLast": 2}
    base["code"]["env"] = {"EXAMPLE_STEP_PAUSE_SECONDS": str(args.step_pause)}
    body: dict[str, Any] = {
        "name": name, "base": base, "space": {"training.learningRate": {"low": 1e-4, "high": 3e-2, "log": True}},
        "search": {"algorithm": "random", "seed": 7}, "budget": {"maxTrials": args.trials},
        "maxConcurrentTrials": args.concurrency}
    if halving:
        body["earlyStopping"] = {"minSteps": args.min_steps, "reductionFactor": args.eta}
    return body


def run_experiment(stack: LocalStack, client: httpx.Client, body: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path = tmp / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    started = time.monotonic()
    made = trainyard(stack, "experiments", "create", str(path), "--code", "examples/gpt-sdk", "--json")
    if made.returncode != 0:
        raise SystemExit(f"experiments create failed: {made.stderr}")
    experiment_id = json.loads(made.stdout)["experimentId"]
    while True:
        e = client.get(f"/v1/experiments/{experiment_id}").json()
        if e["state"] != "running":
            break
        time.sleep(1)
    return {"experiment": e, "wall_s": time.monotonic() - started}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    e = run["experiment"]
    return {"state": e["state"], "device_hours": e["deviceHours"], "wall_s": round(run["wall_s"], 1),
            "stopped": sum(1 for t in e["trials"] if t["state"] == "stopped"),
            "steps": sum(t["lastStep"] for t in e["trials"]),
            "best_trial": (e.get("best") or {}).get("trial"), "best_value": (e.get("best") or {}).get("value")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--min-steps", type=int, default=15)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--step-pause", type=float, default=0.04)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ty-bench-sweep-") as tmp, \
            local_stack(Path(tmp) / ".trainyard") as stack:
        token = stack.token_file.read_text().strip()
        with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
            halving = summary(run_experiment(stack, c, sweep_body(args, "halving", True), Path(tmp)))
            print("halving:", halving, flush=True)
            full = summary(run_experiment(stack, c, sweep_body(args, "to-the-end", False), Path(tmp)))
            print("to the end:", full, flush=True)
    ratio = halving["device_hours"] / full["device_hours"] if full["device_hours"] else float("nan")
    print(f"\n{'':12} {'device-h':>9} {'wall s':>7} {'steps':>6} {'stopped':>8} {'best':>5} {'value':>7}")
    for name, s in (("halving", halving), ("to the end", full)):
        print(f"{name:12} {s['device_hours']:9.4f} {s['wall_s']:7.1f} {s['steps']:6d} {s['stopped']:8d} "
              f"{s['best_trial']!s:>5} {s['best_value'] or float('nan'):7.4f}")
    print(f"device-hours ratio halving / to the end: {ratio:.2f}; same best trial: "
          f"{halving['best_trial'] == full['best_trial']}")
    if args.json:
        args.json.write_text(json.dumps({"halving": halving, "to_the_end": full, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
