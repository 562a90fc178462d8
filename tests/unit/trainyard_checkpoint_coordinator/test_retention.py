"""The retention seam: which READY checkpoints keepLast would remove."""

from __future__ import annotations

from trainyard_checkpoint_coordinator.retention import retention_candidates
from trainyard_common.records import CheckpointRecord


def ckpt(step: int, attempt: int = 1, state: str = "READY") -> CheckpointRecord:
    return CheckpointRecord(job_id="j", tenant="t", attempt=attempt, epoch=1, global_step=step,
                            world_size=2, state=state)  # type: ignore[arg-type]


def test_keeps_the_newest_ready_ones() -> None:
    records = [ckpt(60), ckpt(20), ckpt(40, state="FAILED"), ckpt(40, attempt=2), ckpt(80, state="PENDING")]
    assert [c.checkpoint_id for c in retention_candidates(records, keep_last=1)] == [
        "step-000000020-a1", "step-000000040-a2"]
    assert retention_candidates(records, keep_last=3) == []
