"""The bus is not an authority: job events written straight to the broker by someone who reaches it (issue 30,
item 3), against the real scheduler and node agents, broker and Redis (the module-scoped stack of
``tests/integration/test_scheduler_stack.py``; this test plays the API exactly as it writes, through
:class:`trainyard_api.jobs.JobService` and its outbox where it matters).

* a ``JobSubmitted`` in the victim's tenant that the API never stored: refused (dead-lettered ``security: …``),
  no job record or index entry, no GangAllocated, no lease; the refusal is counted;
* a ``JobControlRequested`` (cancel) for the victim's running and queued jobs that the API never recorded: both
  jobs carry on (running with its devices, queued), while a cancel made through the API's own path still works;
* a genuine, recorded control event replayed with another action (or naming another job): refused; once the
  genuine event was handled, a replay changes nothing either, and a refused copy consumed before its genuine
  event does not make the genuine one a duplicate;
* worker news read a batch at a time (one gang's WorkerStarted are one write): a burst of forged rank news for
  the victim's running job — exits and starts of a stale epoch, of another allocation, of ranks outside its
  world, and bytes that are no event at all, published together so they share batches — changes nothing: the
  job runs on in the same attempt with the same ranks, no failure is counted, only the bytes are dead-lettered
  (once each), and the victim's own news after the burst (its cancel's exits) are still applied.

What the platform promises is asserted (states, records, events), never how long anything takes.
"""

from __future__ import annotations

import base64
import json
import uuid

import pytest
from prometheus_client import REGISTRY

from trainyard_api.jobs import JobService
from trainyard_contract import events as ev
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import JobRecord, TenantToken
from trainyard_runtime.store import Keys

from tests.integration.test_scheduler_stack import (  # noqa: F401 - stack_env and stack are fixtures
    Stack,
    make_spec,
    poll,
    stack,
    stack_env,
)

pytestmark = [pytest.mark.integration, pytest.mark.security, pytest.mark.asyncio(loop_scope="module")]
VICTIM = "victim"
METRIC = "trainyard_scheduler_unauthorised_events_total"


def refusals(event: str, reason: str) -> float:
    return REGISTRY.get_sample_value(METRIC, {"event": event, "reason": reason}) or 0.0


async def dead_letter_of(s: Stack, event: ev.Event) -> ev.DeadLetter:
    """The scheduler's dead letter of ``event`` (matched by the bytes it carries: id, type and action)."""
    sent = json.loads(event.to_bytes())

    def carries(letter: ev.DeadLetter) -> bool:
        raw = json.loads(base64.b64decode(letter.raw_b64))
        return all(raw.get(k) == sent[k] for k in ("eventId", "eventType", "jobId")) and \
            raw.get("action") == sent.get("action")

    async def found() -> ev.DeadLetter | None:
        letters = [d for d in s.tap.events(ev.DeadLetter, source_topic=ev.JOBS)
                   if d.consumer_group.endswith(".scheduler") and carries(d)]
        return letters[0] if letters else None

    return await poll(found, f"the scheduler's dead letter of {sent['eventType']} {sent['eventId']}")


def api(s: Stack) -> tuple[JobService, Outbox]:
    """The API's job service on the stack's Redis, and its outbox (relayed by the test: no API process runs)."""
    outbox = Outbox(s.redis, "api")
    return JobService(s.store, outbox), outbox


VICTIM_TOKEN = TenantToken(tenant=VICTIM, name="victim-user", role="submitter")


async def staged_control(s: Stack, job_id: str) -> ev.JobControlRequested:
    """The JobControlRequested the API staged last for ``job_id`` (what its relay will publish)."""
    entries = await s.redis.xrange(Keys.outbox("api"))
    staged = [ev.decode_event(ev.JOBS, f["payload"].encode()) for _, f in entries]
    mine = [e for e in staged if isinstance(e, ev.JobControlRequested) and e.job_id == job_id]
    assert mine, f"nothing staged for {job_id}"
    return mine[-1]


async def no_lease_of(s: Stack, job_id: str) -> bool:
    return all(a.job_id != job_id for a in (await s.held()).values())


async def running_victim(s: Stack, job_id: str) -> JobRecord:
    s.control(job_id, sleep={"1": {"0": 600}})  # its rank runs until it is stopped
    await s.submit(job_id, make_spec(1), tenant=VICTIM)
    await s.tap.wait(ev.WorkerStarted, job_id=job_id, attempt=1)
    return await s.wait_job(job_id, lambda j: j.state == "running" and j.current is not None
                            and j.current.state == "running", "running")


async def queued_victim(s: Stack, job_id: str) -> JobRecord:
    await s.submit(job_id, make_spec(16), tenant=VICTIM)  # more devices than the cluster has: stays queued
    return await s.wait_job(job_id, lambda j: bool(j.queued_reason), "queued with a reason")


