"""Experiments against a tenant who tries to steer them (real Redis, the API's routes and its driver):

* a job submitted by hand under a trial's Idempotency-Key before the driver submits the trial is not taken for
  the trial: the trial fails with the reason, and the search never pauses, resumes or cancels that job;
* another tenant using the same key gets a job of its own: the trial's job id is derived with the tenant;
* the search space cannot reach what a job is or where it runs (code, dataset, initFrom, resources, …).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_api.experiment_driver import ExperimentDriver
from trainyard_api.experiments import trial_key
from trainyard_api.schemas import EXAMPLE_TEMPLATE
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.replication import undecoded
from trainyard_runtime.store import Keys, StateStore
from tests.support.api import TOKEN_A, TOKEN_B, client_for, seed

pytestmark = [pytest.mark.integration, pytest.mark.security]
SPEC = {**EXAMPLE_TEMPLATE, "dataset": "tinycorpus@v1"}


def sweep(**over: Any) -> dict[str, Any]:
    return {"name": "lr", "base": SPEC, "space": {"training.learningRate": {"low": 1e-4, "high": 1e-2}},
            "budget": {"maxTrials": 2}, "maxConcurrentTrials": 1, **over}


@pytest.fixture
async def context(env: dict, redis) -> AsyncIterator[ApiContext]:
    store = StateStore(redis)
    await seed(store)
    yield ApiContext(ApiSettings(**env), store, Outbox(redis, "api"))


async def test_a_job_squatting_a_trials_key_is_never_taken_for_the_trial(context: ApiContext) -> None:
    redis = context.store.redis
    app = httpx.ASGITransport(app=create_app(context))
    async with client_for("http://api", TOKEN_A, transport=app) as a, \
            client_for("http://api", TOKEN_B, transport=app) as b:
        experiment_id = (await a.post("/v1/experiments", json=sweep())).json()["experimentId"]
        # trial 1 is not submitted yet (one at a time): its key is squatted by hand, with another spec
        squat = await a.post("/v1/training-jobs", json={**SPEC, "name": "squatter"},
                             headers={"Idempotency-Key": trial_key(experiment_id, 1)})
        assert squat.status_code in (201, 202), squat.text
        squatter = squat.json()["jobId"]
        # another tenant's use of trial 0's key makes a job of its own, not the trial's
        other = await b.post("/v1/training-jobs", json=SPEC, headers={"Idempotency-Key": trial_key(experiment_id, 0)})
        other_job = other.json()["jobId"]
    raw = undecoded(redis)
    driver = ExperimentDriver(redis, raw, lambda: context.jobs, "test-instance")
    try:
        await driver.tick()
        record = await driver.store.get(experiment_id)
        assert record is not None and record.trials[0].job_id != other_job
        trial0 = await context.store.get_job(record.trials[0].job_id or "")
        assert trial0 is not None and trial0.tenant == "tenant-a" and trial0.experiment is not None
        # trial 0 ends; trial 1's job id is the squatter's: the trial fails, the squatter is left alone
        job = trial0.model_copy(update={"state": "succeeded"})
        await redis.set(Keys.job(job.job_id), job.dumps())
        for _ in range(3):
            await driver.tick()
        record = await driver.store.get(experiment_id)
        assert record is not None
        assert record.trials[1].job_id == squatter
        assert record.trials[1].state == "failed" and "not this trial's" in (record.trials[1].reason or "")
        assert not await redis.hgetall(Keys.control_requests(squatter))
        assert not await redis.hgetall(Keys.control_requests(other_job))
        squatted = await context.store.get_job(squatter)
        assert squatted is not None and squatted.experiment is None and squatted.spec.name == "squatter"
    finally:
        await raw.aclose()


@pytest.mark.parametrize("path", ["code.entrypoint", "dataset", "initFrom.jobId", "resources.gpuCount",
                                  "parallelism.data", "priority", "faultTolerance.replicas", "export.format"])
async def test_the_space_cannot_reach_what_a_job_is_or_where_it_runs(context: ApiContext, path: str) -> None:
    app = httpx.ASGITransport(app=create_app(context))
    async with client_for("http://api", TOKEN_A, transport=app) as a:
        resp = await a.post("/v1/experiments", json=sweep(space={path: {"type": "categorical", "values": ["x"]}}))
    assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "space", resp.text
    assert not await context.store.redis.hlen(Keys.experiments)
