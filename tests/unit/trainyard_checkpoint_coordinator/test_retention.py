"""Retention and garbage collection, as pure decisions: what plan_gc removes, and what it must never remove."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from trainyard_checkpoint_coordinator.retention import (
    Collect,
    DirectoryInfo,
    Retire,
    Sweep,
    parse_directory,
    plan_gc,
    protected_checkpoints,
    retention_candidates,
)
from trainyard_contract.events import CheckpointRef
from trainyard_contract.records import AttemptRecord, CheckpointRecord

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def ckpt(step: int, attempt: int = 1, state: str = "READY", deleted: bool = False) -> CheckpointRecord:
    return CheckpointRecord(job_id="j", tenant="t", attempt=attempt, epoch=attempt, global_step=step,
                            world_size=2, state=state, deleted_at=NOW if deleted else None)  # type: ignore[arg-type]  # a test double


def attempt(n: int, state: str, start: tuple[int, int] | None = None) -> AttemptRecord:
    ref = CheckpointRef(manifest_uri=f"file:///x/step-{start[0]:09d}-a{start[1]}/manifest.json",
                        global_step=start[0], attempt=start[1]) if start else None
    return AttemptRecord(attempt=n, allocation_id=f"al{n}", epoch=n, state=state, world_size=2,  # type: ignore[arg-type]  # a str for a Literal field
                         start_checkpoint=ref)


def ids(actions: list, kind: type) -> list[str]:
    return [a.record.checkpoint_id if hasattr(a, "record") else a.name for a in actions if isinstance(a, kind)]


def test_keeps_the_newest_ready_ones() -> None:
    records = [ckpt(60), ckpt(20), ckpt(40, state="FAILED"), ckpt(40, attempt=2), ckpt(80, state="PENDING")]
    assert [c.checkpoint_id for c in retention_candidates(records, keep_last=1)] == [
        "step-000000020-a1", "step-000000040-a2"]
    assert retention_candidates(records, keep_last=3) == []


def test_the_checkpoint_a_live_attempt_started_from_is_never_retired() -> None:
    records = [ckpt(10), ckpt(20), ckpt(30, attempt=2), ckpt(40, attempt=2)]
    live = [attempt(1, "failed"), attempt(2, "running", start=(10, 1))]
    actions = plan_gc(records, [], keep_last=1, attempts=live, stale_after_s=60)
    assert ids(actions, Retire) == ["step-000000020-a1", "step-000000030-a2"]
    # once that attempt has ended, the protection ends with it
    ended = [attempt(1, "failed"), attempt(2, "succeeded", start=(10, 1))]
    assert "step-000000010-a1" in ids(plan_gc(records, [], keep_last=1, attempts=ended, stale_after_s=60), Retire)
    assert protected_checkpoints(live) == {"step-000000010-a1"}


def test_failed_and_half_deleted_checkpoints_are_collected_once() -> None:
    records = [ckpt(10, state="FAILED"), ckpt(20, state="FAILED", deleted=True), ckpt(30, state="DELETED"),
               ckpt(40, state="DELETED", deleted=True), ckpt(50, state="PENDING"), ckpt(60)]
    actions = plan_gc(records, [], keep_last=3, attempts=[], stale_after_s=60)
    assert ids(actions, Collect) == ["step-000000010-a1", "step-000000030-a1"]
    assert ids(actions, Retire) == [] and ids(actions, Sweep) == []


@pytest.mark.parametrize(
    ("name", "age", "attempt_state", "swept"),
    [
        ("step-000000020-a1.tmp", 120, "failed", True),  # an interrupted save of an ended attempt
        ("step-000000020-a1.tmp", 30, "failed", False),  # too young: the shard timeout has not passed
        ("step-000000020-a1.tmp", 9999, "running", False),  # a live attempt may still be writing it
        ("step-000000020-a1", 120, "failed", True),  # renamed, but no rank's report ever arrived
        ("step-000000020-a1", 120, "running", False),
        ("step-000000010-a1", 9999, "failed", False),  # has a record: the record decides
        ("not-a-checkpoint", 9999, "failed", False),  # never touch what we did not write
    ],
)
def test_directories_without_a_record_are_swept_only_when_stale_and_dead(
    name: str, age: float, attempt_state: str, swept: bool
) -> None:
    records = [ckpt(10)]
    actions = plan_gc(records, [DirectoryInfo(name, age)], keep_last=3, attempts=[attempt(1, attempt_state)],
                      stale_after_s=60)
    assert ids(actions, Sweep) == ([name] if swept else [])


def test_parse_directory() -> None:
    assert parse_directory("step-000000020-a3") == (20, 3, False)
    assert parse_directory("step-000000020-a3.tmp") == (20, 3, True)
    assert parse_directory("manifest.json") is None
