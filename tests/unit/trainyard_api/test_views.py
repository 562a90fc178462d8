"""What clients see: camelCase response shapes built from the records."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import yaml

from trainyard_api.app import ApiContext, create_app
from trainyard_api.auth import bearer_token
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_api.settings import ApiSettings
from trainyard_telemetry.goodput_history import GoodputInterval
from trainyard_api.views import JobExtras, goodput_interval_view, job_summary, job_view
from trainyard_contract.errors import AuthError
from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord, Progress
from trainyard_contract.spec import TrainingSpec

REPO = Path(__file__).resolve().parents[3]
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def job(**changes: object) -> JobRecord:
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    record = JobRecord(job_id="job-0123456789ab", tenant="t", spec=spec, spec_hash=spec.spec_hash(),
                       submitted_by="alice", created_at=T0, updated_at=T0, queued_reason="needs 2 devices")
    return record.model_copy(update=changes)


def test_job_view_has_the_documented_camelcase_fields() -> None:
    attempt = AttemptRecord(attempt=1, allocation_id="alloc-1", epoch=3, state="running", nodes=["node-0"],
                            world_size=2, started_at=T0, placement_score=0.9)
    ckpt = CheckpointRecord(job_id="job-0123456789ab", tenant="t", attempt=1, epoch=3, global_step=20,
                            world_size=2, state="READY", manifest_uri="file:///m.json", content_hash="sha256:x")
    progress = Progress(attempt=1, global_step=21, max_steps=40, consumed_tokens=43008, last_loss=2.5,
                        tokens_per_second=1000.0)
    body = job_view(job(state="running", attempts=[attempt]), progress, [ckpt]).model_dump(mode="json", by_alias=True)
    assert {"jobId", "tenant", "name", "state", "specHash", "spec", "createdAt", "updatedAt", "reason",
            "queuedReason", "attempts", "progress", "checkpoints"} <= set(body)
    assert body["queuedReason"] is None  # only while queued
    assert body["spec"]["training"]["globalBatchSize"] == 32
    assert set(body["attempts"][0]) >= {"attempt", "allocationId", "epoch", "state", "nodes", "worldSize",
                                        "startCheckpoint", "startedAt", "endedAt", "failureReason",
                                        "placementScore"}
    assert body["progress"] == {"globalStep": 21, "maxSteps": 40, "consumedTokens": 43008, "lastLoss": 2.5,
                                "lr": None, "tokensPerSecond": 1000.0, "mfu": None, "attempt": 1,
                                "updatedAt": None}
    assert body["checkpoints"][0]["checkpointId"] == "step-000000020-a1"
    assert body["checkpoints"][0]["manifestUri"] == "file:///m.json"


def test_children_sizes_and_goodput_intervals_in_camelcase() -> None:
    ckpt = CheckpointRecord(job_id="job-0123456789ab", tenant="t", attempt=1, epoch=3, global_step=20,
                            world_size=2, state="READY", size_bytes=3 << 20)
    old = ckpt.model_copy(update={"size_bytes": None, "global_step": 10})
    body = job_view(job(), None, [ckpt, old], JobExtras(children=["job-b", "job-a"])).model_dump(
        mode="json", by_alias=True)
    assert body["children"] == ["job-b", "job-a"]
    assert [c["sizeBytes"] for c in body["checkpoints"]] == [3 << 20, None]
    assert job_view(job(), None, []).children == []
    interval = goodput_interval_view(GoodputInterval(1_767_225_600, 1_767_225_900, 600.0, 150.0, 0.0, 450.0,
                                                     {"idle": 450.0}))
    assert interval.model_dump(mode="json", by_alias=True) == {
        "start": "2026-01-01T00:00:00Z", "end": "2026-01-01T00:05:00Z", "allocatedDeviceSeconds": 600.0,
        "productiveDeviceSeconds": 150.0, "inFlightDeviceSeconds": 0.0, "wastedDeviceSeconds": 450.0,
        "goodput": 0.25, "goodputToDate": None, "wasted": {"idle": 450.0}}


def test_a_queued_job_says_why_and_takes_max_steps_from_the_spec() -> None:
    body = job_view(job(), None, []).model_dump(by_alias=True)
    assert body["queuedReason"] == "needs 2 devices"
    assert body["progress"]["globalStep"] == 0 and body["progress"]["maxSteps"] == 40
    row = job_summary(job(), None).model_dump(by_alias=True)
    assert row["model"] == "gpt-tiny@v1" and row["gpuCount"] == 2 and row["queuedReason"] == "needs 2 devices"


def test_a_running_job_row_carries_its_pace_and_an_eta_others_do_not() -> None:
    progress = Progress(attempt=1, global_step=30, max_steps=40, tokens_per_second=2048.0, mfu=0.4,
                        step_seconds=0.5)
    row = job_summary(job(state="running"), progress)
    assert (row.tokens_per_second, row.mfu, row.eta_seconds) == (2048.0, 0.4, 5.0)  # 10 steps left x 0.5 s
    assert job_summary(job(state="succeeded"), progress).eta_seconds is None
    assert job_summary(job(state="running"), progress.model_copy(update={"step_seconds": None})).eta_seconds is None
    assert job_summary(job(), None).model_dump(by_alias=True)["etaSeconds"] is None


def test_example_spec_matches_examples_tiny_yaml() -> None:
    assert yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text()) == EXAMPLE_SPEC


def test_openapi_documents_every_route_with_tags_and_no_patch_of_a_job() -> None:
    doc = create_app(ApiContext(ApiSettings(), None, None)).openapi()  # type: ignore[arg-type]  # a test double
    assert {"/v1/training-jobs", "/v1/training-jobs/{job_id}", "/v1/training-jobs/{job_id}/cancel",
            "/v1/training-jobs/{job_id}/checkpoints", "/v1/registry/artifacts", "/healthz"} <= set(doc["paths"])
    # a job's spec is immutable (a new configuration is a new job); a tenant's settings are not
    assert all("patch" not in ops for path, ops in doc["paths"].items() if path.startswith("/v1/training-jobs"))
    assert "patch" in doc["paths"]["/v1/admin/tenants/{tenant}"]
    assert all(op["tags"] for ops in doc["paths"].values() for op in ops.values())
    post = doc["paths"]["/v1/training-jobs"]["post"]
    assert post["tags"] == ["jobs"] and "202" in post["responses"] and "422" in post["responses"]
    assert post["requestBody"]["content"]["application/json"]["examples"]["tiny"]["value"] == EXAMPLE_SPEC
    assert "HTTPBearer" in doc["components"]["securitySchemes"]


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    for bad in (None, "", "Basic abc", "Bearer "):
        try:
            bearer_token(bad)
        except AuthError as exc:
            assert "dev-token" in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_an_interrupted_attempt_says_so() -> None:
    attempt = AttemptRecord(attempt=1, allocation_id="alloc-1", epoch=3, state="revoked", nodes=["node-0"],
                            world_size=2, started_at=T0, interruption="maintenance: node node-0 drained by olga")
    body = job_view(job(attempts=[attempt]), None, []).model_dump(mode="json", by_alias=True)
    assert body["attempts"][0]["interruption"] == "maintenance: node node-0 drained by olga"


def test_a_running_job_whose_checkpoints_stopped_becoming_ready_shows_the_condition() -> None:
    from trainyard_api.views import JobExtras

    attempt = AttemptRecord(attempt=2, allocation_id="alloc-2", epoch=4, state="running", world_size=2)
    stalled = {"jobId": "job-0123456789ab", "attempt": 2, "step": 95, "protectedStep": 40, "everySteps": 10,
               "unprotectedIntervals": 5, "stalled": True, "since": "2025-01-01T00:10:00Z",
               "reason": "no READY checkpoint for 5 intervals: attempt 2 is at step 95, ..."}
    running = job(state="running", attempts=[attempt])
    body = job_view(running, None, [], JobExtras(protection=stalled)).model_dump(mode="json", by_alias=True)
    (condition,) = body["conditions"]
    assert condition["type"] == "CheckpointsStalled" and condition["attempt"] == 2
    assert condition["unprotectedIntervals"] == 5 and "no READY checkpoint for 5 intervals" in condition["reason"]
    # protected again, an earlier attempt's verdict, or a job no longer running: no condition
    for extras, record in ((JobExtras(protection={**stalled, "stalled": False}), running),
                           (JobExtras(protection={**stalled, "attempt": 1}), running),
                           (JobExtras(protection=stalled), job(state="paused", attempts=[attempt])),
                           (JobExtras(), running)):
        assert job_view(record, None, [], extras).model_dump(by_alias=True)["conditions"] == []
