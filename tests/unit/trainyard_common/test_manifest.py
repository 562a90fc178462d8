"""Manifest verification is pure: file access is injected."""

from __future__ import annotations

from trainyard_common.events import FileDigest
from trainyard_common.manifest import CheckpointManifest, ShardEntry, content_hash, verify_manifest

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
