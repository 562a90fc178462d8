"""Evaluation on READY against the real API process over the real broker and Redis (no torch ranks: the cheap
version of tests/e2e/test_evaluation_trigger.py): a checkpointReady trigger submits exactly one evaluation job per
matching READY checkpoint whatever is delivered or announced again, never for another tenant's checkpoint; the
registry's shell attaches a reported result once, to the checkpoint the evaluation job's spec names; the API shows
it to the trained job's tenant only."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from trainyard_api import ApiServer
from trainyard_api.schemas import EXAMPLE_SPEC, EXAMPLE_TEMPLATE
from trainyard_cli.main import app
from trainyard_contract.errors import NotFoundError
from trainyard_contract.events import ArtifactRegistered, EvaluationReported
from trainyard_contract.records import ArtifactRecord, CheckpointRecord, EvaluationResult, JobRecord, Lineage
from trainyard_contract.spec import TrainingSpec
from trainyard_registry.evaluations import EvaluationRecorder
from trainyard_runtime.store import Keys, StateStore
from tests.integration.test_api_triggers import eventually
from tests.support.api import TOKEN_A, TOKEN_B, client_for, running_api

TRAINED = "job-7a1ed7a1ed7a"
STEPS = (10, 20, 30, 40)


@pytest.fixture
async def server(env: dict) -> AsyncIterator[ApiServer]:
    async with running_api(env, topic_partitions=1) as api:  # one partition: handled in the order published
        yield api


async def trained_job(store: StateStore, tenant: str = "tenant-a", job_id: str = TRAINED) -> None:
    """A job of ``tenant`` with READY checkpoints and their registry artifacts at :data:`STEPS`."""
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    await store.create_job(JobRecord(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash(),
                                     state="running"))
    for step in STEPS:
        await store.put_checkpoint(CheckpointRecord(
            job_id=job_id, tenant=tenant, attempt=1, epoch=1, global_step=step, world_size=2, state="READY",
            manifest_uri=f"file:///art/{job_id}/step-{step}/manifest.json"))
        await store.put_artifact(ArtifactRecord(
            artifact_id=artifact_id(step, job_id), job_id=job_id, tenant=tenant, type="checkpoint",
            uri=f"file:///art/{job_id}/step-{step}/manifest.json", hash="sha256:" + "0" * 64, producer_attempt=1,
            global_step=step, lineage=Lineage(spec_hash=spec.spec_hash(), code_revision="local",
                                              dataset="tinycorpus@v1", model_config="gpt-tiny@v1")))


def artifact_id(step: int, job_id: str = TRAINED) -> str:
    return f"{job_id}/checkpoint/step-{step:09d}-a1"


def ready(step: int, *, tenant: str = "tenant-a", event_id: uuid.UUID | None = None) -> ArtifactRegistered:
    """What the registry announces for a READY checkpoint."""
    return ArtifactRegistered(**({"event_id": event_id} if event_id else {}), artifact_id=artifact_id(step),
                              kind="checkpoint", tenant=tenant, uri="file:///m.json", hash="sha256:" + "0" * 64,
                              job_id=TRAINED, global_step=step)


def trigger_body(**fields: Any) -> dict[str, Any]:
    return {"name": "evals", "on": "checkpointReady", "job": TRAINED, "everySteps": 20,
            "template": {**EXAMPLE_TEMPLATE, "evaluation": {"batches": 2}}, **fields}


async def test_one_evaluation_per_matching_checkpoint_attached_once_and_shown_to_its_tenant(server: ApiServer) -> None:
    store, bus = server.runtime.store, server.runtime.bus
    await trained_job(store)
    async with client_for(server.url, TOKEN_A) as a, client_for(server.url, TOKEN_B) as b:
        # -- the routes: a checkpoint trigger's body checked for what `on` asks
        resp = await a.post("/v1/triggers", json=trigger_body(template=EXAMPLE_TEMPLATE, dataset="tiny*"))
        assert resp.status_code == 422, resp.text
        assert {d["field"] for d in resp.json()["detail"]} == {"dataset", "template.evaluation"}
        resp = await a.post("/v1/triggers", json=trigger_body())
        assert resp.status_code == 201, resp.text
        created = resp.json()
        assert (created["on"], created["job"], created["everySteps"], created["dataset"]) == (
            "checkpointReady", TRAINED, 20, "")
        trigger_id = created["triggerId"]
        # tenant-b watches a job of that id too: tenant-a's checkpoints never set it off
        assert (await b.post("/v1/triggers", json=trigger_body())).status_code == 201

        async def jobs_of(client: Any, tid: str) -> dict[str, str]:
            resp = await client.get(f"/v1/triggers/{tid}")
            return {j["checkpoint"]: j["jobId"] for j in resp.json()["jobs"]}

        # -- the consumer: step 20 starts its evaluation
        first = ready(20)
        await bus.publish(first)
        started = await eventually("the evaluation of step 20", lambda: jobs_of(a, trigger_id))
        eval_id = started[artifact_id(20)]
        job = (await a.get(f"/v1/training-jobs/{eval_id}")).json()
        assert job["spec"]["initFrom"] == {"jobId": TRAINED, "globalStep": 20}
        assert job["spec"]["evaluation"] == {"batches": 2} and job["spec"]["dataset"] == "tinycorpus@v1"
        assert job["triggeredBy"] == {"triggerId": trigger_id, "triggerName": "evals", "dataset": None,
                                      "checkpoint": artifact_id(20), "eventId": str(first.event_id)}
        assert job["submittedBy"] == "trigger:evals"

        # -- delivered again, announced again with the trigger's record of the job lost (the Idempotency-Key
        # alone stands), steps everySteps skips, another tenant's checkpoint; then step 40, handled after them all
        await store.redis.hdel(Keys.trigger_jobs(trigger_id), artifact_id(20))
        for event in (first, ready(20, event_id=uuid.uuid4()), ready(10), ready(30), ready(40, tenant="tenant-b"),
                      ready(40)):
            await bus.publish(event)
        await eventually("the evaluation of step 40", lambda: _has(jobs_of(a, trigger_id), artifact_id(40)))
        done = await jobs_of(a, trigger_id)
        assert set(done) == {artifact_id(20), artifact_id(40)} and done[artifact_id(20)] == eval_id
        listed = {j["jobId"] for j in (await a.get("/v1/training-jobs")).json()["jobs"]}
        assert listed == {TRAINED, *done.values()}  # the trained job and its two evaluations, nothing else
        assert (await b.get("/v1/training-jobs")).json()["jobs"] == []

        # -- the registry attaches a result once, to the checkpoint the evaluation's spec names
        def missing(event_id: str, what: str) -> Exception:
            return NotFoundError(what, retryable=True)

        recorder = EvaluationRecorder(store.redis, missing)
        report = EvaluationReported(job_id=eval_id, tenant="tenant-a", attempt=1, rank=0,
                                    metrics={"loss": 2.5, "perplexity": 12.18})
        await recorder.on_evaluation_reported(report)
        await recorder.on_evaluation_reported(report.model_copy(update={"event_id": uuid.uuid4(),
                                                                        "metrics": {"loss": 9.0}}))
        await recorder.on_evaluation_reported(report.model_copy(update={"tenant": "tenant-b"}))  # not the job's
        shown = (await a.get(f"/v1/training-jobs/{TRAINED}/evaluations")).json()
        assert [(e["evaluationJobId"], e["checkpointId"], e["globalStep"], e["metrics"])
                for e in shown["evaluations"]] == [(eval_id, artifact_id(20), 20, {"loss": 2.5, "perplexity": 12.18})]
        assert (await b.get(f"/v1/training-jobs/{TRAINED}/evaluations")).status_code == 404
        # and the checkpoint's registry view lists it
        view = (await a.get(f"/v1/registry/artifacts/{artifact_id(20)}")).json()
        assert [e["evaluationJobId"] for e in view["evaluations"]] == [eval_id]


async def _has(jobs: Any, ref: str) -> bool:
    return ref in await jobs


async def test_an_evaluation_is_validated_as_a_submission_names_one_checkpoint(server: ApiServer) -> None:
    await trained_job(server.runtime.store)
    await trained_job(server.runtime.store, tenant="tenant-b", job_id="job-0b0b0b0b0b0b")
    async with client_for(server.url, TOKEN_A) as a:
        async def problems(**spec: Any) -> set[str]:
            resp = await a.post("/v1/training-jobs", json={**EXAMPLE_SPEC, "evaluation": {}, **spec})
            assert resp.status_code == 422, resp.text
            return {d["field"] for d in resp.json()["detail"]}

        assert await problems() == {"initFrom.jobId"}
        assert await problems(initFrom={"jobId": TRAINED}) == {"initFrom.globalStep"}
        assert await problems(initFrom={"jobId": TRAINED, "globalStep": 25}) == {"initFrom.globalStep"}
        # another tenant's checkpoint is no checkpoint of yours
        assert await problems(initFrom={"jobId": "job-0b0b0b0b0b0b", "globalStep": 20}) == {"initFrom.jobId"}
        resp = await a.post("/v1/training-jobs", json={**EXAMPLE_SPEC, "evaluation": {"batches": 3},
                                                       "initFrom": {"jobId": TRAINED, "globalStep": 20}})
        assert resp.status_code == 202, resp.text


async def test_the_cli_creates_a_checkpoint_trigger_and_shows_a_jobs_evaluations(server: ApiServer,
                                                                                   tmp_path: Path) -> None:
    store = server.runtime.store
    await trained_job(store)
    template = tmp_path / "eval.yaml"
    template.write_text(yaml.safe_dump({**EXAMPLE_TEMPLATE, "evaluation": {"batches": 2}}))

    async def cli(*args: str) -> tuple[int, str]:
        result = await asyncio.to_thread(CliRunner().invoke, app, ["--api-url", server.url, "--token", TOKEN_A, *args])
        return result.exit_code, result.output

    code, out = await cli("triggers", "create", "--job", TRAINED, "--every-steps", "20", "--template", str(template))
    assert code == 0, out
    assert f"READY checkpoints of {TRAINED} every 20 steps submit its evaluation" in " ".join(out.split())
    code, out = await cli("triggers", "list", "--json")
    assert code == 0, out
    [listed] = json.loads(out)
    assert (listed["on"], listed["job"], listed["everySteps"]) == ("checkpointReady", TRAINED, 20)
    code, out = await cli("triggers", "show", listed["triggerId"])
    assert code == 0 and f"READY checkpoints of job {TRAINED}, every 20 steps" in " ".join(out.split()), out

    eval_id = "job-e0e0e0e0e0e0"
    result = EvaluationResult(evaluation_job_id=eval_id, checkpoint_id=artifact_id(20), global_step=20,
                              metrics={"loss": 2.5, "perplexity": 12.18}, finished_at=datetime.now(UTC))
    await store.redis.hset(Keys.evaluations(TRAINED), eval_id, result.dumps())
    code, out = await cli("jobs", "evaluations", TRAINED)
    assert code == 0 and eval_id in out and "loss 2.5" in out and "perplexity 12.18" in out, out
    code, out = await cli("jobs", "evaluations", TRAINED, "--json")
    assert code == 0 and json.loads(out)[0]["metrics"] == {"loss": 2.5, "perplexity": 12.18}
