"""Retired checkpoints in the registry: late CheckpointReady, retirement of artifacts (pure)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from trainyard_contract.records import CheckpointRecord
from trainyard_registry.lineage import checkpoint_artifact, retire, retired_since_ready, retirements
from tests.unit.trainyard_registry.test_lineage import DATASET, MANIFEST, NOW, job, ready

LATER = datetime(2026, 1, 2, tzinfo=UTC)


def record(state: str, **kw: object) -> CheckpointRecord:
    fields = dict(job_id="j", tenant="t", attempt=2, epoch=2, global_step=40, world_size=2, state=state,
                  manifest_uri=MANIFEST, content_hash="sha256:" + "c" * 64, reason="kept the newest 3")
    return CheckpointRecord(**{**fields, **kw})  # type: ignore[arg-type]  # a str for a Literal field


@pytest.mark.parametrize("state", ["DELETED", "FAILED"])
def test_a_ready_event_for_a_checkpoint_retired_since_is_recognised(state: str) -> None:
    reason = retired_since_ready(ready(), record(state))
    assert reason is not None and "step-000000040-a2" in reason and "kept the newest 3" in reason


@pytest.mark.parametrize("rec", [
    None,
    record("READY"),
    record("PENDING"),
    record("FAILED", content_hash=None, manifest_uri=None),          # failed before it was ever READY
    record("DELETED", content_hash="sha256:" + "0" * 64),           # another content: forged
    record("DELETED", tenant="other"),
])
def test_anything_else_is_not_retired(rec: CheckpointRecord | None) -> None:
    assert retired_since_ready(ready(), rec) is None


def test_retire_is_idempotent_and_keeps_the_first_time_and_reason() -> None:
    artifact = checkpoint_artifact(job(), ready(), DATASET, now=NOW)
    once = retire(artifact, "deleted", now=NOW)
    assert once is not None and once.retired_at == NOW and once.retired_reason == "deleted"
    assert retire(once, "again", now=LATER) is None


def test_retirements_marks_only_artifacts_whose_checkpoint_is_deleted_or_failed() -> None:
    live = checkpoint_artifact(job(), ready(step=60), DATASET, now=NOW).model_copy(update={"uri": "file:///m60"})
    gone = checkpoint_artifact(job(), ready(), DATASET, now=NOW)
    records = [record("DELETED"), record("READY", global_step=60, manifest_uri="file:///m60")]
    (changed,) = retirements([live, gone], records, now=LATER)
    assert changed.artifact_id == gone.artifact_id and changed.retired_at == LATER
    assert "deleted by retention" in (changed.retired_reason or "")
    assert retirements([changed, live], records, now=LATER) == []
