"""POST /v1/registry/artifacts/{id}/export as a decision: 404 for what is not the caller's, 409 with what to
do for what cannot be exported, the same export while it is requested or ready, a retry after a failure."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from trainyard_api.exports import Existing, New, export_request, job_of
from trainyard_contract.errors import ConflictError, NotFoundError
from trainyard_contract.records import ArtifactRecord, ExportRecord, Lineage, TenantToken

NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)
CKPT = "job-1/checkpoint/step-000000040-a1"
TOKEN = TenantToken(tenant="acme", name="alice", token_id="tok_a")


def artifact(**changes: object) -> ArtifactRecord:
    return ArtifactRecord(
        artifact_id=CKPT, job_id="job-1", tenant="acme", type="checkpoint", uri="file:///m.json",
        hash="sha256:" + "c" * 64, producer_attempt=1, global_step=40,
        lineage=Lineage(spec_hash="s", code_revision="r", dataset="d@v1"),
    ).model_copy(update=changes)


def record(state: str) -> ExportRecord:
    return ExportRecord(export_id="job-1/export/step-000000040-a1/hf", checkpoint_artifact_id=CKPT, job_id="job-1",
                        tenant="acme", format="hf", state=state, requested_by="tok_a",  # type: ignore[arg-type]  # a str for a Literal field
                        requested_at=NOW)


def test_a_new_request_is_recorded_requested_with_its_event() -> None:
    decision = export_request(TOKEN, CKPT, artifact(), None, "hf", now=NOW)
    assert isinstance(decision, New)
    assert decision.record.export_id == decision.event.export_id == "job-1/export/step-000000040-a1/hf"
    assert (decision.record.state, decision.event.requested_by, decision.event.tenant) == ("requested", "tok_a", "acme")
    assert decision.event.key() == "job-1"


@pytest.mark.parametrize("state", ["requested", "ready"])
def test_the_same_checkpoint_and_format_while_requested_or_ready_is_the_same_export(state: str) -> None:
    assert export_request(TOKEN, CKPT, artifact(), record(state), "hf", now=NOW) == Existing(record(state))


def test_a_failed_export_is_retried_by_a_new_request() -> None:
    assert isinstance(export_request(TOKEN, CKPT, artifact(), record("failed"), "hf", now=NOW), New)


def test_another_tenants_artifact_is_answered_like_a_missing_one() -> None:
    for found in (None, artifact(tenant="other")):
        with pytest.raises(NotFoundError, match="no artifact"):
            export_request(TOKEN, CKPT, found, None, "hf", now=NOW)


def test_a_retired_checkpoint_or_an_export_is_a_conflict_saying_what_to_do() -> None:
    retired = artifact(retired_at=NOW, retired_reason="checkpoint step-000000040-a1 deleted by retention: keepLast=1")
    with pytest.raises(ConflictError, match=r"retired: checkpoint .* deleted by retention.*trainyard export job-1 "
                                            r"--step N"):
        export_request(TOKEN, CKPT, retired, None, "hf", now=NOW)
    with pytest.raises(ConflictError, match="only checkpoints and models"):
        export_request(TOKEN, CKPT, artifact(type="export"), None, "hf", now=NOW)


def test_the_job_is_the_first_part_of_an_artifact_id() -> None:
    assert job_of(CKPT) == "job-1" and job_of("job-1") is None and job_of("/x") is None
