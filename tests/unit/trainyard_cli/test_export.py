"""``trainyard export``'s decisions: which checkpoint, when following ends, whether a listing is the export's."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest

from trainyard_cli.client import Artifact, ArtifactView, ExportState
from trainyard_cli.export import ExportFailedError, export_outcome, listing_problem, next_steps, pick_checkpoint
from trainyard_contract.errors import ConflictError

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def ckpt(step: int, *, retired: str | None = None, kind: str = "checkpoint") -> Artifact:
    return Artifact(artifact_id=f"job-1/{kind}/step-{step:09d}-a1", job_id="job-1", type=kind, uri="file:///m",
                    hash="sha256:x", producer_attempt=1, global_step=step,
                    retired_at=NOW if retired else None, retired_reason=retired)


ARTIFACTS = [ckpt(10, retired="deleted by retention: keepLast=2"), ckpt(20), ckpt(30), ckpt(30, kind="model")]


def test_the_latest_ready_checkpoint_or_the_one_at_the_step() -> None:
    assert pick_checkpoint("job-1", ARTIFACTS, None).artifact_id == "job-1/checkpoint/step-000000030-a1"
    assert pick_checkpoint("job-1", ARTIFACTS, 20).global_step == 20


def test_a_step_without_a_ready_checkpoint_lists_the_ready_steps() -> None:
    with pytest.raises(ConflictError, match=r"step 10 is retired \(deleted by retention: keepLast=2\); READY steps: "
                                            r"20, 30"):
        pick_checkpoint("job-1", ARTIFACTS, 10)
    with pytest.raises(ConflictError, match="no checkpoint at step 15; READY steps: 20, 30"):
        pick_checkpoint("job-1", ARTIFACTS, 15)
    with pytest.raises(ConflictError, match="no READY checkpoint"):
        pick_checkpoint("job-1", [], None)


def view(state: str, **export: object) -> ArtifactView:
    return ArtifactView(artifact_id="job-1/export/step-000000030-a1/hf", type="export", state=state,
                        export=ExportState(export_id="job-1/export/step-000000030-a1/hf",
                                           checkpoint_artifact_id="job-1/checkpoint/step-000000030-a1",
                                           job_id="job-1", format="hf", state=state, **export))


def test_following_ends_when_ready_and_a_failure_is_an_error_with_its_reason() -> None:
    assert export_outcome(view("requested")) is None
    assert export_outcome(view("ready")) == "ready"
    with pytest.raises(ExportFailedError, match="failed: checkpoint verification failed\n  - rank-1: sha256"):
        export_outcome(view("failed", reason="checkpoint verification failed", problems=["rank-1: sha256"]))


def test_a_listing_is_the_exports_only_when_its_sha256_is_the_exports_hash() -> None:
    listing = b'{"files": []}'
    digest = hashlib.sha256(listing).hexdigest()
    assert listing_problem(listing, f"sha256:{digest}") is None
    assert "the export's hash is sha256:00" in (listing_problem(listing, "sha256:00") or "")


def test_what_to_do_next_names_from_pretrained(tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    assert f'AutoModelForCausalLM.from_pretrained("{tmp_path}")' in next_steps(view("ready"), tmp_path)
    assert "--out DIR" in next_steps(view("ready", uri="file:///x"), None)
