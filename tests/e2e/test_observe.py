"""`make observe` on real components: the local stack with TRAINYARD_PROMETHEUS=1 runs Prometheus over every
service and node agent (file-based targets, the repository's rules); a short gpt-tiny job's step time and goodput
are in Prometheus, labelled with the job, and `down` stops Prometheus with the rest."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from trainyard_cli import infra
from trainyard_cli.devstack import prepare_and_publish
from trainyard_cli.stack import LocalStack, StackSettings

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="prometheus missing: `make deps` installs Debian's prometheus"),
]
NODES = 2
COMPONENTS = ({"api", "telemetry", "scheduler", "checkpoint-coordinator", "registry"}
              | {f"node-agent-{i}" for i in range(NODES)})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings = StackSettings(
        state_dir=tmp_path_factory.mktemp("observe") / ".trainyard",
        kafka_port=infra.free_port(), redis_port=infra.free_port(), api_port=infra.free_port(),
        nodes=NODES, devices_per_node=4, ready_timeout_s=120,
        prometheus=True, prometheus_scrape_interval_s=1.0,
    )
    stack = LocalStack(settings, extra_env={"TRAINYARD_GOODPUT_REFRESH_S": "1"})
    try:
        stack.up()
        prepare_and_publish(stack)
        yield stack
    finally:
        url = stack.prometheus_url
        stopped = stack.down()
        assert "prometheus" in stopped and stack.prometheus_url is None
        assert url is None or not infra.port_in_use(int(url.rsplit(":", 1)[1]))


def query(stack: LocalStack, promql: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{stack.prometheus_url}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def poll(what: str, answer: Callable[[], list[dict[str, Any]]], ok: Callable[[list[dict[str, Any]]], bool],
         timeout_s: float = 45.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    result = answer()
    while not ok(result) and time.monotonic() < deadline:
        time.sleep(0.5)
        result = answer()
    assert ok(result), f"{what} after {timeout_s:.0f}s: {json.dumps(result)[:2000]}"
    return result


def test_prometheus_scrapes_every_service_and_node_agent(stack: LocalStack) -> None:
    assert stack.prometheus_url and stack.prometheus_url.startswith("http://127.0.0.1:")
    up = poll("every target up", lambda: query(stack, 'up{job="trainyard"}'),
              lambda r: {s["metric"]["component"] for s in r if s["value"][1] == "1"} == COMPONENTS)
    assert len(up) == len(COMPONENTS)
    assert {s["metric"]["service"] for s in up} == {"api", "telemetry", "scheduler", "checkpoint-coordinator",
                                                    "registry", "node-agent"}
    nodes = poll("the leader's node gauge", lambda: query(stack, 'cluster:trainyard_nodes:by_state{state="placeable"}'),
                 lambda r: bool(r) and float(r[0]["value"][1]) == NODES)
    assert nodes
    rules = httpx.get(f"{stack.prometheus_url}/api/v1/rules", timeout=5).json()["data"]["groups"]
    assert {g["name"] for g in rules} == {"trainyard.recording", "trainyard.alerts"}
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules


def test_a_jobs_step_time_and_goodput_are_in_prometheus(stack: LocalStack) -> None:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["name"] = "observed"
    spec["training"]["maxSteps"] = 10
    spec["checkpointPolicy"] = {"everySteps": 5, "keepLast": 2}
    token = stack.token_file.read_text().strip()
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as api:
        job_id = api.post("/v1/training-jobs", json=spec).raise_for_status().json()["jobId"]
        deadline = time.monotonic() + 180
        job = api.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        while job["state"] not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.5)
            job = api.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
    assert job["state"] == "succeeded", json.dumps(job)[:3000]

    def positive(result: list[dict[str, Any]]) -> bool:
        return len(result) == 1 and float(result[0]["value"][1]) > 0

    step = poll("the job's step time",
                lambda: query(stack, f'trainyard_job_step_seconds{{job_id="{job_id}"}}'), positive)
    assert step[0]["metric"]["tenant"] == "dev" and step[0]["metric"]["service"] == "telemetry"  # it computes them
    assert float(step[0]["value"][1]) < 60
    goodput = poll("the job's goodput", lambda: query(stack, f'trainyard_job_goodput_ratio{{job_id="{job_id}"}}'),
                   positive)
    assert 0 < float(goodput[0]["value"][1]) <= 1
    # what the API's job view says (the job finished: its ledger is final, the gauge catches up within a refresh)
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as api:
        final = api.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()["goodput"]["goodput"]
    poll("the job's goodput as the API reports it",
         lambda: query(stack, f'trainyard_job_goodput_ratio{{job_id="{job_id}"}}'),
         lambda r: len(r) == 1 and abs(float(r[0]["value"][1]) - final) < 1e-9)
    poll("the tenant's goodput recording rule", lambda: query(stack, 'tenant:trainyard_goodput:ratio{tenant="dev"}'),
         positive)
    poll("the step-time histogram", lambda: query(stack, 'trainyard_step_seconds_count{tenant="dev"}'),
         lambda r: len(r) == 1 and float(r[0]["value"][1]) >= spec["training"]["maxSteps"])