# ----------------------------------------------------------------------------- (a) a forged submission


async def test_a_submission_forged_onto_the_bus_creates_and_runs_nothing(stack: Stack) -> None:
    s = stack
    victim = await queued_victim(s, "victim-archive")
    before = refusals("JobSubmitted", "unrecorded")
    spec = make_spec(1)
    forged = ev.JobSubmitted(job_id=f"job-forged{uuid.uuid4().hex[:6]}", tenant=VICTIM, spec=spec,
                             spec_hash=spec.spec_hash(), submitted_by="victim-user")
    await s.publisher.publish(forged)

    letter = await dead_letter_of(s, forged)
    assert "security: JobSubmitted refused (unrecorded)" in letter.error
    assert "no job record written by the API" in letter.error
    assert await s.store.get_job(forged.job_id) is None
    for index in (Keys.jobs, Keys.tenant_jobs(VICTIM)):
        assert await s.redis.zscore(index, forged.job_id) is None, index
    assert not await s.redis.sismember(Keys.incoming_jobs, forged.job_id)
    assert await no_lease_of(s, forged.job_id)
    assert s.tap.events(ev.GangAllocated, job_id=forged.job_id) == []
    assert refusals("JobSubmitted", "unrecorded") == before + 1
    # a stored job is unchanged by a second, forged submission of its id with another tenant and spec
    mismatched = refusals("JobSubmitted", "mismatch")
    await s.publisher.publish(forged.model_copy(update={"event_id": uuid.uuid4(), "job_id": victim.job_id,
                                                        "tenant": "attacker"}))
    await poll(lambda: _above(refusals("JobSubmitted", "mismatch"), mismatched), "the mismatch counted")
    assert refusals("JobSubmitted", "mismatch") == mismatched + 1
    kept = await s.job(victim.job_id)
    assert (kept.tenant, kept.spec_hash, kept.state) == (VICTIM, victim.spec_hash, "queued")


async def _above(value: float, floor: float) -> bool:
    return value > floor


# ----------------------------------------------------------------------------- (b) a forged cancel


async def test_a_forged_cancel_stops_nothing_while_the_apis_own_cancel_works(stack: Stack) -> None:
    s = stack
    running = await running_victim(s, "victim-running")
    queued = await queued_victim(s, "victim-queued")
    before = refusals("JobControlRequested", "unrecorded")

    forged = [ev.JobControlRequested(job_id=j, tenant=VICTIM, action="cancel", reason="attacker")
              for j in (running.job_id, queued.job_id)]
    for event in forged:
        await s.publisher.publish(event)
    for event in forged:
        letter = await dead_letter_of(s, event)
        assert "security: JobControlRequested refused (unrecorded)" in letter.error
    assert refusals("JobControlRequested", "unrecorded") == before + 2

    still = await s.job(running.job_id)
    assert still.state == "running" and still.current is not None and still.current.state == "running"
    assert still.current.allocation_id == running.current.allocation_id  # type: ignore[union-attr]  # present here (the test asserts it)
    assert not await no_lease_of(s, running.job_id)  # it keeps its devices
    assert s.tap.events(ev.WorkerExited, job_id=running.job_id) == []
    assert (await s.job(queued.job_id)).state == "queued"
    assert s.tap.events(ev.JobStateChanged, job_id=running.job_id, state="cancelled") == []

    # the API's own path: the request recorded with its event in one MULTI, relayed by the outbox
    jobs, outbox = api(s)
    for job_id in (queued.job_id, running.job_id):
        answer = await jobs.control(VICTIM_TOKEN, job_id, "cancel")
        assert answer.action == "cancel"
    assert await outbox.relay_once(s.publisher) >= 2
    for job_id in (queued.job_id, running.job_id):
        ended = await s.wait_job(job_id, lambda j: j.state == "cancelled", "cancelled")
        assert ended.reason == "cancel requested by victim-user"
    assert await poll(lambda: no_lease_of(s, running.job_id), "the running job's devices released")


# ----------------------------------------------------------------------------- (c) a replayed control event


