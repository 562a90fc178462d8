"""Experiments against real Redis: the routes (the base and a trial checked like a submission, problems named
where the user fixes them, tenant-scoped, roles) and the driver's shell (observe the jobs and their metric
history as telemetry writes it, decide, write the record, act through the jobs' control path)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_api.experiment_driver import ExperimentDriver
from trainyard_api.schemas import EXAMPLE_TEMPLATE
from trainyard_contract.events import StepMetrics
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.replication import undecoded
from trainyard_runtime.store import Keys, StateStore
from trainyard_telemetry.metrics_history import MetricHistory
from tests.support.api import TOKEN_A, TOKEN_B, client_for, seed

pytestmark = pytest.mark.integration
TOKEN_VIEWER = "token-tenant-a-viewer"


def sweep(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "lr", "base": {**EXAMPLE_TEMPLATE, "dataset": "tinycorpus@v1"},
        "space": {"training.learningRate": {"low": 1e-4, "high": 1e-2, "log": True}},
        "earlyStopping": {"minSteps": 10, "reductionFactor": 2}, "budget": {"maxTrials": 4},
        "maxConcurrentTrials": 2}
    body.update(over)
    return body


@pytest.fixture
async def context(env: dict, redis) -> AsyncIterator[ApiContext]:
    store = StateStore(redis)
    await seed(store)
    await store.add_token(TOKEN_VIEWER, "tenant-a", "vera", role="viewer")
    yield ApiContext(ApiSettings(**env), store, Outbox(redis, "api"))


@pytest.fixture
def app(context: ApiContext) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=create_app(context))


async def test_an_experiment_is_created_listed_read_and_stopped_by_its_tenant_only(app) -> None:
    async with client_for("http://api", TOKEN_A, transport=app) as a, \
            client_for("http://api", TOKEN_B, transport=app) as b, \
            client_for("http://api", TOKEN_VIEWER, transport=app) as viewer:
        resp = await a.post("/v1/experiments", json=sweep())
        assert resp.status_code == 201, resp.text
        made = resp.json()
        experiment_id = made["experimentId"]
        assert (made["state"], made["rungs"], made["trials"]) == ("running", [10, 20], [])
        assert made["spec"]["base"]["dataset"] == "tinycorpus@v1"
        assert (await a.post("/v1/experiments", json=sweep())).status_code == 409  # one name per tenant
        assert [e["experimentId"] for e in (await a.get("/v1/experiments")).json()["experiments"]] == [experiment_id]
        # another tenant's experiment is as invisible as a missing one
        assert (await b.get("/v1/experiments")).json()["experiments"] == []
        assert (await b.get(f"/v1/experiments/{experiment_id}")).status_code == 404
        assert (await b.post(f"/v1/experiments/{experiment_id}/stop")).status_code == 404
        # a viewer reads, but neither creates nor stops
        assert (await viewer.get(f"/v1/experiments/{experiment_id}")).status_code == 200
        assert (await viewer.post("/v1/experiments", json=sweep(name="other"))).status_code == 403
        assert (await viewer.post(f"/v1/experiments/{experiment_id}/stop")).status_code == 403
        resp = await a.post(f"/v1/experiments/{experiment_id}/stop")
        assert resp.status_code == 202 and resp.json()["state"] == "running"


@pytest.mark.parametrize(("body", "field"), [
    (sweep(space={"dataset": {"type": "categorical", "values": ["x@v1"]}}), "space"),
    (sweep(space={"resources.gpuCount": {"type": "int", "low": 1, "high": 4}}), "space"),
    (sweep(base={**EXAMPLE_TEMPLATE, "dataset": "tinycorpus@v1", "modelConfig": "gpt-huge@v9"}), "base.modelConfig"),
    (sweep(base={**EXAMPLE_TEMPLATE}), "base.dataset"),
    (sweep(space={"training.learningRate": {"low": 11, "high": 12}}), "space.training.learningRate"),
    (sweep(space={"training.nonsense": {"low": 1, "high": 2}}), "space.training.nonsense"),
    (sweep(earlyStopping={"minSteps": 500}), "earlyStopping.minSteps"),
    (sweep(search={"algorithm": "grid"}), "search"),
    (sweep(budget={"maxTrials": 10_000}), "budget.maxTrials"),
])
async def test_a_bad_experiment_is_a_422_naming_the_field(app, body: dict[str, Any], field: str) -> None:
    async with client_for("http://api", TOKEN_A, transport=app) as a:
        resp = await a.post("/v1/experiments", json=body)
    assert resp.status_code == 422, resp.text
    fields = [p["field"] for p in resp.json()["detail"]]
    assert any(f == field or f.startswith(field + ".") for f in fields), (field, resp.json())
    assert (await StateStore(context_redis(app)).redis.hlen(Keys.experiments)) == 0


def context_redis(app: httpx.ASGITransport) -> Any:
    return app.app.state.context.store.redis  # type: ignore[attr-defined]


async def _run(store: StateStore, job_id: str, *, state: str = "running") -> JobRecord:
    """What the scheduler would write: the job running in attempt 1 (or another state)."""
    job = await store.get_job(job_id)
    assert job is not None
    changed = job.model_copy(update={"state": state, "attempts": [AttemptRecord(
        attempt=1, allocation_id=f"alloc-{job_id}", epoch=1, world_size=1, state="running")]})
    await store.redis.set(Keys.job(job_id), changed.dumps())
    return changed


async def _losses(history: MetricHistory, job_id: str, steps: range, loss: float) -> None:
    for step in steps:
        await history.on_step_metrics(StepMetrics(job_id=job_id, attempt=1, rank=0, step=step, loss=loss, lr=1e-3,
                                                  consumed_tokens=step * 64, step_seconds=0.1))


async def test_the_driver_submits_trials_pauses_them_at_the_rung_and_stops_the_worse(context: ApiContext) -> None:
    redis = context.store.redis
    async with client_for("http://api", TOKEN_A, transport=httpx.ASGITransport(app=create_app(context))) as a:
        experiment_id = (await a.post("/v1/experiments", json=sweep(
            budget={"maxTrials": 2}, earlyStopping={"minSteps": 10, "reductionFactor": 2}))).json()["experimentId"]
    raw = undecoded(redis)
    driver = ExperimentDriver(redis, raw, lambda: context.jobs, "test-instance")
    history = MetricHistory(redis)
    try:
        await driver.tick()  # 1. both trials submitted, as jobs that name the experiment
        record = await driver.store.get(experiment_id)
        assert record is not None and [t.state for t in record.trials] == ["pending", "pending"]
        jobs = [await context.store.get_job(t.job_id or "") for t in record.trials]
        assert all(j is not None and j.experiment is not None and j.experiment.experiment_id == experiment_id
                   for j in jobs)
        assert [j.experiment.trial for j in jobs if j and j.experiment] == [0, 1]
        await driver.tick()  # submitted again: the same jobs (one per trial)
        assert await redis.zcard(Keys.tenant_jobs("tenant-a")) == 2
        # 2. both run past the first rung (step 10): trial 1's loss is lower
        for trial, loss in ((0, 3.0), (1, 1.0)):
            job_id = record.trials[trial].job_id or ""
            await _run(context.store, job_id)
            await _losses(history, job_id, range(1, 13), loss)
        await driver.tick()
        record = await driver.store.get(experiment_id)
        assert record is not None and record.rung_decisions[0].promoted == [1]
        assert record.trials[0].state == "stopping" and "early stopping" in (record.trials[0].reason or "")
        # the stop went through the jobs' control path: a pause (it checkpoints), recorded for the scheduler
        requests = await redis.hgetall(Keys.control_requests(record.trials[0].job_id or ""))
        assert any("pause" in v for v in requests.values()), requests
        assert not await redis.hgetall(Keys.control_requests(record.trials[1].job_id or ""))
    finally:
        await history.aclose()
        await raw.aclose()


async def test_the_examples_sweep_and_its_evaluation_template_are_accepted(app) -> None:
    """docs/experiments.md's walkthrough: examples/sweep/sweep.yaml, then a checkpoint trigger on the experiment
    with examples/sweep/eval.yaml (what the CLI sends for them)."""
    from pathlib import Path

    import yaml

    examples = Path(__file__).resolve().parents[2] / "examples" / "sweep"
    sweep_body = yaml.safe_load((examples / "sweep.yaml").read_text())
    template = yaml.safe_load((examples / "eval.yaml").read_text())
    async with client_for("http://api", TOKEN_A, transport=app) as a:
        made = await a.post("/v1/experiments", json=sweep_body)
        assert made.status_code == 201, made.text
        assert made.json()["rungs"] == [30, 90]
        trigger = await a.post("/v1/triggers", json={"name": "lr-sweep-evals", "on": "checkpointReady",
                                                     "experiment": made.json()["experimentId"],
                                                     "template": template})
        assert trigger.status_code == 201, trigger.text
