"""A JobSubmitted wakes the scheduling pass for the job it names, whoever stored the job first: the API
stores it before the event ("already known" to the scheduler), and that job must not wait for the tick. The event
is only a wake-up: the job comes in through the one door, the pass taking it in from the change log."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_runtime.controlrecords import UnauthorisedEventError
from trainyard_contract.events import JobSubmitted
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys, StateStore
from trainyard_scheduler import Scheduler, SchedulerSettings
from trainyard_scheduler.keys import SchedulerKeys
from tests.support.api import spec_with
from tests.support.datasets import verified

pytestmark = pytest.mark.integration


@pytest.fixture
async def scheduler(env: dict[str, Any]) -> AsyncIterator[Scheduler]:
    settings = SchedulerSettings(**env, tick_s=3600, reconcile_interval_s=3600, instance_id="wake-test")
    runtime = ServiceRuntime("scheduler", settings)
    s = Scheduler(runtime, settings)
    try:
        yield s
    finally:
        await s.aclose()
        await runtime.aclose()


def submitted(job: JobRecord) -> JobSubmitted:
    return JobSubmitted(job_id=job.job_id, tenant=job.tenant, spec=job.spec, spec_hash=job.spec_hash)


async def test_a_job_the_api_stored_first_wakes_the_pass(scheduler: Scheduler) -> None:
    store: StateStore = scheduler.store
    spec = TrainingSpec.model_validate(spec_with())
    await verified(store, spec.dataset)
    queued = JobRecord(job_id="job-wake-1", tenant="t1", spec=spec, spec_hash=spec.spec_hash())
    assert await store.create_job(queued)  # what the API does before it publishes JobSubmitted

    assert not scheduler._wake.is_set()
    await scheduler.handlers.on_job_submitted(submitted(queued))
    assert scheduler._wake.is_set()  # scheduled now, not at the next tick (an hour away here)
    # the event is a wake-up, not the way in: the pass takes the job in, from the change log the API wrote
    assert "job-wake-1" not in await scheduler.redis.smembers(SchedulerKeys.active)
    epoch = await scheduler.leader.lead()
    assert epoch is not None
    await scheduler.cycle.schedule(epoch)
    assert "job-wake-1" in await scheduler.redis.smembers(SchedulerKeys.active)
    assert "job-wake-1" not in await scheduler.redis.smembers(Keys.incoming_jobs)


async def test_a_redelivered_submission_of_a_running_job_does_not(scheduler: Scheduler) -> None:
    store: StateStore = scheduler.store
    spec = TrainingSpec.model_validate(spec_with())
    await verified(store, spec.dataset)
    running = JobRecord(job_id="job-wake-2", tenant="t1", spec=spec, spec_hash=spec.spec_hash(), state="running",
                        attempts=[AttemptRecord(attempt=1, allocation_id="a1", epoch=1, world_size=2,
                                                state="running")])
    assert await store.create_job(running)
    await scheduler.handlers.on_job_submitted(submitted(running))
    assert not scheduler._wake.is_set()


async def test_a_submission_the_api_never_stored_creates_nothing(scheduler: Scheduler) -> None:
    """A JobSubmitted is a wake-up, not a job: without the API's record it is refused (dead-lettered by the bus)
    and the scheduler writes no record, no index entry, and does not wake."""
    spec = TrainingSpec.model_validate(spec_with())
    forged = JobSubmitted(job_id="job-wake-forged", tenant="victim", spec=spec, spec_hash=spec.spec_hash())
    with pytest.raises(UnauthorisedEventError, match="no job record written by the API"):
        await scheduler.handlers.on_job_submitted(forged)
    assert await scheduler.store.get_job("job-wake-forged") is None
    assert not await scheduler.redis.zscore(Keys.jobs, "job-wake-forged")
    assert "job-wake-forged" not in await scheduler.redis.smembers(SchedulerKeys.active)
    assert not scheduler._wake.is_set()
