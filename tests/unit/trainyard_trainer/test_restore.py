"""Which checkpoint a resuming attempt loads: the start checkpoint if it verifies, else the
newest earlier READY one; never a directory without a manifest; an error when none verifies."""

from pathlib import Path

import pytest

from trainyard_contract.errors import CheckpointCorruptError
from trainyard_contract.events import CheckpointRef
from trainyard_contract.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_contract.storage import atomic_write_bytes, path_to_uri, sha256_file
from trainyard import checkpoint as ckpt
from trainyard.checkpoint import (
    Candidate,
    choose_checkpoint,
    find_ready_checkpoints,
    requested_candidate,
    verify_files_shared,
)


def cand(step: int | None, attempt: int = 1, problems: tuple[str, ...] = ()) -> Candidate:
    return Candidate(f"file:///c/step-{step}-a{attempt}/manifest.json", step, attempt, problems=problems)


def verifier(bad: set[int]):
    seen: list[int | None] = []

    def verify(c: Candidate) -> list[str]:
        seen.append(c.global_step)
        return [f"step {c.global_step} is corrupt"] if c.global_step in bad else []

    return verify, seen


def test_no_start_checkpoint_starts_fresh_without_looking() -> None:
    verify, seen = verifier(set())
    choice = choose_checkpoint(None, [cand(4)], verify)
    assert choice.candidate is None and "step 0" in choice.reason and seen == []


def test_a_verified_start_checkpoint_is_used() -> None:
    verify, seen = verifier(set())
    choice = choose_checkpoint(cand(6), [cand(6), cand(4)], verify)
    assert choice.candidate == cand(6) and not choice.fell_back and seen == [6]
    assert "start checkpoint (step 6) verified" in choice.reason


def test_falls_back_to_the_newest_earlier_checkpoint_that_verifies() -> None:
    verify, seen = verifier({6, 4})
    available = [cand(8), cand(6), cand(4, attempt=2), cand(4), cand(2)]  # newest first
    choice = choose_checkpoint(cand(6), available, verify)
    assert choice.candidate == cand(2)
    assert seen == [6, 4, 4, 2]  # the newer step 8 was not READY when the scheduler chose: skipped
    assert [r.global_step for r in choice.refused] == [6, 4, 4]
    assert "step 6" in choice.reason and "step 6 is corrupt" in choice.reason
    assert "fell back to the previous READY checkpoint, step 2" in choice.reason and "2 more refused" in choice.reason


def test_an_unreadable_start_manifest_is_refused_without_verifying_it() -> None:
    verify, seen = verifier(set())
    choice = choose_checkpoint(cand(6, problems=("manifest not found",)), [cand(4)], verify)
    assert choice.candidate == cand(4) and seen == [4]
    assert choice.refused[0].problems == ["manifest not found"]


def test_none_verifying_is_a_corrupt_checkpoint_error_naming_each() -> None:
    verify, _ = verifier({6, 4})
    with pytest.raises(CheckpointCorruptError, match="no checkpoint of this job verifies: step 6 .* step 4"):
        choose_checkpoint(cand(6), [cand(6), cand(4), cand(None, problems=("malformed",))], verify)


# ----------------------------------------------------------------------------- on disk


def write_checkpoint(root: Path, step: int, attempt: int = 1, world: int = 2, *, manifest: bool = True) -> Path:
    directory = root / f"step-{step:09d}-a{attempt}"
    directory.mkdir(parents=True)
    shards = []
    for rank in range(world):
        path = directory / f"__{rank}_0.distcp"
        path.write_bytes(bytes([step, rank]) * (100 + rank))
        shards.append(ShardEntry(rank=rank, uri=path_to_uri(path), size_bytes=path.stat().st_size,
                                 sha256=sha256_file(path)))
    m = CheckpointManifest(job_id="j", tenant="t", attempt=attempt, epoch=1, global_step=step, world_size=world,
                           shards=shards, content_hash=content_hash(shards))
    if manifest:
        atomic_write_bytes(directory / "manifest.json", m.to_bytes())
    return directory / "manifest.json"


def test_find_ready_checkpoints_lists_manifests_newest_first(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4)
    write_checkpoint(tmp_path, 4, attempt=2)
    write_checkpoint(tmp_path, 6, manifest=False)  # an unfinished or unverified save: never a candidate
    (tmp_path / "step-000000008-a1.tmp").mkdir()
    broken = tmp_path / "step-000000005-a1"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    found = find_ready_checkpoints(tmp_path)
    assert [(c.global_step, c.attempt) for c in found] == [(4, 2), (4, 1), (2, 1), (None, None)]
    assert found[-1].problems and "malformed" in found[-1].problems[0]
    assert find_ready_checkpoints(tmp_path / "missing") == []


def test_requested_candidate_checks_the_ref(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, 4)
    good = requested_candidate(CheckpointRef(manifest_uri=path_to_uri(path), global_step=4, attempt=1))
    assert good.manifest is not None and good.problems == ()
    wrong = requested_candidate(CheckpointRef(manifest_uri=path_to_uri(path), global_step=6, attempt=1))
    assert wrong.manifest is None and wrong.global_step == 6 and "expected 6" in wrong.problems[0]


def test_verification_is_split_over_the_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_checkpoint(tmp_path, 4, world=4)
    manifest = CheckpointManifest.model_validate_json(path.read_bytes())
    shard2 = tmp_path / "step-000000004-a1" / "__2_0.distcp"
    shard2.write_bytes(b"x" + shard2.read_bytes()[1:])  # same size, other bytes

    hashed: dict[int, list[str]] = {}
    real = ckpt.local_sha256
    for rank in range(2):
        reads: list[str] = []
        monkeypatch.setattr(ckpt, "local_sha256", lambda uri, reads=reads: reads.append(uri) or real(uri))
        local = verify_files_shared(manifest, rank=rank, world_size=2, gather=lambda problems: [problems])
        hashed[rank] = [Path(u).name for u in reads]
        assert bool(local) is (rank == 0)  # rank 0 reads shards 0 and 2: it finds the damage
    assert hashed == {0: ["__0_0.distcp", "__2_0.distcp"], 1: ["__1_0.distcp", "__3_0.distcp"]}

    # gathered, every rank ends with the same findings
    found = verify_files_shared(manifest, rank=1, world_size=2,
                                gather=lambda mine: [["rank 2 shard sha256 differs"], mine])
    assert found == ["rank 2 shard sha256 differs"]
    assert any("rank 2 shard sha256" in p for p in verify_files_shared(manifest, rank=0, world_size=1))
