"""Checkpoints under an ``s3://`` artifact root, against a real S3 HTTP endpoint (moto's server):
two gloo ranks save through DCP's fsspec writer (hashing as they upload), the coordinator's
verification reads the objects, the manifest written last commits, a restore verifies then loads
bitwise, a corrupted object is refused, and garbage collection deletes the objects."""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.objectstore import moto_s3
from trainyard.checkpoint import (
    Checkpointer,
    NoVerifiedCheckpointError,
    checkpoint_dir_of,
    choose_checkpoint,
    find_ready_checkpoints,
    load_checkpoint,
    requested_candidate,
    save_checkpoint,
    verify_files_shared,
)
from trainyard_checkpoint_coordinator.collector import _remove_tree, list_directories
from trainyard_checkpoint_coordinator.coordinator import _verify
from trainyard_contract.errors import CheckpointError
from trainyard_contract.events import CheckpointRef, FileDigest
from trainyard_contract.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_contract.settings import ServiceSettings
from trainyard_contract.storage import (
    ArtifactLayout,
    ObjectPath,
    commit_bytes,
    glob,
    list_children,
    object_filesystem,
    read_bytes,
    sha256_of,
)

WORLD = 2
STEP = 3


@pytest.fixture(scope="module")
def s3_root() -> Iterator[str]:
    with moto_s3() as root:
        yield root


