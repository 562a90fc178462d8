"""The live stream's token re-check (LiveHub.stream with a check) and what the queue view shows of another
tenant (cluster.queue)."""

from __future__ import annotations

from trainyard_api.cluster import public_reason, queue, redact_job_ids
from trainyard_api.live import LiveHub
from trainyard_contract.records import JobRecord
from trainyard_contract.spec import TrainingSpec
from tests.support.api import spec_with


async def no_summaries(ids):  # type: ignore[no-untyped-def]  # a stub
    return {}


async def test_a_stream_sends_nothing_once_the_check_refuses_and_ends_with_closed() -> None:
    hub = LiveHub(no_summaries, recheck_s=0.01)
    verdict: list[dict[str, str] | None] = [None]

    async def check() -> dict[str, str] | None:
        return verdict[0]

    stream = hub.stream("tenant-a", None, check=check)
    assert await anext(stream) == b"retry: 2000\n\n"
    (sub,) = hub.subscribers
    sub.offer(b"event: job\ndata: {}\n\n")
    assert await anext(stream) == b"event: job\ndata: {}\n\n"
    verdict[0] = {"reason": "token 'w' of tenant 'tenant-a' was revoked", "kind": "revoked"}
    sub.offer(b"event: job\ndata: {\"after\": true}\n\n")  # queued before the check: never sent
    frame = await anext(stream)
    assert frame.startswith(b"event: closed\n") and b'"kind": "revoked"' in frame
    assert [f async for f in stream] == [] and not hub.subscribers


async def test_an_idle_stream_is_rechecked_and_closes_without_any_event() -> None:
    hub = LiveHub(no_summaries, recheck_s=0.01, keepalive_s=3600)
    calls = 0

    async def check() -> dict[str, str] | None:
        nonlocal calls
        calls += 1
        return {"reason": "expired", "kind": "expired"} if calls >= 3 else None

    frames = [f async for f in hub.stream("tenant-a", None, check=check)]
    assert frames[-1].startswith(b"event: closed\n") and calls == 3


def job(job_id: str, tenant: str, reason: str, kind: str, priority: int = 0) -> JobRecord:
    spec = TrainingSpec.model_validate(spec_with())
    return JobRecord(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash(), state="queued",
                     priority=priority, queued_reason=reason, queued_reason_kind=kind)


def test_another_tenants_reason_is_only_its_kinds_wording_and_own_reasons_hide_their_job_ids() -> None:
    theirs = job("job-bbbbbbbbbbbb", "tenant-b", "quota: tenant tenant-b holds 4 cpu devices and may hold 4",
                 "quota", 9)
    mine = job("job-aaaaaaaaaaaa", "tenant-a",
               "preemption: waiting for job-bbbbbbbbbbbb, job-aaaaaaaaaaab to checkpoint", "preemption")
    other_mine = job("job-aaaaaaaaaaab", "tenant-a", "waiting for 2 x cpu", "capacity")
    rows = queue([theirs, mine, other_mine], "tenant-a")
    assert rows[0].queued_reason == public_reason(theirs) == "waiting for its tenant's quota"
    assert rows[1].queued_reason == ("preemption: waiting for another tenant's job, job-aaaaaaaaaaab to "
                                     "checkpoint")
    admin = queue([theirs, mine], None)
    assert admin[0].queued_reason == theirs.queued_reason and admin[0].tenant == "tenant-b"
    assert redact_job_ids(None, set()) is None
    assert public_reason(job("job-c", "t", "whatever", "novel-kind")) == "waiting"