async def test_a_replayed_control_event_with_another_action_is_refused(stack: Stack) -> None:
    s = stack
    job = await queued_victim(s, "victim-replayed")
    jobs, outbox = api(s)

    # a genuine pause, handled; then its replay as a cancel (the attacker read it off the bus): nothing changes
    await jobs.control(VICTIM_TOKEN, job.job_id, "pause")
    pause = await staged_control(s, job.job_id)
    await outbox.relay_once(s.publisher)
    await s.wait_job(job.job_id, lambda j: j.state == "paused", "paused")
    await s.publisher.publish(pause.model_copy(update={"action": "cancel"}))
    behind = ev.JobControlRequested(job_id=job.job_id, tenant=VICTIM, action="resume")  # unrecorded: refused
    await s.publisher.publish(behind)
    await dead_letter_of(s, behind)  # same job, same partition: the replay before it was handled too
    assert (await s.job(job.job_id)).state == "paused"

    # a genuine resume, recorded and staged but not yet relayed; copies of it reach the scheduler first
    mismatched = refusals("JobControlRequested", "mismatch")
    unrecorded = refusals("JobControlRequested", "unrecorded")
    await jobs.control(VICTIM_TOKEN, job.job_id, "resume")
    resume = await staged_control(s, job.job_id)
    other = await running_victim(s, "victim-bystander")
    copies = [resume.model_copy(update={"action": "cancel"}),  # another action: not what the API recorded
              resume.model_copy(update={"job_id": other.job_id, "action": "cancel"})]  # another job: no record
    for copy in copies:
        await s.publisher.publish(copy)
    kinds = [(await dead_letter_of(s, copy)).error for copy in copies]
    assert "refused (mismatch)" in kinds[0] and "action 'cancel' (recorded 'resume')" in kinds[0]
    assert "refused (unrecorded)" in kinds[1]
    assert refusals("JobControlRequested", "mismatch") == mismatched + 1
    assert refusals("JobControlRequested", "unrecorded") == unrecorded + 1
    assert (await s.job(job.job_id)).state == "paused"
    assert (await s.job(other.job_id)).state == "running"

    # the genuine resume, relayed after its refused copies, is not taken for a duplicate: the job queues again
    await outbox.relay_once(s.publisher)
    resumed = await s.wait_job(job.job_id, lambda j: j.state == "queued", "resumed")
    assert resumed.state == "queued"
    for job_id in (job.job_id, other.job_id):
        await jobs.control(VICTIM_TOKEN, job_id, "cancel")
    await outbox.relay_once(s.publisher)
    for job_id in (job.job_id, other.job_id):
        await s.wait_job(job_id, lambda j: j.state == "cancelled", "cancelled")



# ----------------------------------------------------------------------------- (d) forged worker news in a batch


async def test_a_burst_of_forged_worker_news_read_as_one_batch_changes_nothing(stack: Stack) -> None:
    s = stack
    victim = await running_victim(s, "victim-batched")
    current = victim.current
    assert current is not None
    base = dict(job_id=victim.job_id, attempt=current.attempt, node_id="node-a", pid=4242, log_uri="file:///x")
    forged: list[ev.Event] = []
    for rank in range(8):
        forged += [
            ev.WorkerExited(**{k: v for k, v in base.items() if k not in ("pid", "log_uri")},
                            allocation_id=current.allocation_id, epoch=current.epoch - 1, rank=0, exit_code=1,
                            reason="error", detail="a stale epoch's exit"),
            ev.WorkerExited(**{k: v for k, v in base.items() if k not in ("pid", "log_uri")},
                            allocation_id="alloc-forged", epoch=current.epoch + 5, rank=0, exit_code=1,
                            reason="error", detail="another allocation's exit"),
            ev.WorkerStarted(**base, allocation_id=current.allocation_id, epoch=current.epoch - 1, rank=rank),
            ev.WorkerStarted(**base, allocation_id="alloc-forged", epoch=current.epoch + 5, rank=rank),
        ]
    garbage = [b"{not json", json.dumps({"eventType": "WorkerExited", "jobId": victim.job_id}).encode()]
    for i, event in enumerate(forged):
        await s.publisher.publish(event)
        if i % 8 == 0:  # four records that are no event, amid the forged ones
            await s.publisher.publish_raw(ev.WORKERS, garbage[(i // 8) % 2], key=victim.job_id)

    # the victim's own cancel, after the burst on the same partition: its exits are applied once the burst is read
    jobs, outbox = api(s)
    await jobs.control(VICTIM_TOKEN, victim.job_id, "cancel")
    await outbox.relay_once(s.publisher)
    ended = await s.wait_job(victim.job_id, lambda j: j.state == "cancelled", "cancelled")
    assert len(ended.attempts) == 1 and ended.attempts[0].allocation_id == current.allocation_id
    assert ended.attempts[0].started_ranks == current.started_ranks  # no forged rank recorded as started
    assert ended.attempts[0].state != "failed" and ended.attempts[0].failure_reason == "cancelled"  # not "error"
    assert ended.reason == "cancel requested by victim-user"

    async def lettered() -> list[ev.DeadLetter] | None:
        letters = [d for d in s.tap.events(ev.DeadLetter, source_topic=ev.WORKERS)
                   if d.consumer_group.endswith(".scheduler-workers")
                   and base64.b64decode(d.raw_b64) in garbage]
        return letters if len(letters) >= 4 else None

    letters = await poll(lettered, "the scheduler's dead letters of the four records that are no event")
    assert len({(d.partition, d.offset) for d in letters}) == len(letters) == 4  # each once
    assert await poll(lambda: no_lease_of(s, victim.job_id), "the cancelled job's devices released")
