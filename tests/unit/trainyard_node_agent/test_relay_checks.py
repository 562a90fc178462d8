"""The agent relays from a rank's spool only what a rank may say, about itself (relay.check_line)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from trainyard_contract.events import (
    CHECKPOINTS,
    JOBS,
    METRICS,
    CheckpointRefused,
    DatasetVersionPublished,
    Event,
    FileDigest,
    GangAllocated,
    JobControlRequested,
    NodeHeartbeat,
    ShardWritten,
    StepMetrics,
)
from trainyard_node_agent.relay import RankIdentity, Refusal, Relay, check_line, inside

PREFIX = "/art/tenants/t1/jobs/job-a/checkpoints"
TRACE = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
WHO = RankIdentity(job_id="job-a", tenant="t1", attempt=2, allocation_id="alloc-2", epoch=5, rank=1,
                   checkpoints=PREFIX, start_manifest_uri="file:///art/tenants/t0/jobs/base/checkpoints/s/manifest.json",
                   traceparent=TRACE)
SHA = "0" * 64


def line(event: Event | dict[str, Any], *, topic: str | None = None, traceparent: str | None = TRACE) -> dict[str, Any]:
    payload = json.loads(event.to_bytes()) if isinstance(event, Event) else event
    return {"topic": topic if topic is not None else (event.topic if isinstance(event, Event) else METRICS),
            "key": "whatever", "traceparent": traceparent, "payload": payload}


def shard(**changes: Any) -> ShardWritten:
    fields: dict[str, Any] = {"job_id": "job-a", "tenant": "t1", "attempt": 2, "epoch": 5, "global_step": 10,
                              "rank": 1, "world_size": 2, "uri": f"file://{PREFIX}/step-000000010-a2/__1_0.distcp",
                              "size_bytes": 3, "sha256": SHA}
    return ShardWritten(**{**fields, **changes})


def metrics(**changes: Any) -> StepMetrics:
    return StepMetrics(**{"job_id": "job-a", "tenant": "t1", "attempt": 2, "rank": 1, "step": 3, "loss": 1.5,
                          "consumed_tokens": 10, **changes})


def relayed(record: dict[str, Any]) -> Relay:
    checked = check_line(record, WHO, offset=100)
    assert isinstance(checked, Relay), checked
    return checked


def refused(record: dict[str, Any]) -> Refusal:
    checked = check_line(record, WHO, offset=100)
    assert isinstance(checked, Refusal), checked
    return checked


def test_a_ranks_own_events_are_relayed_on_their_topic_keyed_by_its_job() -> None:
    for event in (shard(), metrics(), CheckpointRefused(job_id="job-a", tenant="t1", attempt=2, global_step=4,
                                                         manifest_uri=f"file://{PREFIX}/step-4/manifest.json")):
        out = relayed(line(event))
        assert (out.topic, out.key, type(out.event)) == (event.topic, "job-a", type(event))
        assert out.traceparent == TRACE


def test_the_agent_stamps_what_the_rank_left_out() -> None:
    out = relayed(line(metrics(tenant=None)))
    assert isinstance(out.event, StepMetrics) and out.event.tenant == "t1"


@pytest.mark.parametrize(("event", "topic", "why"), [
    (JobControlRequested(job_id="job-b", tenant="t2", action="cancel"), JOBS, "may not publish 'JobControlRequested'"),
    (NodeHeartbeat(node_id="n9", host="h", devices=[], free_devices=0), None, "may not publish 'NodeHeartbeat'"),
    (DatasetVersionPublished(name="d", version="v9", manifest_uri="file:///x", sha256=SHA), None,
     "may not publish 'DatasetVersionPublished'"),
    (shard(job_id="job-b"), None, "names jobId 'job-b'; this rank's is 'job-a'"),
    (shard(tenant="t2"), None, "names tenant 't2'"),
    (shard(attempt=1), None, "names attempt 1"),
    (shard(epoch=4), None, "names epoch 4"),
    (shard(rank=0), None, "names rank 0"),
    (metrics(job_id="job-b"), None, "names jobId 'job-b'"),
    (shard(), METRICS, "belongs on trainyard.checkpoints"),
    (metrics(), CHECKPOINTS, "belongs on trainyard.metrics"),
    (shard(uri="file:///art/tenants/t2/jobs/job-b/checkpoints/step-1/__0_0.distcp"), None, "outside the job's"),
    (shard(uri=f"file://{PREFIX}/../../job-b/checkpoints/x.distcp"), None, "outside the job's"),
    (shard(uri=f"{PREFIX}-evil/x.distcp"), None, "outside the job's"),
    (shard(uri="s3://bucket/tenants/t1/jobs/job-a/checkpoints/x"), None, "outside the job's"),
    (shard(extra_files=[FileDigest(uri="file:///etc/passwd", size_bytes=1, sha256=SHA)]), None, "'file:///etc/passwd'"),
    (CheckpointRefused(job_id="job-a", tenant="t1", attempt=2, global_step=4,
                       manifest_uri="file:///art/tenants/t2/jobs/job-b/checkpoints/s/manifest.json"), None,
     "neither a checkpoint of this job nor the start checkpoint"),
])
def test_claims_a_rank_may_not_make_are_violations(event: Event, topic: str | None, why: str) -> None:
    out = refused(line(event, topic=topic))
    assert out.violation and why in out.reason, out.reason


def test_the_start_checkpoint_it_was_handed_may_be_refused_even_when_it_is_another_jobs() -> None:
    out = relayed(line(CheckpointRefused(job_id="job-a", tenant="t1", attempt=2, global_step=4,
                                         manifest_uri=WHO.start_manifest_uri)))
    assert isinstance(out.event, CheckpointRefused)


def test_a_gang_allocation_from_a_rank_is_refused() -> None:
    payload = {"eventType": GangAllocated.model_fields["event_type"].default, "jobId": "job-a"}
    out = refused(line(payload, topic="trainyard.allocations"))
    assert out.violation and "may not publish 'GangAllocated'" in out.reason


@pytest.mark.parametrize(("record", "why"), [
    ({"corrupt": "{not json"}, "unreadable"),
    ({"topic": METRICS, "payload": "a string"}, "JSON object"),
    (line({**json.loads(metrics().to_bytes()), "loss": "lots"}), "malformed StepMetrics: loss"),
    (line({k: v for k, v in json.loads(shard().to_bytes()).items() if k != "sha256"}, topic=CHECKPOINTS),
     "malformed ShardWritten: sha256"),
])
def test_unreadable_or_malformed_lines_are_refused_but_are_no_violation(record: dict[str, Any], why: str) -> None:
    out = refused(record)
    assert not out.violation and why in out.reason, out.reason


def test_event_ids_are_the_agents_stable_per_line_and_unique_to_the_rank() -> None:
    event = shard()
    first, again = relayed(line(event)), relayed(line(event))
    assert first.event.event_id == again.event.event_id != event.event_id  # a re-relayed line keeps its id
    other = check_line(line(event), RankIdentity(**{**WHO.__dict__, "rank": 0}), offset=100)
    assert isinstance(other, Refusal)  # and the same line from another rank is not its line at all
    twin = RankIdentity(**{**WHO.__dict__, "allocation_id": "alloc-3", "epoch": 5})
    assert relayed(line(event)).event.event_id != check_line(line(event), twin, offset=100).event.event_id  # type: ignore[union-attr]  # present here (the test asserts it)


def test_a_trace_outside_the_jobs_trace_is_replaced_by_the_launchs() -> None:
    foreign = "00-" + "c" * 32 + "-" + "d" * 16 + "-01"
    assert relayed(line(metrics(), traceparent=foreign)).traceparent == TRACE
    assert relayed(line(metrics(), traceparent="garbage")).traceparent == TRACE
    child = "00-" + "a" * 32 + "-" + "e" * 16 + "-01"
    assert relayed(line(metrics(), traceparent=child)).traceparent == child


def test_the_relayed_body_is_the_agents_rendering() -> None:
    payload = {**json.loads(metrics().to_bytes()), "injected": "x" * 10}
    out = relayed(line(payload))
    body = json.loads(out.body)
    assert "injected" not in body and body["jobId"] == "job-a" and body["eventId"] == str(out.event.event_id)


@pytest.mark.parametrize(("uri", "ok"), [
    (f"file://{PREFIX}/a/b", True), (f"{PREFIX}/a", True), (f"file://{PREFIX}", False), (f"{PREFIX}x/a", False),
    (f"file://{PREFIX}/a/../../../x", False), (f"file://{PREFIX}//a", True), ("relative/path", False),
    (f"file://otherhost{PREFIX}/a", False),
])
def test_inside(uri: str, ok: bool) -> None:
    assert inside(uri, PREFIX) is ok


S3_PREFIX = "s3://bucket/root/tenants/t1/jobs/job-a/checkpoints"


@pytest.mark.parametrize(("uri", "ok"), [
    (f"{S3_PREFIX}/step-1/__0_0.distcp", True), (f"{S3_PREFIX}//step-1/x", True), (S3_PREFIX, False),
    (f"{S3_PREFIX}x/a", False), (f"{S3_PREFIX}/a/../../../../job-b/checkpoints/x", False),
    (f"{S3_PREFIX}/../../../../../../other-bucket/x", False),
    ("gs://bucket/root/tenants/t1/jobs/job-a/checkpoints/a", False),
    ("file:///bucket/root/tenants/t1/jobs/job-a/checkpoints/a", False),
    ("/bucket/root/tenants/t1/jobs/job-a/checkpoints/a", False),
    ("s3://other/root/tenants/t1/jobs/job-a/checkpoints/a", False),
])
def test_inside_an_object_store_prefix(uri: str, ok: bool) -> None:
    assert inside(uri, S3_PREFIX) is ok


def test_shards_written_to_the_jobs_object_store_prefix_are_relayed() -> None:
    who = dataclasses.replace(WHO, checkpoints=S3_PREFIX)
    ok = check_line(line(shard(uri=f"{S3_PREFIX}/step-000000010-a2/__1_0.distcp")), who, offset=1)
    assert isinstance(ok, Relay)
    elsewhere = check_line(line(shard(uri="s3://bucket/root/tenants/t2/jobs/job-b/checkpoints/s/x")), who, offset=2)
    assert isinstance(elsewhere, Refusal) and elsewhere.violation
