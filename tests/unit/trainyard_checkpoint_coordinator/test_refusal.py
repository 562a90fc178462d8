"""A restoring attempt's refusal of a checkpoint: the pure record change."""

from __future__ import annotations

import pytest

from trainyard_contract.events import CheckpointRefused
from trainyard_contract.records import CheckpointRecord

from trainyard_checkpoint_coordinator.assembly import refusal_reason, settle_refused

URI = "file:///ckpt/acme/job-1/a1/step-40/manifest.json"


def record(state: str, manifest_uri: str | None = URI) -> CheckpointRecord:
    return CheckpointRecord(job_id="job-1", tenant="acme", attempt=1, epoch=3, global_step=40, world_size=2,
                            state=state, manifest_uri=manifest_uri, content_hash="sha256:x")  # type: ignore[arg-type]  # a str for a Literal field


def refused(**kw: object) -> CheckpointRefused:
    fields = dict(job_id="job-1", tenant="acme", attempt=2, manifest_uri=URI, global_step=40,
                  checkpoint_attempt=1, problems=["rank 1: sha256 mismatch", "rank 0: missing"])
    return CheckpointRefused(**{**fields, **kw})


@pytest.mark.parametrize("state", ["READY", "PENDING"])
def test_a_ready_or_pending_checkpoint_becomes_failed_with_the_problems(state: str) -> None:
    changed = settle_refused(record(state), refused())
    assert changed is not None and changed.state == "FAILED"
    assert changed.reason == "refused at restore by attempt 2: rank 1: sha256 mismatch; rank 0: missing"
    assert (changed.global_step, changed.attempt, changed.manifest_uri) == (40, 1, URI)


@pytest.mark.parametrize("state", ["FAILED", "DELETED"])
def test_a_settled_failed_or_deleted_checkpoint_is_left_as_it_is(state: str) -> None:
    assert settle_refused(record(state), refused()) is None


def test_a_refusal_of_another_manifest_changes_nothing() -> None:
    assert settle_refused(record("READY"), refused(manifest_uri="file:///elsewhere/manifest.json")) is None


def test_applying_a_refusal_twice_is_idempotent() -> None:
    once = settle_refused(record("READY"), refused())
    assert once is not None and settle_refused(once, refused()) is None


def test_a_refusal_without_problems_still_says_why() -> None:
    assert refusal_reason(refused(problems=[])) == "refused at restore by attempt 2: restore verification failed"
