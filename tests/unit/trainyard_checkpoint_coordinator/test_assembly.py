"""The checkpoint protocol's pure decisions: one report, the set of reports, the manifest."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import pytest

from trainyard_checkpoint_coordinator.assembly import (
    CheckpointKey,
    Complete,
    JobDefaults,
    Rejected,
    ShardReport,
    ShardVerdict,
    Waiting,
    assess,
    build_manifest,
    classify_shard,
    common_directory,
    describe_conflict,
    is_expired,
    parallel_layout,
    pending_record,
    settle_failed,
    settle_ready,
    settled_event,
)
from trainyard_contract.events import CheckpointFailed, CheckpointReady, FileDigest, ShardWritten, TensorDigest
from trainyard_contract.manifest import ParallelLayout, ShardEntry, content_hash, tensors_hash, verify_manifest

NOW = datetime(2026, 1, 1, tzinfo=UTC)
KEY = CheckpointKey("job-1", attempt=1, global_step=40)
DIR = "file:///art/tenants/t/jobs/job-1/checkpoints/step-000000040-a1"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


META = FileDigest(uri=f"{DIR}/.metadata", size_bytes=7, sha256=sha("meta"))


def report(rank: int, *, world: int = 2, epoch: int = 3, content: str | None = None, **kw: object) -> ShardReport:
    fields: dict[str, object] = dict(
        tenant="t", epoch=epoch, rank=rank, world_size=world, uri=f"{DIR}/__{rank}_0.distcp",
        size_bytes=100 + rank, sha256=sha(content or f"shard-{rank}"), consumed_tokens=5120,
        consumed_samples=80, spec_hash="sha256:spec", parallelism=(("dp", world),),
        extra_files=(META,) if rank == 0 else (),
    )
    fields.update(kw)
    return ShardReport(**fields)  # type: ignore[arg-type]  # a str for a Literal field


T_W = TensorDigest(key="model.w", offset=[0, 0], sha256=sha("w"))
T_B = TensorDigest(key="model.b", offset=[0], sha256=sha("b"))
T_RNG0 = TensorDigest(key="rng.rank_0.python", offset=[], sha256=sha("rng0"))
T_RNG1 = TensorDigest(key="rng.rank_1.python", offset=[], sha256=sha("rng1"))


# --------------------------------------------------------------------------- one report


@pytest.mark.parametrize(
    ("case", "incoming", "current_epoch", "existing", "expected"),
    [
        ("first report of a rank", report(1), 3, None, ShardVerdict.NEW),
        ("duplicate rank, same content", report(1), 3, report(1), ShardVerdict.DUPLICATE),
        ("duplicate rank, different content", report(1, content="other"), 3, report(1), ShardVerdict.CONFLICT),
        ("duplicate rank, other size", report(1, size_bytes=999), 3, report(1), ShardVerdict.CONFLICT),
        ("stale epoch (zombie attempt)", report(1, epoch=2), 3, None, ShardVerdict.STALE),
        ("stale epoch wins over duplicate", report(1, epoch=2), 3, report(1, epoch=2), ShardVerdict.STALE),
        ("newer epoch than recorded is fine", report(1, epoch=4), 3, None, ShardVerdict.NEW),
        ("no epoch recorded yet", report(1, epoch=1), 0, None, ShardVerdict.NEW),
    ],
)
def test_classify_shard(case: str, incoming: ShardReport, current_epoch: int,
                        existing: ShardReport | None, expected: ShardVerdict) -> None:
    assert classify_shard(incoming, current_epoch=current_epoch, existing=existing) is expected, case


def test_a_redelivered_event_is_the_same_report() -> None:
    event = ShardWritten(job_id="job-1", tenant="t", attempt=1, epoch=3, global_step=40, rank=0, world_size=2,
                         uri=f"{DIR}/__0_0.distcp", size_bytes=100, sha256=sha("x"),
                         extra_files=[META], parallelism={"dp": 2, "tp": 1})
    again = event.model_copy(update={"event_id": ShardWritten.model_fields["event_id"].default_factory()})
    first = ShardReport.from_event(event)
    assert ShardReport.from_event(again) == first
    assert ShardReport.loads(first.dumps()) == first  # survives the round trip through Redis


def test_describe_conflict_names_the_fields() -> None:
    text = describe_conflict(report(1), report(1, content="other", size_bytes=7))
    assert "rank 1" in text and "sha256" in text and "size_bytes" in text


# --------------------------------------------------------------------------- the set of reports


def run(reports: dict[int, ShardReport], *, world: int = 2, epoch: int = 3):
    return assess(KEY, reports, world_size=world, current_epoch=epoch, created_at=NOW)


@pytest.mark.parametrize(
    ("case", "reports", "world", "epoch", "expected"),
    [
        ("nothing yet", {}, 2, 3, Waiting((0, 1))),
        ("missing rank 1", {0: report(0)}, 2, 3, Waiting((1,))),
        ("missing rank 0 of 4", {1: report(1, world=4), 2: report(2, world=4), 3: report(3, world=4)}, 4, 3,
         Waiting((0,))),
        ("all ranks", {0: report(0), 1: report(1)}, 2, 3, Complete),
        ("world-size disagreement", {0: report(0), 1: report(1, world=3)}, 2, 3, "world size"),
        ("rank outside the world", {0: report(0), 2: report(2)}, 2, 3, "outside a world of 2"),
        ("epochs mixed", {0: report(0, epoch=3), 1: report(1, epoch=4)}, 2, 3, "different fencing epochs"),
        ("fenced after recording", {0: report(0), 1: report(1)}, 2, 4, "fenced"),
        ("fenced while waiting", {0: report(0)}, 2, 4, "fenced"),
        ("spec hash disagreement", {0: report(0), 1: report(1, spec_hash="sha256:other")}, 2, 3, "spec hash"),
        ("tenant disagreement", {0: report(0), 1: report(1, tenant="u")}, 2, 3, "tenant"),
        ("shared file disagreement",
         {0: report(0), 1: report(1, extra_files=(META.model_copy(update={"sha256": sha("x")}),))}, 2, 3,
         "shared file"),
        ("shards in two directories", {0: report(0), 1: report(1, uri="file:///elsewhere/__1_0.distcp")}, 2, 3,
         "one checkpoint directory"),
        ("entry digests that agree", {0: report(0, tensors=(T_W, T_RNG0)), 1: report(1, tensors=(T_W, T_RNG1))},
         2, 3, Complete),
        ("one entry with two digests",
         {0: report(0, tensors=(T_W, T_RNG0)), 1: report(1, tensors=(T_W.model_copy(update={"sha256": sha("y")}),))},
         2, 3, "different digests for the same saved entry: model.w@[0, 0]"),
    ],
)
def test_assess(case: str, reports: dict[int, ShardReport], world: int, epoch: int, expected: object) -> None:
    outcome = run(reports, world=world, epoch=epoch)
    if isinstance(expected, Waiting):
        assert outcome == expected, case
    elif expected is Complete:
        assert isinstance(outcome, Complete), (case, outcome)
    else:
        assert isinstance(outcome, Rejected), (case, outcome)
        assert expected in outcome.reason, (case, outcome.reason)


def test_complete_set_builds_the_manifest_next_to_the_shards() -> None:
    outcome = run({1: report(1), 0: report(0)})
    assert isinstance(outcome, Complete)
    m = outcome.manifest
    assert outcome.directory_uri == DIR
    assert outcome.manifest_uri == f"{DIR}/manifest.json"
    assert (m.job_id, m.tenant, m.attempt, m.epoch, m.global_step, m.world_size) == ("job-1", "t", 1, 3, 40, 2)
    assert [s.rank for s in m.shards] == [0, 1]
    assert m.shards[1] == ShardEntry(rank=1, uri=f"{DIR}/__1_0.distcp", size_bytes=101, sha256=sha("shard-1"))
    assert m.extra_files == [META]
    assert (m.consumed_tokens, m.consumed_samples, m.spec_hash) == (5120, 80, "sha256:spec")
    assert m.parallelism == ParallelLayout(dp=2)
    assert m.content_hash == content_hash(m.shards, m.extra_files)
    assert m.created_at == NOW


def test_content_hash_depends_on_every_shard_digest() -> None:
    base = build_manifest(KEY, {0: report(0), 1: report(1)}, created_at=NOW)
    changed = build_manifest(KEY, {0: report(0), 1: report(1, content="x")}, created_at=NOW)
    moved = build_manifest(
        KEY, {r: report(r, uri=f"file:///copy/__{r}_0.distcp") for r in (0, 1)}, created_at=NOW)
    assert base.content_hash.startswith("sha256:")
    assert base.content_hash != changed.content_hash
    assert base.content_hash == moved.content_hash  # location-independent


@pytest.mark.parametrize(
    ("case", "left", "right", "equal"),
    [
        ("the same entries written by the same ranks", {0: (T_W, T_RNG0), 1: (T_B, T_RNG1)},
         {0: (T_W, T_RNG0), 1: (T_B, T_RNG1)}, True),
        ("DCP gave a replicated entry to the other rank", {0: (T_W, T_B, T_RNG0), 1: (T_RNG1,)},
         {0: (T_RNG0,), 1: (T_RNG1, T_B, T_W)}, True),
        ("a replicated entry reported by both ranks", {0: (T_W, T_RNG0), 1: (T_RNG1,)},
         {0: (T_W, T_RNG0), 1: (T_W, T_RNG1)}, True),
        ("one weight differs", {0: (T_W, T_RNG0), 1: (T_B, T_RNG1)},
         {0: (T_W, T_RNG0), 1: (T_B.model_copy(update={"sha256": sha("b'")}), T_RNG1)}, False),
        ("one rank's RNG differs", {0: (T_W, T_RNG0), 1: (T_RNG1,)},
         {0: (T_W, T_RNG0), 1: (T_RNG1.model_copy(update={"sha256": sha("rng1'")}),)}, False),
    ],
)
def test_tensors_hash_combines_every_ranks_entries(
    case: str, left: dict[int, tuple[TensorDigest, ...]], right: dict[int, tuple[TensorDigest, ...]], equal: bool
) -> None:
    a = build_manifest(KEY, {r: report(r, tensors=t) for r, t in left.items()}, created_at=NOW)
    b = build_manifest(KEY, {r: report(r, tensors=t) for r, t in right.items()}, created_at=NOW)
    assert a.tensors_hash is not None and a.tensors_hash == tensors_hash(a.tensors)
    assert [(t.key, t.offset) for t in a.tensors] == sorted((t.key, t.offset) for t in a.tensors)  # canonical order
    assert len({(t.key, tuple(t.offset)) for t in a.tensors}) == len(a.tensors)  # each entry once
    assert (a.tensors_hash == b.tensors_hash) is equal, case
    assert a.content_hash == b.content_hash  # the files' hash does not look at the entries


def test_tensors_hash_is_independent_of_the_files_and_dcp_metadata() -> None:
    """The problem users hit: bitwise-identical saves have different .metadata, so a different contentHash."""
    first = build_manifest(KEY, {0: report(0, tensors=(T_W, T_RNG0)), 1: report(1, tensors=(T_RNG1,))},
                           created_at=NOW)
    other_meta = META.model_copy(update={"sha256": sha("another save id")})
    second = build_manifest(KEY, {0: report(0, tensors=(T_W, T_RNG0), extra_files=(other_meta,)),
                                  1: report(1, tensors=(T_RNG1,), content="other bytes")}, created_at=NOW)
    assert first.content_hash != second.content_hash
    assert first.tensors_hash == second.tensors_hash


def test_no_tensors_hash_unless_every_rank_reported_its_entries() -> None:
    partial = build_manifest(KEY, {0: report(0, tensors=(T_W, T_RNG0)), 1: report(1)}, created_at=NOW)
    assert partial.tensors_hash is None and partial.tensors == []
    legacy = build_manifest(KEY, {0: report(0), 1: report(1)}, created_at=NOW)
    assert legacy.tensors_hash is None and legacy.tensors == []
    # a rank that wrote no entry of its own (all de-duplicated to others) reported an empty list: that is complete
    empty = build_manifest(KEY, {0: report(0, tensors=(T_W,)), 1: report(1, tensors=())}, created_at=NOW)
    assert empty.tensors_hash == tensors_hash([T_W])


def test_the_entries_travel_from_the_event_through_redis() -> None:
    event = ShardWritten(job_id="job-1", tenant="t", attempt=1, epoch=3, global_step=40, rank=0, world_size=2,
                         uri=f"{DIR}/__0_0.distcp", size_bytes=100, sha256=sha("x"), tensor_digests=[T_RNG0, T_W])
    first = ShardReport.from_event(event)
    assert first.tensors == (T_W, T_RNG0)  # sorted: a re-delivery in another order is the same report
    assert ShardReport.loads(first.dumps()) == first
    reordered = ShardReport.from_event(event.model_copy(update={"tensor_digests": [T_W, T_RNG0]}))
    assert classify_shard(reordered, current_epoch=3, existing=first) is ShardVerdict.DUPLICATE
    changed = ShardReport.from_event(event.model_copy(update={"tensor_digests": [T_W]}))
    assert classify_shard(changed, current_epoch=3, existing=first) is ShardVerdict.CONFLICT
    assert "tensors" in describe_conflict(first, changed)
    assert ShardReport.from_event(event.model_copy(update={"tensor_digests": None})).tensors is None


def test_the_draft_manifest_verifies_against_matching_files_only() -> None:
    m = build_manifest(KEY, {0: report(0), 1: report(1)}, created_at=NOW)
    files = {s.uri: (s.size_bytes, s.sha256) for s in m.shards} | {META.uri: (META.size_bytes, META.sha256)}
    ok = verify_manifest(m, stat_size=lambda u: files[u][0] if u in files else None,
                         file_sha256=lambda u: files[u][1])
    assert ok == []
    files[m.shards[1].uri] = (101, sha("flipped"))
    bad = verify_manifest(m, stat_size=lambda u: files[u][0], file_sha256=lambda u: files[u][1])
    assert len(bad) == 1 and "rank 1" in bad[0]


def test_job_defaults_fill_what_the_shards_leave_out() -> None:
    bare = {r: report(r, spec_hash=None, parallelism=()) for r in (0, 1)}
    m = build_manifest(KEY, bare, created_at=NOW,
                       defaults=JobDefaults(spec_hash="sha256:job", parallelism=ParallelLayout(dp=1, tp=2)))
    assert m.spec_hash == "sha256:job" and m.parallelism == ParallelLayout(dp=1, tp=2)
    assert build_manifest(KEY, bare, created_at=NOW).parallelism == ParallelLayout(dp=2)


@pytest.mark.parametrize(
    ("reported", "expected"),
    [({"dp": 2, "tp": 2}, ParallelLayout(dp=2, tp=2)),
     ({"data": 4, "pipeline": 2}, ParallelLayout(dp=4, pp=2)),
     ({}, ParallelLayout(dp=8))],
)
def test_parallel_layout(reported: dict[str, int], expected: ParallelLayout) -> None:
    assert parallel_layout(reported, 8) == expected


def test_common_directory() -> None:
    assert common_directory([f"{DIR}/a", f"{DIR}/b"]) == DIR
    assert common_directory([f"{DIR}/a", "file:///x/b"]) is None


# --------------------------------------------------------------------------- records and time


def test_ready_record_and_its_event() -> None:
    outcome = run({0: report(0), 1: report(1)})
    assert isinstance(outcome, Complete)
    pending = pending_record(KEY, report(0), now=NOW)
    assert pending.state == "PENDING" and pending.checkpoint_id == "step-000000040-a1"
    ready = settle_ready(pending, outcome, current_epoch=3, now=NOW)
    assert ready.state == "READY" and ready.manifest_uri == outcome.manifest_uri and ready.ready_at == NOW
    assert ready.size_bytes == 100 + 101 + META.size_bytes  # both shards and the shared .metadata
    assert pending.size_bytes is None
    event = settled_event(ready, NOW)
    assert isinstance(event, CheckpointReady)
    assert (event.job_id, event.attempt, event.epoch, event.global_step, event.world_size) == ("job-1", 1, 3, 40, 2)
    assert event.content_hash == outcome.manifest.content_hash and event.consumed_tokens == 5120
    assert event.occurred_at == NOW
    assert ready.tensors_hash is None and event.tensors_hash is None  # the ranks reported no entries


def test_the_ready_record_and_event_carry_the_tensors_hash() -> None:
    outcome = run({0: report(0, tensors=(T_W, T_RNG0)), 1: report(1, tensors=(T_RNG1,))})
    assert isinstance(outcome, Complete)
    ready = settle_ready(pending_record(KEY, report(0), now=NOW), outcome, current_epoch=3, now=NOW)
    assert ready.tensors_hash == outcome.manifest.tensors_hash == tensors_hash([T_W, T_RNG0, T_RNG1])
    event = settled_event(ready, NOW)
    assert isinstance(event, CheckpointReady) and event.tensors_hash == ready.tensors_hash
    assert event.content_hash == ready.content_hash != ready.tensors_hash


def test_a_newer_epoch_between_verification_and_ready_fails_the_checkpoint() -> None:
    outcome = run({0: report(0), 1: report(1)})
    assert isinstance(outcome, Complete)
    settled = settle_ready(pending_record(KEY, report(0), now=NOW), outcome, current_epoch=4, now=NOW)
    assert settled.state == "FAILED" and "fenced" in (settled.reason or "")
    assert isinstance(settled_event(settled, NOW), CheckpointFailed)


def test_failed_record_and_its_event() -> None:
    failed = settle_failed(pending_record(KEY, report(0), now=NOW), "rank 1 shard is missing")
    event = settled_event(failed, NOW)
    assert isinstance(event, CheckpointFailed)
    assert (event.job_id, event.attempt, event.global_step, event.reason) == ("job-1", 1, 40, "rank 1 shard is missing")


@pytest.mark.parametrize(("age_s", "expired"), [(0, False), (59, False), (60, False), (61, True)])
def test_is_expired(age_s: int, expired: bool) -> None:
    assert is_expired(NOW - timedelta(seconds=age_s), now=NOW, timeout_s=60) is expired
