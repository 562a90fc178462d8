"""End-to-end confirmation: when an announced event counts as applied, still pending, or moot."""

from __future__ import annotations

import pytest

from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_node_agent.confirmation import Announcement, verdict

SPEC = TrainingSpec.model_validate({
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "d@v1", "codeRevision": "x",
    "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2}, "checkpointPolicy": {"everySteps": 5},
    "training": {"sequenceLength": 8, "microBatchSize": 1, "globalBatchSize": 2, "learningRate": 0.1, "maxSteps": 9},
})


def ann(kind: str, rank: int = 1, attempt: int = 2, allocation: str = "al2") -> Announcement:
    return Announcement(event_id="e", kind=kind, topic="t", key="j", payload="{}", traceparent=None,  # type: ignore[arg-type]  # a test double
                        job_id="j", attempt=attempt, allocation_id=allocation, rank=rank, step=5)


def job(state: str = "running", attempt_state: str = "running", started: list[int] | None = None,
        exited: dict[str, int] | None = None) -> JobRecord:
    attempts = [AttemptRecord(attempt=1, allocation_id="al1", epoch=1, state="failed", world_size=2),
                AttemptRecord(attempt=2, allocation_id="al2", epoch=2, state=attempt_state, world_size=2,  # type: ignore[arg-type]  # a str for a Literal field
                              started_ranks=started or [], exited_ranks=exited or {})]
    return JobRecord(job_id="j", tenant="t", spec=SPEC, spec_hash="h", state=state, attempts=attempts)  # type: ignore[arg-type]  # a str for a Literal field


@pytest.mark.parametrize(("a", "j", "expected"), [
    (ann("started"), job(started=[1]), "confirmed"),
    (ann("started"), job(started=[0]), "pending"),  # lost with the broker: publish again
    (ann("started"), job(attempt_state="failed"), "moot"),  # the attempt ended meanwhile
    (ann("started", allocation="old"), job(), "moot"),
    (ann("exited"), job(exited={"1": 0}), "confirmed"),
    (ann("exited"), job(exited={"0": 0}), "pending"),
    (ann("exited"), job(state="succeeded", attempt_state="succeeded"), "moot"),
    (ann("exited"), None, "moot"),
    (ann("exited", attempt=3, allocation="al3"), job(), "pending"),  # the scheduler's write has not landed
])
def test_worker_announcements(a: Announcement, j: JobRecord | None, expected: str) -> None:
    assert verdict(a, j) == expected


def test_shard_announcements() -> None:
    assert verdict(ann("shard"), job(), shard_recorded=True) == "confirmed"
    assert verdict(ann("shard"), job(), checkpoint_state="PENDING") == "pending"
    assert verdict(ann("shard"), job(), checkpoint_state=None) == "pending"
    assert verdict(ann("shard"), job(), checkpoint_state="FAILED") == "moot"
    assert verdict(ann("shard"), job(state="cancelled"), checkpoint_state=None) == "moot"


def shard(attempt: int = 2, epoch: int | None = 2) -> Announcement:
    a = ann("shard", attempt=attempt, allocation=f"al{attempt}")
    a.epoch = epoch
    return a


@pytest.mark.parametrize(("case", "a", "j", "expected", "why"), [
    ("live attempt, not recorded yet", shard(), job(), "pending", "not recorded"),
    ("the attempt was revoked (a drain, a pause)", shard(), job(attempt_state="revoked"), "moot", "attempt 2 ended"),
    ("the attempt failed", shard(), job(attempt_state="failed"), "moot", "attempt 2 ended (failed)"),
    ("an older attempt's shard: its epoch is fenced", shard(attempt=1, epoch=1), job(), "moot", "epoch 1 is stale"),
    ("completed attempt waiting for its final checkpoint", shard(), job(attempt_state="succeeded"), "pending",
     "not recorded"),
    ("no epoch recorded (an older agent)", shard(epoch=None), job(), "pending", "not recorded"),
])
def test_a_shard_that_can_never_be_applied_is_moot(case: str, a: Announcement, j: JobRecord, expected: str,
                                                    why: str) -> None:
    from trainyard_node_agent.confirmation import explain

    got, reason = explain(a, j)
    assert got == expected, case
    assert why in reason, f"{case}: {reason}"
