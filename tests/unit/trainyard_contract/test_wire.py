"""The shared REST bodies: what the API publishes is what the CLI reads, byte for byte."""

from __future__ import annotations

from datetime import UTC, datetime

from trainyard_api import schemas
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_api.views import job_summary, job_view
from trainyard_cli.client import Job
from trainyard_contract import wire
from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord, Progress
from trainyard_contract.spec import TrainingSpec

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def running_job() -> tuple[JobRecord, Progress, list[CheckpointRecord]]:
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    attempt = AttemptRecord(attempt=1, allocation_id="alloc-1", epoch=3, state="running", nodes=["node-0"],
                            world_size=2, started_at=T0, placement_score=0.9)
    job = JobRecord(job_id="job-0123456789ab", tenant="t", spec=spec, spec_hash=spec.spec_hash(), state="running",
                    submitted_by="alice", created_at=T0, updated_at=T0, attempts=[attempt])
    ckpt = CheckpointRecord(job_id=job.job_id, tenant="t", attempt=1, epoch=3, global_step=20, world_size=2,
                            state="READY", manifest_uri="file:///m.json", content_hash="sha256:x", created_at=T0,
                            ready_at=T0, size_bytes=1 << 20)
    progress = Progress(attempt=1, global_step=21, max_steps=40, consumed_tokens=43008, last_loss=2.5,
                        tokens_per_second=1000.0, updated_at=T0)
    return job, progress, [ckpt]


def test_the_api_publishes_the_shared_classes_under_their_openapi_names() -> None:
    for name in ("AttemptView", "ProgressView", "CheckpointView", "CheckpointList", "JobSummary", "JobPage",
                 "SubmitResponse", "ControlResponse", "CodeArchiveView", "ExportFile", "DatasetPublished",
                 "TriggerJobView"):
        assert getattr(schemas, name) is getattr(wire, name)
        assert getattr(wire, name).__name__ == name  # the OpenAPI component's name


def test_the_cli_reads_a_job_as_the_api_sends_it() -> None:
    view = job_view(*running_job())
    sent = view.model_dump_json(by_alias=True)
    read = Job.model_validate_json(sent)
    assert read.attempts == view.attempts and read.progress == view.progress and read.checkpoints == view.checkpoints
    again = read.model_dump(mode="json", by_alias=True)
    body = view.model_dump(mode="json", by_alias=True)
    assert again["attempts"] == body["attempts"] and again["checkpoints"] == body["checkpoints"]
    assert again["progress"] == body["progress"]
    assert read.attempt == 1 and not read.terminal


def test_the_cli_reads_a_page_of_jobs_and_ignores_fields_it_does_not_know() -> None:
    job, progress, _ = running_job()
    page = wire.JobPage(jobs=[job_summary(job, progress)], next_offset=None)
    sent = page.model_dump(mode="json", by_alias=True)
    sent["jobs"][0]["someFutureField"] = {"ignored": True}
    read = wire.JobPage.model_validate(sent)
    assert read == page and read.model_dump_json(by_alias=True) == page.model_dump_json(by_alias=True)


def test_a_submit_answer_without_warnings_leaves_them_out() -> None:
    answer = wire.SubmitResponse(job_id="job-1", state="queued", spec_hash="sha256:x")
    assert answer.model_dump(by_alias=True) == {"jobId": "job-1", "state": "queued", "specHash": "sha256:x"}
    assert wire.SubmitResponse.model_validate_json(answer.model_dump_json(by_alias=True)).warnings is None