def _state(seed: int) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    class App(Stateful):
        def state_dict(self) -> dict[str, Any]:
            model_sd, opt_sd = get_state_dict(model, opt)
            return {"model": model_sd, "optim": opt_sd}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    return {"app": App()}, model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Two steps, the same on every rank (replicated, as data parallelism keeps it: DCP writes each
    replicated tensor once)."""
    torch.manual_seed(100)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, entry in opt.state_dict()["state"].items():
        flat.update({f"optim.{index}.{k}": torch.as_tensor(v).clone() for k, v in entry.items()})
    return flat


def _rank_main(rank: int, mode: str, init_file: str, url: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        layout = ArtifactLayout(url)
        directory = layout.checkpoint_dir("t", "job-s3", 1, STEP)
        if mode == "save":
            state, model, opt = _state(seed=1)
            _train(model, opt)
            saved = save_checkpoint(state, directory, rank=rank, barrier=dist.barrier)
            Path(out, f"saved-{rank}.json").write_text(json.dumps({
                "shard": saved.shard.model_dump(mode="json"),
                "extra": [f.model_dump(mode="json") for f in saved.extra_files]}))
            torch.save(_snapshot(model, opt), Path(out, f"state-{rank}.pt"))
            return
        state, model, opt = _state(seed=2)
        _train(model, opt)  # same shapes, other values: the load must replace all of them
        ref = CheckpointRef(manifest_uri=str(directory / "manifest.json"), global_step=STEP, attempt=1)

        def gather(problems: list[str]) -> list[list[str]]:
            found: list[Any] = [None] * WORLD
            dist.all_gather_object(found, problems)
            return found

        def verify(candidate: Any) -> list[str]:
            return verify_files_shared(candidate.manifest, rank=rank, world_size=WORLD, gather=gather)

        available = find_ready_checkpoints(layout.checkpoints_dir("t", "job-s3"))
        choice = choose_checkpoint(requested_candidate(ref), available, verify)
        assert choice.candidate is not None and not choice.refused
        load_checkpoint(state, checkpoint_dir_of(choice.candidate.manifest, choice.candidate.manifest_uri))
        torch.save(_snapshot(model, opt), Path(out, f"restored-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_ranks(mode: str, tmp_path: Path, url: str) -> None:
    ctx = mp.get_context("spawn")  # the ranks inherit the AWS_* configuration of the moto endpoint
    init_file = tmp_path / f"pg-{mode}"
    procs = [ctx.Process(target=_rank_main, args=(r, mode, str(init_file), url, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0] * WORLD, f"{mode} ranks failed"


def _manifest(tmp_path: Path) -> CheckpointManifest:
    shards, extra = [], []
    for rank in range(WORLD):
        doc = json.loads((tmp_path / f"saved-{rank}.json").read_text())
        d = FileDigest.model_validate(doc["shard"])
        shards.append(ShardEntry(rank=rank, uri=d.uri, size_bytes=d.size_bytes, sha256=d.sha256))
        extra += [FileDigest.model_validate(f) for f in doc["extra"]]
    return CheckpointManifest(job_id="job-s3", tenant="t", attempt=1, epoch=1, global_step=STEP,
                              world_size=WORLD, shards=shards, extra_files=extra,
                              content_hash=content_hash(shards, extra))


def test_an_object_store_root_is_a_url_and_a_local_one_stays_a_path() -> None:
    assert ServiceSettings(artifact_root="s3://bucket/prefix/").artifact_root_abs == ObjectPath("s3", "bucket/prefix")
    assert isinstance(ServiceSettings().artifact_root, Path)
    layout = ArtifactLayout("s3://bucket/prefix")
    assert str(layout.checkpoint_dir("t", "j", 2, 40)) == "s3://bucket/prefix/tenants/t/jobs/j/checkpoints/step-000000040-a2"
    assert str(layout.code_archive("t", "ab")) == "s3://bucket/prefix/tenants/t/code/sha256/ab.tar.gz"
    with pytest.raises(ValueError):
        ObjectPath.parse("s3://bucket") / "../../other"


def test_two_ranks_save_to_s3_verify_commit_restore_bitwise_and_refuse_a_corrupted_object(
    s3_root: str, tmp_path: Path
) -> None:
    # 1. save: each rank uploads its shard under the final prefix, hashing as it streams
    _run_ranks("save", tmp_path, s3_root)
    directory = ArtifactLayout(s3_root).checkpoint_dir("t", "job-s3", 1, STEP)
    names = sorted(c.name for c in list_children(directory))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # nothing renamed, no .tmp left
    manifest = _manifest(tmp_path)
    for entry in [*manifest.shards, *manifest.extra_files]:  # the streamed digests are the objects'
        assert entry.uri.startswith("s3://") and sha256_of(ObjectPath.parse(entry.uri)) == entry.sha256
    # no manifest yet: not a candidate for any restore
    assert find_ready_checkpoints(ArtifactLayout(s3_root).checkpoints_dir("t", "job-s3")) == []

    # 2. the coordinator verifies the objects, then the manifest, written last, commits
    assert _verify(manifest) == []
    commit_bytes(directory / "manifest.json", manifest.to_bytes())
    assert CheckpointManifest.model_validate_json(read_bytes(directory / "manifest.json")) == manifest

    # 3. restore on two fresh ranks: verified (hashing split over the ranks), then loaded bitwise
    _run_ranks("restore", tmp_path, s3_root)
    for rank in range(WORLD):
        saved, restored = (torch.load(tmp_path / f"{k}-{rank}.pt") for k in ("state", "restored"))
        assert saved.keys() == restored.keys() and len(saved) > 4
        for key in saved:
            assert torch.equal(saved[key], restored[key]), (rank, key)

    # 4. one flipped byte in rank 1's object: the coordinator and a restore refuse it
    shard = ObjectPath.parse(manifest.shards[1].uri)
    data = bytearray(read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    commit_bytes(shard, bytes(data))
    assert any("rank 1 shard sha256" in p for p in _verify(manifest))
    ref = CheckpointRef(manifest_uri=str(directory / "manifest.json"), global_step=STEP, attempt=1)
    with pytest.raises(NoVerifiedCheckpointError, match="rank 1 shard sha256"):
        choose_checkpoint(requested_candidate(ref), [],
                          lambda c: verify_files_shared(c.manifest, rank=0, world_size=1))

    # 5. garbage collection lists prefixes and deletes objects, never outside the job's checkpoints
    checkpoints = ArtifactLayout(s3_root).checkpoints_dir("t", "job-s3")
    (found,) = list_directories(checkpoints, now=1e12)
    assert found.name == directory.name and found.age_s > 0
    _remove_tree(directory, ArtifactLayout(s3_root).checkpoints_dir("t", "other-job"))
    assert glob(checkpoints, "*/manifest.json")  # refused: not inside that root
    _remove_tree(directory, checkpoints)
    assert list_children(directory) == [] and list_directories(checkpoints, now=1e12) == []


def test_async_save_to_s3_reports_streamed_digests_and_never_overwrites_a_committed_checkpoint(
    s3_root: str, world_of_one: None
) -> None:
    state, model, opt = _state(seed=3)
    _train(model, opt)
    directory = ArtifactLayout(s3_root).checkpoint_dir("t", "job-async", 1, 1)
    commit_bytes(directory / "__0_0.distcp", b"left by an interrupted save")  # no manifest: cleared
    reported = []
    checkpointer = Checkpointer(rank=0, mode="async", barrier=dist.barrier, agree=list,
                                group=dist.new_group(backend="gloo"))
    checkpointer.save(state, directory, reported.append)
    checkpointer.wait()
    (saved,) = reported
    assert saved.shard.uri == str(directory / "__0_0.distcp")
    assert saved.shard.sha256 == sha256_of(directory / "__0_0.distcp")
    assert [f.uri for f in saved.extra_files] == [str(directory / ".metadata")]
    assert object_filesystem(directory).size(directory.path + "/__0_0.distcp") == saved.shard.size_bytes

    shards = [ShardEntry(rank=0, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes, sha256=saved.shard.sha256)]
    commit_bytes(directory / "manifest.json", CheckpointManifest(
        job_id="job-async", tenant="t", attempt=1, epoch=1, global_step=1, world_size=1, shards=shards,
        extra_files=saved.extra_files, content_hash=content_hash(shards, saved.extra_files)).to_bytes())
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(state, directory, rank=0, barrier=dist.barrier)
    assert sha256_of(directory / "__0_0.distcp") == saved.shard.sha256
