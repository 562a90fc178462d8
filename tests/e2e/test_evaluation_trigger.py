"""Evaluation on READY, on the whole local stack: a 2-rank job checkpoints every 10 steps, a checkpointReady
trigger on it submits one evaluation job per READY checkpoint (the built-in evaluator on real torch ranks), the
registry attaches each result to its checkpoint, and the API shows them; the checkpoints announced again
(fresh ArtifactRegistered events) start nothing more. The scenario and its figure are bench/experiments/
eval_latency.py's."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.experiments.eval_latency import run_scenario, trigger_jobs, wait
from tests.support.stack import local_stack
from trainyard_cli.stack import LocalStack
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.long,
    pytest.mark.skipif(os.environ.get("TRAINYARD_LONG_TESTS") != "1",
                       reason="a training job and an evaluation job per checkpoint (~2 min): TRAINYARD_LONG_TESTS=1"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(tmp_path_factory.mktemp("stack") / ".trainyard", nodes=1) as stack:
        yield stack


def client_for(stack: LocalStack) -> httpx.Client:
    token = stack.token_file.read_text().strip()
    return httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def announce_again(stack: LocalStack, artifacts: list[dict]) -> None:
    """Each checkpoint's ArtifactRegistered published again, as a fresh event (past the consumer's de-duplicator)."""
    async def go() -> None:
        async with Bus(stack.kafka_bootstrap, service_name="e2e", topic_namespace=stack.s.topic_namespace) as bus:
            for a in artifacts:
                await bus.publish(ev.ArtifactRegistered(
                    artifact_id=a["artifactId"], kind="checkpoint", tenant=a["tenant"], uri=a["uri"], hash=a["hash"],
                    job_id=a["jobId"], global_step=a["globalStep"]))

    asyncio.run(go())


def test_one_evaluation_per_ready_checkpoint_exactly_once(stack: LocalStack) -> None:
    with client_for(stack) as client:
        seen = run_scenario(client, steps=40, every=10, batches=4, timeout_s=420)

        # one evaluation job per READY checkpoint, each a succeeded job of its own with the checkpoint as lineage
        assert seen.ready_steps == [10, 20, 30, 40]
        assert len(seen.evaluation_jobs) == 4 and len(set(seen.evaluation_jobs.values())) == 4
        for artifact, eval_id in seen.evaluation_jobs.items():
            job = client.get(f"/v1/training-jobs/{eval_id}").raise_for_status().json()
            step = int(artifact.rsplit("step-", 1)[1].split("-")[0])
            assert job["spec"]["initFrom"] == {"jobId": seen.job_id, "globalStep": step}
            assert job["spec"]["evaluation"] == {"batches": 4}
            assert job["triggeredBy"]["checkpoint"] == artifact and job["triggeredBy"]["triggerId"] == seen.trigger_id
            assert job["state"] in {"running", "succeeded"}

        # the results: one per checkpoint, attached to that checkpoint; a trained model's held-out loss falls
        by_step = {e["globalStep"]: e for e in seen.evaluations}
        assert sorted(by_step) == [10, 20, 30, 40] and len(seen.evaluations) == 4
        for step, e in by_step.items():
            assert e["checkpointId"] in seen.evaluation_jobs and f"step-{step:09d}" in e["checkpointId"]
            assert e["evaluationJobId"] == seen.evaluation_jobs[e["checkpointId"]]
            assert math.isclose(e["metrics"]["perplexity"], math.exp(e["metrics"]["loss"]), rel_tol=1e-6)
        assert by_step[40]["metrics"]["loss"] < by_step[10]["metrics"]["loss"]

        # announced again: nothing more starts (a second trigger, created now, fires once for step 40 only:
        # handled after the re-announcements on the job's partition, it says they were handled)
        late = client.post("/v1/triggers", json={
            "name": "late", "on": "checkpointReady", "job": seen.job_id, "everySteps": 40,
            "template": client.get(f"/v1/triggers/{seen.trigger_id}").json()["template"]}).raise_for_status().json()
        arts = client.get("/v1/registry/artifacts", params={"jobId": seen.job_id}).raise_for_status().json()
        announce_again(stack, [a for a in arts["artifacts"] if a["type"] == "checkpoint"])
        wait("the late trigger's evaluation", lambda: trigger_jobs(client, late["triggerId"]), 60)
        assert trigger_jobs(client, seen.trigger_id) == seen.evaluation_jobs
        assert len(trigger_jobs(client, late["triggerId"])) == 1
        time.sleep(2)
        evaluations = client.get(f"/v1/training-jobs/{seen.job_id}/evaluations").json()["evaluations"]
        assert {e["evaluationJobId"] for e in evaluations} >= set(seen.evaluation_jobs.values())
        assert len([e for e in evaluations if e["evaluationJobId"] in seen.evaluation_jobs.values()]) == 4

        # every evaluation job ends succeeded, having trained nothing (no checkpoint of its own)
        for eval_id in seen.evaluation_jobs.values():
            job = wait("the evaluation job's end", lambda i=eval_id: _ended(client, i), 120)
            assert job["state"] == "succeeded", job
            assert client.get(f"/v1/training-jobs/{eval_id}/checkpoints").json()["checkpoints"] == []


def _ended(client: httpx.Client, job_id: str) -> dict | None:
    job = client.get(f"/v1/training-jobs/{job_id}").json()
    return job if job["state"] in {"succeeded", "failed", "cancelled"} else None


