"""Experiments on the local stack: a sweep of real trial jobs (the gpt-sdk example's code, real torch ranks),
successive halving stopping the losers, and every service killed -9 and started again mid-sweep.

* ``trainyard experiments create SWEEP --code examples/gpt-sdk``: 6 random learning rates, η = 3, 2 at a time;
* mid-sweep (a trial waiting at its rung), the API, scheduler, coordinator, registry, telemetry and both node
  agents are killed -9 together and started again: the search carries on from its record;
* at least the worst half stop early, each with the reason and a READY checkpoint; the best one runs to the end;
  every rung kept trials no worse than those it stopped; each trial is one job (no double submission) that names
  the experiment, the trial and its point; ``trainyard experiments show`` draws the table;
* the tenant's MLflow server (a real ``mlflow server`` from PyPI) shows every trial's run with its point as a
  parameter and its loss curve up to the step the trial stopped at.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.chaos.harness import SERVICES, ChaosRig
from tests.support.cli import trainyard
from tests.support.mlflowserver import mlflow_server

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]
MAX_STEPS = 120
TRIALS = 6


def sweep_file(tmp: Path) -> Path:
    base = yaml.safe_load((REPO / "examples/gpt-sdk/spec.yaml").read_text())
    base["resources"] = {"gpuType": "cpu", "gpuCount": 1}
    base["parallelism"] = {"data": 1}
    base["training"] |= {"maxSteps": MAX_STEPS, "microBatchSize": 8, "globalBatchSize": 8}
    base["checkpointPolicy"] = {"everySteps": 40, "keepLast": 2}
    # a step of ~40 ms or more: a trial is still running when the driver sees it pass its rung
    base["code"]["env"] = {"EXAMPLE_STEP_PAUSE_SECONDS": "0.04"}
    sweep = {"name": "lr-sweep", "base": base,
             "space": {"training.learningRate": {"low": 1e-4, "high": 3e-2, "log": True}},
             "search": {"algorithm": "random", "seed": 7}, "metric": {"name": "loss", "goal": "minimize"},
             "earlyStopping": {"kind": "successiveHalving", "minSteps": 15, "reductionFactor": 3},
             "budget": {"maxTrials": TRIALS}, "maxConcurrentTrials": 2}
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory, mlflow_url: str) -> Iterator[ChaosRig]:
    with ChaosRig.running(tmp_path_factory.mktemp("experiments") / ".trainyard", seed=36,
                          extra_env={"TRAINYARD_TRACKING_REFRESH_S": "2"}) as rig:
        admin = rig.stack.admin_token_file.read_text().strip()
        answer = httpx.put(f"{rig.stack.s.api_url}/v1/admin/tenants/dev/tracking", json={"mlflowUri": mlflow_url},
                           headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        assert answer.status_code == 200, answer.text
        yield rig


def mlflow(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{url}/api/2.0/mlflow/{path}", json=body, timeout=30)
    answer.raise_for_status()
    return dict(answer.json())


def mlflow_runs(url: str) -> list[dict[str, Any]]:
    found = httpx.get(f"{url}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": "dev/lr-sweep"},
                      timeout=30)
    if found.status_code != 200:
        return []
    experiment_id = found.json()["experiment"]["experiment_id"]
    return list(mlflow(url, "runs/search", {"experiment_ids": [experiment_id], "max_results": 100}).get("runs", []))


def run_tag(run: dict[str, Any], key: str) -> str | None:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}.get(key)


def loss_steps(url: str, run_id: str) -> list[int]:
    answer = httpx.get(f"{url}/api/2.0/mlflow/metrics/get-history",
                       params={"run_id": run_id, "metric_key": "train/loss", "max_results": 25000}, timeout=30)
    answer.raise_for_status()
    return sorted(int(m["step"]) for m in answer.json().get("metrics", []))


def experiment(client: httpx.Client, experiment_id: str) -> dict[str, Any]:
    for _ in range(60):  # the API may be starting again
        try:
            answer = client.get(f"/v1/experiments/{experiment_id}")
            answer.raise_for_status()
            return dict(answer.json())
        except (httpx.TransportError, httpx.HTTPStatusError):
            time.sleep(1)
    raise AssertionError("the API did not answer for a minute")


def wait_experiment(client: httpx.Client, experiment_id: str, what: str, probe: Any,
                    timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        e = experiment(client, experiment_id)
        if probe(e):
            return e
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s; the experiment: {json.dumps(e)[:3000]}")


def test_a_sweep_stops_the_worst_half_early_and_survives_a_restart_of_every_service(
        rig: ChaosRig, mlflow_url: str, tmp_path: Path) -> None:
    made = trainyard(rig.stack, "experiments", "create", str(sweep_file(tmp_path)), "--code", "examples/gpt-sdk",
                     "--json")
    assert made.returncode == 0, made.stderr
    experiment_id = json.loads(made.stdout)["experimentId"]
    with rig.client() as client:
        # 1. mid-sweep: a trial waits at its rung; every service and node agent is killed -9 and started again
        wait_experiment(client, experiment_id, "a trial waiting at its rung",
                        lambda e: any(t["state"] == "waiting" for t in e["trials"]), 600)
        for name in SERVICES:
            rig.kill_component(name, "service")
        for agent in sorted(c.name for c in rig.stack.components() if c.name.startswith("node-agent-")):
            rig.kill_component(agent, "agent")
        rig.restart_dead()
        # 2. the search carries on to its end
        e = wait_experiment(client, experiment_id, "the experiment over", lambda e: e["state"] != "running", 1200)
        assert e["state"] == "completed", e
        trials = e["trials"]
        assert len(trials) == TRIALS
        # 3. at least the worst half stopped early, each with its reason and a checkpoint
        stopped = [t for t in trials if t["state"] == "stopped"]
        assert len(stopped) >= TRIALS // 2, trials
        for t in stopped:
            assert "early stopping" in t["reason"], t
            job = client.get(f"/v1/training-jobs/{t['jobId']}").json()
            assert job["state"] == "cancelled" and "early stopping" in (job["reason"] or ""), job
            ready = [c["globalStep"] for c in job["checkpoints"] if c["state"] == "READY"]
            assert ready and max(ready) < MAX_STEPS, job["checkpoints"]
        # 4. every rung kept trials no worse than those it stopped; the best ran to the end
        by_number = {t["number"]: t for t in trials}
        assert e["rungDecisions"], e
        for d in e["rungDecisions"]:
            kept = [by_number[n]["rungs"][d["rung"]] for n in d["promoted"]]
            dropped = [by_number[n]["rungs"][d["rung"]] for n in d["stopped"]]
            assert max(kept) <= min(dropped, default=float("inf")), d
        best = e["best"]
        assert best is not None and by_number[best["trial"]]["state"] == "completed"
        completed = [t for t in trials if t["state"] == "completed"]
        assert best["value"] == min(t["value"] for t in completed)
        best_job = client.get(f"/v1/training-jobs/{best['jobId']}").json()
        assert best_job["state"] == "succeeded"
        assert best["checkpoint"] and best["globalStep"] == MAX_STEPS
        # 5. one job per trial, each naming its experiment, trial and point
        jobs = client.get("/v1/training-jobs", params={"limit": 200}).json()["jobs"]
        ours = [j for j in jobs if (j.get("name") or "").startswith("lr-sweep-t")]
        assert sorted(j["jobId"] for j in ours) == sorted(t["jobId"] for t in trials)
        for t in trials:
            origin = client.get(f"/v1/training-jobs/{t['jobId']}").json()["experiment"]
            assert origin == {"experimentId": experiment_id, "experimentName": "lr-sweep", "trial": t["number"],
                              "params": t["params"]}
        assert e["deviceHours"] > 0
    # 6. MLflow shows every trial's run: its point as a parameter, its loss curve up to where it stopped
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = {run_tag(r, "trainyard.jobId"): r for r in mlflow_runs(mlflow_url)}
        if set(runs) >= {t["jobId"] for t in trials} and all(
                r["info"]["status"] != "RUNNING" for r in runs.values()) and all(
                max(loss_steps(mlflow_url, runs[t["jobId"]]["info"]["run_id"]), default=0) >= t["lastStep"]
                for t in trials):
            break
        time.sleep(2)
    else:
        statuses = {j: r["info"]["status"] for j, r in runs.items()}
        raise AssertionError(f"MLflow has not every trial's run and curve: {statuses}, {trials}")
    for t in trials:
        run = runs[t["jobId"]]
        params = {p["key"]: p["value"] for p in run["data"].get("params", [])}
        assert float(params["training.learningRate"]) == pytest.approx(t["params"]["training.learningRate"])
        steps = loss_steps(mlflow_url, run["info"]["run_id"])
        assert steps[0] <= 2 and steps[-1] >= t["lastStep"] and len(set(steps)) >= t["lastStep"] - 1, steps[:5]
    shown = trainyard(rig.stack, "experiments", "show", experiment_id)
    assert shown.returncode == 0, shown.stderr
    assert "best: trial" in shown.stdout and "early stopping" in shown.stdout
