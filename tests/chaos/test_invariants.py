"""The invariant checks themselves: each passes on a good history and catches a violating one.

Pure (no broker, no Redis): these run in every ``make test``."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch

from tests.chaos.invariants import (
    AttemptSteps,
    LeaseOp,
    ReplicaLog,
    check_one_quorum_per_step,
    check_bitwise_identical,
    check_fencing,
    check_leases_released,
    check_lost_work,
    check_settled_after_heal,
    check_no_double_booking,
    check_ready_checkpoints,
    check_resumed_from_latest_ready,
    check_terminal,
)
from trainyard_contract.events import CheckpointRef
from trainyard_contract.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord
from trainyard_contract.spec import TrainingSpec

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPEC = TrainingSpec.model_validate({
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "d@v1", "codeRevision": "x",
    "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
    "checkpointPolicy": {"everySteps": 10},
    "training": {"sequenceLength": 8, "microBatchSize": 1, "globalBatchSize": 2, "learningRate": 0.1, "maxSteps": 40},
})


def job(job_id: str = "j", state: str = "succeeded", attempts: list[AttemptRecord] | None = None,
        reason: str | None = None) -> JobRecord:
    return JobRecord(job_id=job_id, tenant="t", spec=SPEC, spec_hash="h", state=state,  # type: ignore[arg-type]  # a str for a Literal field
                     attempts=attempts or [], reason=reason)


def attempt(n: int, epoch: int, state: str = "failed", start: int | None = None, at: float = 0.0) -> AttemptRecord:
    ref = CheckpointRef(manifest_uri="file:///m", global_step=start, attempt=1) if start is not None else None
    return AttemptRecord(attempt=n, allocation_id=f"a{n}", epoch=epoch, state=state, world_size=2,  # type: ignore[arg-type]  # a str for a Literal field
                         start_checkpoint=ref, started_at=T0 + timedelta(seconds=at))


def grant(alloc: str, epoch: int, *devices: str, job_id: str = "j") -> LeaseOp:
    return LeaseOp("grant", job_id, alloc, epoch, devices)


def release(alloc: str, epoch: int, *devices: str, job_id: str = "j") -> LeaseOp:
    return LeaseOp("release", job_id, alloc, epoch, devices)


# ----------------------------------------------------------------------------- terminal


def test_terminal() -> None:
    assert check_terminal([job(state="succeeded"), job(state="cancelled"), job(state="failed", reason="nan")]) == []
    assert len(check_terminal([job(state="running"), job(state="queued"), job(state="failed")])) == 3


# ----------------------------------------------------------------------------- leases


def test_double_booking_is_found_in_the_audit_log() -> None:
    good = [grant("a1", 1, "n:0", "n:1"), release("a1", 1, "n:0", "n:1"), grant("a2", 2, "n:0"),
            grant("b1", 1, "n:1", job_id="k")]
    assert check_no_double_booking(good) == []
    bad = [grant("a1", 1, "n:0", "n:1"), grant("b1", 1, "n:1", job_id="k")]
    assert check_no_double_booking(bad) == ["#1: device n:1 granted to b1 while a1 holds it"]
    stale = [grant("a1", 2, "n:0"), release("a1", 2, "n:0"), grant("a2", 2, "n:0")]
    assert "epoch 2 after epoch 2" in check_no_double_booking(stale)[0]
    restored = [grant("a1", 1, "n:0"), LeaseOp("restore", "j", "a1", 1, ("n:0",)), release("a1", 1, "n:0")]
    assert check_no_double_booking(restored) == []  # a lapsed TTL re-created for the live holder
    late = [grant("a1", 1, "n:0"), release("a1", 1, "n:0"), LeaseOp("restore", "j", "a1", 1, ("n:0",))]
    assert check_no_double_booking(late) == ["#2: a1 restored although it is not a live allocation"]


def test_leases_of_finished_jobs_must_be_released() -> None:
    audit = [grant("a1", 1, "n:0"), release("a1", 1, "n:0"), grant("a2", 2, "n:1")]
    assert check_leases_released(audit, [job(state="running")]) == []
    assert check_leases_released(audit, [job(state="succeeded")]) == ["allocation a2 of finished job j still holds n:1"]


def test_fencing_of_ready_checkpoints() -> None:
    j = job(attempts=[attempt(1, 1), attempt(2, 3, "succeeded")])
    ok = CheckpointRecord(job_id="j", tenant="t", attempt=2, epoch=3, global_step=20, world_size=2, state="READY")
    zombie = ok.model_copy(update={"attempt": 1, "epoch": 1, "global_step": 30})
    bad_zombie = ok.model_copy(update={"epoch": 1})  # attempt 2's checkpoint with an old epoch
    assert check_fencing([j], {"j": [ok, zombie]}) == []
    assert len(check_fencing([j], {"j": [bad_zombie]})) == 1
    assert "do not grow" in check_fencing([job(attempts=[attempt(1, 2), attempt(2, 2)])], {})[0]


# ----------------------------------------------------------------------------- READY checkpoints


def test_ready_checkpoints_must_verify(tmp_path: Path) -> None:
    files = {f"file:///c/__{r}_0.distcp": f"shard {r}".encode() for r in range(2)}

    def sha(b: bytes) -> str:
        return hashlib.sha256(b).hexdigest()

    shards = [ShardEntry(rank=r, uri=u, size_bytes=len(b), sha256=sha(b)) for r, (u, b) in enumerate(files.items())]
    manifest = CheckpointManifest(job_id="j", tenant="t", attempt=1, epoch=1, global_step=10, world_size=2,
                                  shards=shards, content_hash=content_hash(shards))
    record = CheckpointRecord(job_id="j", tenant="t", attempt=1, epoch=1, global_step=10, world_size=2,
                              state="READY", manifest_uri="file:///c/manifest.json", content_hash=manifest.content_hash)
    disk = {**files, "file:///c/manifest.json": manifest.to_bytes()}

    def check(d: dict[str, bytes], records: list[CheckpointRecord] = [record]) -> list[str]:  # noqa: B006 - read only
        return check_ready_checkpoints(records, read_manifest=d.get,
                                       stat_size=lambda u: len(d[u]) if u in d else None,
                                       file_sha256=lambda u: sha(d[u]))

    assert check(disk) == []
    assert any("has 0 bytes" in p for p in check({**disk, "file:///c/__1_0.distcp": b""}))
    assert any("missing" in p for p in check({k: v for k, v in disk.items() if k != "file:///c/__1_0.distcp"}))
    assert any("sha256" in p for p in check({**disk, "file:///c/__0_0.distcp": b"shard X"}))
    assert any("manifest is missing" in p for p in check({k: v for k, v in disk.items() if "manifest" not in k}))
    lying = record.model_copy(update={"global_step": 20})
    assert any("the record 20" in p for p in check(disk, [lying]))
    assert check(disk, [record.model_copy(update={"state": "FAILED", "manifest_uri": None})]) == []


# ----------------------------------------------------------------------------- lost work, resume point


def test_lost_work_is_bounded_by_one_interval() -> None:
    good = [AttemptSteps(1, "failed", 0, 27), AttemptSteps(2, "failed", 20, 35), AttemptSteps(3, "succeeded", 30, 40)]
    assert check_lost_work("j", good, 10) == []
    bad = [AttemptSteps(1, "failed", 0, 37), AttemptSteps(2, "succeeded", 20, 40)]
    assert check_lost_work("j", bad, 10) == ["job j: attempt 1 reached step 37, attempt 2 resumed at 20: "
                                            "17 steps lost > interval 10"]
    impossible = [AttemptSteps(1, "failed", 0, 5), AttemptSteps(2, "succeeded", 10, 40)]
    assert "beyond" in check_lost_work("j", impossible, 10)[0]


def test_lost_work_allows_exactly_the_one_save_in_flight_at_the_failure() -> None:
    # the save of step 30 was not durable when attempt 1 died at 37: resuming from 20 loses 17 = 10 + 7
    in_flight = [AttemptSteps(1, "failed", 0, 37, in_flight=7), AttemptSteps(2, "succeeded", 20, 40)]
    assert check_lost_work("j", in_flight, 10) == []
    # ... but not from 10: the save of step 20 was durable, the one in flight excuses one interval only
    older = [AttemptSteps(1, "failed", 0, 37, in_flight=7), AttemptSteps(2, "succeeded", 10, 40)]
    assert check_lost_work("j", older, 10) == [
        "job j: attempt 1 reached step 37, attempt 2 resumed at 10: 27 steps lost > interval 10 "
        "+ 7 (the save of step 30 in flight)"]
    # an attempt that trained on for 99 steps without any READY checkpoint is a violation, whatever lagged
    stalled = [AttemptSteps(1, "failed", 0, 99, in_flight=9), AttemptSteps(2, "succeeded", 0, 150)]
    assert len(check_lost_work("j", stalled, 10)) == 1


def test_checkpoints_must_settle_within_a_bound_after_a_fault_heals() -> None:
    assert check_settled_after_heal("broker", {}, 1.5, 30) == []
    assert check_settled_after_heal("redis", {"job-1": ["step-000000040-a1 (PENDING)"]}, 30.2, 30) == [
        "job job-1: step-000000040-a1 (PENDING) neither READY nor FAILED 30s after the redis fault healed "
        "(bound 30s)"]


def test_an_attempt_must_resume_from_the_latest_ready_checkpoint() -> None:
    ckpts = [CheckpointRecord(job_id="j", tenant="t", attempt=1, epoch=1, global_step=s, world_size=2,
                              state="READY", ready_at=T0 + timedelta(seconds=s)) for s in (10, 20)]
    ok = job(attempts=[attempt(1, 1, start=None, at=0), attempt(2, 2, start=20, at=30)])
    assert check_resumed_from_latest_ready(ok, ckpts) == []
    stale = job(attempts=[attempt(1, 1, start=None, at=0), attempt(2, 2, start=10, at=30)])
    assert check_resumed_from_latest_ready(stale, ckpts) == [
        "job j: attempt 2 started from step 10, but step 20 was READY before it was placed"]


# ----------------------------------------------------------------------------- bitwise


def test_bitwise_identity_catches_one_flipped_bit() -> None:
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ref = {"model": {"w": w}, "optimizer": {"state": {"w": {"exp_avg": w * 2, "step": torch.tensor(3.0)}}}}
    same = {"model": {"w": w.clone()}, "optimizer": {"state": {"w": {"exp_avg": w * 2, "step": torch.tensor(3.0)}}}}
    assert check_bitwise_identical(ref, same) == []
    flipped = w.clone()
    flipped.view(torch.int32)[0, 1] ^= 1  # one ulp: equal to the eye, not to the bits
    other = {"model": {"w": flipped}, "optimizer": same["optimizer"]}
    assert check_bitwise_identical(ref, other) == ["model.w: tensors differ"]
    assert check_bitwise_identical(ref, {"model": same["model"]}) == ["optimizer: missing from the resumed checkpoint"]
    neg_zero = {"model": {"w": torch.tensor([0.0])}, "optimizer": {}}
    assert check_bitwise_identical(neg_zero, {"model": {"w": torch.tensor([-0.0])}, "optimizer": {}})


# ----------------------------------------------------------------------------- one quorum per step


def _log(*lines: str) -> str:
    return "\n".join(f"2026-01-01 00:00:00,000 rank0 INFO trainyard: {line}" for line in lines)


def test_one_quorum_per_step_holds_when_a_survivor_heals_past_a_step_it_did_not_commit() -> None:
    a = ReplicaLog.parse("rank-0.log", _log(
        "committed step 1 in quorum 1 with 3 of 3 replicas", "committed step 2 in quorum 1 with 3 of 3 replicas",
        "healed from a peer at step 3", "committed step 4 in quorum 3 with 2 of 3 replicas"))
    b = ReplicaLog.parse("rank-1.log", _log(
        "committed step 1 in quorum 1 with 3 of 3 replicas", "committed step 2 in quorum 1 with 3 of 3 replicas",
        "committed step 3 in quorum 2 with 3 of 3 replicas", "committed step 4 in quorum 3 with 2 of 3 replicas"))
    assert a.commits == ((1, "1"), (2, "1"), (4, "3")) and a.heals == (3,)
    assert check_one_quorum_per_step([a, b]) == []


def test_one_quorum_per_step_catches_a_split_and_a_replayed_step() -> None:
    split = [ReplicaLog("rank-0.log", ((1, "1"), (2, "1")), ()), ReplicaLog("rank-1.log", ((1, "1"), (2, "2")), ())]
    assert check_one_quorum_per_step(split) == ["step 2 was applied by 2 quorums: quorum 1 (rank-0.log); "
                                                "quorum 2 (rank-1.log)"]
    replayed = [ReplicaLog("rank-0.log", ((1, "1"), (2, "1"), (2, "2")), ())]
    assert "rank-0.log applied step 2 after step 2" in check_one_quorum_per_step(replayed)[0]
    jumped = [ReplicaLog("rank-0.log", ((1, "1"), (5, "1")), ())]
    assert check_one_quorum_per_step(jumped) == ["rank-0.log went from step 1 to 5 without healing"]
