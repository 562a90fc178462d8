"""Manifest verification is pure: file access is injected."""

from __future__ import annotations

import hashlib

import pytest

from trainyard_contract.events import FileDigest, TensorDigest
from trainyard_contract.manifest import (
    CheckpointManifest,
    ShardEntry,
    conflicting_tensors,
    content_hash,
    tensors_hash,
    verify_manifest,
)

A, B, M = "a" * 64, "b" * 64, "c" * 64


def manifest(shards: list[ShardEntry], world: int = 2, extra: list[FileDigest] | None = None,
             chash: str | None = None) -> CheckpointManifest:
    extra = extra or []
    return CheckpointManifest(job_id="j", tenant="t", attempt=1, epoch=1, global_step=10, world_size=world,
                              shards=shards, extra_files=extra, content_hash=chash or content_hash(shards, extra))


SHARDS = [ShardEntry(rank=0, uri="file:///c/__0_0.distcp", size_bytes=10, sha256=A),
          ShardEntry(rank=1, uri="file:///c/__1_0.distcp", size_bytes=20, sha256=B)]
META = [FileDigest(uri="file:///c/.metadata", size_bytes=5, sha256=M)]
FILES = {"file:///c/__0_0.distcp": (10, A), "file:///c/__1_0.distcp": (20, B), "file:///c/.metadata": (5, M)}


def fs(files: dict[str, tuple[int, str]]):
    hashed: list[str] = []

    def stat(uri: str) -> int | None:
        return files[uri][0] if uri in files else None

    def sha(uri: str) -> str:
        hashed.append(uri)
        return files[uri][1]

    return stat, sha, hashed


def test_intact_checkpoint_has_no_problems() -> None:
    stat, sha, hashed = fs(FILES)
    assert verify_manifest(manifest(SHARDS, extra=META), stat_size=stat, file_sha256=sha) == []
    assert len(hashed) == 3


def test_missing_truncated_and_corrupt_shards_are_each_reported() -> None:
    files = dict(FILES)
    files["file:///c/__0_0.distcp"] = (9, A)  # truncated: not even hashed
    files["file:///c/__1_0.distcp"] = (20, "d" * 64)  # same size, other bytes
    del files["file:///c/.metadata"]
    stat, sha, hashed = fs(files)
    problems = verify_manifest(manifest(SHARDS, extra=META), stat_size=stat, file_sha256=sha)
    assert len(problems) == 3
    assert "rank 0 shard has 9 bytes, manifest says 10" in problems[0]
    assert "rank 1 shard sha256" in problems[1]
    assert "shared file .metadata is missing" in problems[2]
    assert "file:///c/__0_0.distcp" not in hashed


def test_missing_rank_and_wrong_content_hash() -> None:
    stat, sha, _ = fs(FILES)
    problems = verify_manifest(manifest(SHARDS[:1], world=2), stat_size=stat, file_sha256=sha)
    assert problems == ["shards cover ranks [0], expected 0..1"]
    bad = manifest(SHARDS, chash="sha256:" + "0" * 64)
    assert any("content hash" in p for p in verify_manifest(bad, stat_size=stat, file_sha256=sha))


def test_content_hash_ignores_location_but_not_content() -> None:
    moved = [s.model_copy(update={"uri": s.uri.replace("/c/", "/elsewhere/")}) for s in SHARDS]
    assert content_hash(SHARDS) == content_hash(moved)
    changed = [SHARDS[0], SHARDS[1].model_copy(update={"sha256": A})]
    assert content_hash(SHARDS) != content_hash(changed)


# ----------------------------------------------------------------------------- tensorsHash: the values, not the files

def digest(key: str, offset: list[int] | None = None, fill: str = "1") -> TensorDigest:
    return TensorDigest(key=key, offset=[0] if offset is None else offset, sha256=fill * 64)


W, W_OTHER = digest("model.w"), digest("model.w", fill="2")
B_, RNG0, RNG1 = digest("model.b"), digest("rng.rank_0.python", [], "3"), digest("rng.rank_1.python", [], "4")
CHUNK0, CHUNK1 = digest("model.w", [0, 0]), digest("model.w", [2, 0], "5")


@pytest.mark.parametrize(
    ("case", "left", "right", "equal"),
    [
        ("the same entries", [W, B_, RNG0], [W, B_, RNG0], True),
        ("in another order (another rank wrote them)", [W, B_, RNG0], [RNG0, B_, W], True),
        ("an entry reported twice identically counts once", [W, B_], [W, W, B_], True),
        ("one entry's digest differs", [W, B_], [W_OTHER, B_], False),
        ("an entry more", [W, B_], [W, B_, RNG1], False),
        ("an entry fewer", [W, B_], [W], False),
        ("the same digest under another key", [W], [W.model_copy(update={"key": "model.v"})], False),
        ("the same digest at another offset", [CHUNK0], [CHUNK0.model_copy(update={"offset": [2, 0]})], False),
        ("chunks in either order", [CHUNK0, CHUNK1], [CHUNK1, CHUNK0], True),
        ("nothing saved", [], [], True),
    ],
)
def test_tensors_hash(case: str, left: list[TensorDigest], right: list[TensorDigest], equal: bool) -> None:
    assert tensors_hash(left).startswith("sha256:") and len(tensors_hash(left)) == 7 + 64
    assert (tensors_hash(left) == tensors_hash(right)) is equal, case


def test_tensors_hash_is_a_fixed_encoding() -> None:
    """Users compare it across releases: the encoding is canonical JSON of sorted [key, offset, sha256]."""
    body = b'{"tensors":[["model.b",[0],"' + b"1" * 64 + b'"],["model.w",[0],"' + b"1" * 64 + b'"]]}'
    assert tensors_hash([W, B_]) == "sha256:" + hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize(
    ("case", "digests", "expected"),
    [
        ("agreeing reports", [W, W, B_], []),
        ("one entry, two digests", [W, B_, W_OTHER], ["model.w@[0]"]),
        ("the same key at two offsets is two entries", [CHUNK0, CHUNK1], []),
        ("sorted, each once", [RNG0, RNG0.model_copy(update={"sha256": "9" * 64}), W, W_OTHER, W_OTHER],
         ["model.w@[0]", "rng.rank_0.python@[]"]),
    ],
)
def test_conflicting_tensors(case: str, digests: list[TensorDigest], expected: list[str]) -> None:
    assert conflicting_tensors(digests) == expected, case


def test_a_tensors_hash_that_does_not_match_its_digests_is_a_problem() -> None:
    stat, sha, _ = fs(FILES)
    good = manifest(SHARDS, extra=META).model_copy(update={"tensors": [B_, W], "tensors_hash": tensors_hash([W, B_])})
    assert verify_manifest(good, stat_size=stat, file_sha256=sha) == []
    forged = good.model_copy(update={"tensors": [B_, W_OTHER]})
    (problem,) = verify_manifest(forged, stat_size=stat, file_sha256=sha)
    assert problem.startswith("tensors hash ") and "does not match its tensor digests" in problem
    # a manifest written before tensorsHash existed (or from ranks that did not report) verifies as before
    assert verify_manifest(manifest(SHARDS, extra=META), stat_size=stat, file_sha256=sha) == []


def test_tensors_survive_the_manifest_round_trip() -> None:
    m = manifest(SHARDS, extra=META).model_copy(update={"tensors": [B_, W], "tensors_hash": tensors_hash([W, B_])})
    raw = m.to_bytes()
    assert b'"tensorsHash"' in raw and b'"tensors"' in raw
    assert CheckpointManifest.model_validate_json(raw) == m
