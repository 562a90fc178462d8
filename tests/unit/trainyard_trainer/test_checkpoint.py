"""The checkpoint protocol in one process (a world of one gloo rank): save, verify, restore."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import CheckpointCorruptError, CheckpointError
from trainyard_contract.events import CheckpointRef
from trainyard_contract.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_contract.spec import LrSchedule
from trainyard_contract.storage import atomic_write_bytes, path_to_uri, sha256_file
from trainyard.checkpoint import (
    Checkpointer,
    CheckpointSchedule,
    check_restorable,
    load_checkpoint,
    read_checkpoint_manifest,
    save_checkpoint,
    verified_checkpoint_dir,
)
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import apply_ddp
from trainyard.sampler import GlobalSampler
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard.state import Progress, RngState, checkpoint_state


@pytest.mark.parametrize(("every_steps", "every_minutes", "step", "elapsed_min", "due"), [
    (3, None, 3, 0, True), (3, None, 4, 0, False), (3, None, 10, 0, True),  # 10 = maxSteps
    (None, 2.0, 1, 1.9, False), (None, 2.0, 1, 2.0, True), (None, 2.0, 10, 0, True),
])
def test_schedule(every_steps: int | None, every_minutes: float | None, step: int, elapsed_min: float,
                  due: bool) -> None:
    schedule = CheckpointSchedule(max_steps=10, every_steps=every_steps, every_minutes=every_minutes,
                                  last_save_at=100.0)
    assert schedule.due(step, 100.0 + elapsed_min * 60) is due
    assert schedule.needs_agreement is (every_minutes is not None)


def manifest(world: int = 2, spec_hash: str | None = "sha256:a") -> CheckpointManifest:
    shards = [ShardEntry(rank=r, uri=f"file:///x/__{r}_0.distcp", size_bytes=1, sha256="0" * 64) for r in range(world)]
    return CheckpointManifest(job_id="j", tenant="t", attempt=1, epoch=1, global_step=3, world_size=world,
                              spec_hash=spec_hash, shards=shards, content_hash=content_hash(shards))


def test_check_restorable() -> None:
    assert check_restorable(manifest(), world_size=2, spec_hash="sha256:a") == []
    assert check_restorable(manifest(), world_size=4, spec_hash="sha256:a") == []  # elastic: DCP reshards
    assert "spec hash" in check_restorable(manifest(), world_size=2, spec_hash="sha256:b")[0]


# ----------------------------------------------------------------------------- a one-rank world


def make_state(seed: int):
    config = ModelConfig(vocab_size=40, n_layers=1, n_heads=2, d_model=8, max_seq_len=8, dropout=0.1)
    model = apply_ddp(build_model(config, seed=seed, device=torch.device("cpu")), device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_lr_scheduler(opt, schedule=LrSchedule(warmup_steps=2), max_steps=10)
    sampler = GlobalSampler(100, seed=7, global_batch=4, micro_batch=4, dp=1, dp_rank=0)
    progress = Progress()
    state = checkpoint_state(model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler,
                             progress=progress, rng=RngState(0, torch.device("cpu"), seed=seed))
    return state, model, opt, sampler, progress


def step(model, opt, sched, sampler, progress) -> None:
    x = torch.randint(0, 40, (2, 8))
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    sampler.advance()
    progress.advance(samples=4, tokens=28)


def digest_manifest(saved, directory: Path) -> Path:
    shards = [ShardEntry(rank=0, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes, sha256=saved.shard.sha256)]
    m = CheckpointManifest(job_id="j", tenant="t", attempt=1, epoch=1, global_step=2, world_size=1, shards=shards,
                           extra_files=saved.extra_files, content_hash=content_hash(shards, saved.extra_files))
    atomic_write_bytes(directory / "manifest.json", m.to_bytes())
    return directory / "manifest.json"


def test_save_verify_restore_round_trip(world_of_one: None, tmp_path: Path) -> None:
    state, model, opt, sampler, progress = make_state(seed=1)
    for _ in range(2):
        step(model, opt, state["lr_scheduler"], sampler, progress)
    state["rng"].python.random()
    directory = tmp_path / "ckpt" / "step-2"
    saved = save_checkpoint(state, directory, rank=0, barrier=dist.barrier)

    assert sorted(p.name for p in directory.iterdir()) == [".metadata", "__0_0.distcp"]
    assert not (tmp_path / "ckpt" / "step-2.tmp").exists()
    assert saved.shard.uri == path_to_uri(directory / "__0_0.distcp")
    assert [f.uri for f in saved.extra_files] == [path_to_uri(directory / ".metadata")]
    manifest_path = digest_manifest(saved, directory)

    # what happens next in the original process...
    expected_python, expected_torch = state["rng"].python.random(), torch.rand(3)
    expected_lr = opt.param_groups[0]["lr"]
    # ...must happen after a restore into a fresh, differently seeded process state
    torch.manual_seed(999)
    fresh, fresh_model, fresh_opt, fresh_sampler, fresh_progress = make_state(seed=2)
    assert not torch.equal(fresh_model.module.wte.weight, model.module.wte.weight)
    ref = CheckpointRef(manifest_uri=path_to_uri(manifest_path), global_step=2, attempt=1)
    load_checkpoint(fresh, verified_checkpoint_dir(read_checkpoint_manifest(ref), ref.manifest_uri))
    assert (fresh_progress.global_step, fresh_progress.consumed_tokens) == (2, 56)
    assert fresh_sampler.position == sampler.position == 8
    assert fresh_opt.param_groups[0]["lr"] == expected_lr
    for (name, a), (_, b) in zip(model.module.named_parameters(), fresh_model.module.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert fresh["rng"].python.random() == expected_python
    assert torch.equal(torch.rand(3), expected_torch)


def test_existing_final_directory_is_never_overwritten(world_of_one: None, tmp_path: Path) -> None:
    state, *_ = make_state(seed=1)
    directory = tmp_path / "step-1"
    directory.mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(state, directory, rank=0, barrier=dist.barrier)


def test_corrupt_or_mismatched_checkpoints_are_refused(world_of_one: None, tmp_path: Path) -> None:
    state, model, opt, sampler, progress = make_state(seed=1)
    step(model, opt, state["lr_scheduler"], sampler, progress)
    directory = tmp_path / "step-1"
    saved = save_checkpoint(state, directory, rank=0, barrier=dist.barrier)
    manifest_path = digest_manifest(saved, directory)
    uri = path_to_uri(manifest_path)

    with pytest.raises(CheckpointCorruptError, match="content hash"):
        read_checkpoint_manifest(CheckpointRef(manifest_uri=uri, global_step=2, attempt=1, content_hash="sha256:x"))
    with pytest.raises(CheckpointCorruptError, match="not found"):
        read_checkpoint_manifest(CheckpointRef(manifest_uri=uri + ".gone", global_step=2, attempt=1))

    meta = directory / ".metadata"
    meta.write_bytes(meta.read_bytes() + b"x")
    m = read_checkpoint_manifest(CheckpointRef(manifest_uri=uri, global_step=2, attempt=1))
    with pytest.raises(CheckpointCorruptError, match="shared file .metadata has"):
        verified_checkpoint_dir(m, uri)


# ----------------------------------------------------------------------------- async saving (a world of one)


def agree_alone(values: list[int]) -> list[int]:
    return list(values)


def test_async_save_is_reported_only_once_durable_and_holds_the_state_of_its_step(
    world_of_one: None, tmp_path: Path
) -> None:
    state, model, opt, sampler, progress = make_state(seed=1)
    step(model, opt, state["lr_scheduler"], sampler, progress)
    expected = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    reported = []
    group = dist.new_group(backend="gloo")
    checkpointer = Checkpointer(rank=0, mode="async", barrier=dist.barrier, agree=agree_alone, group=group)
    directory = tmp_path / "step-1"
    stall = checkpointer.save(state, directory, reported.append)
    assert stall > 0 and checkpointer.pending is not None
    # training goes on at once; its optimizer update waits for the copy, and the copy is what gets written
    x = torch.randint(0, 40, (2, 8))
    model(x[:, :-1], x[:, 1:])[1].backward()
    stall += checkpointer.before_update()
    assert checkpointer.pending.staged.is_set() and checkpointer.before_update() == 0.0
    opt.step()
    opt.zero_grad()
    assert reported == []  # reported from a step boundary (poll), never from the writer thread
    while checkpointer.pending is not None:
        checkpointer.poll()
    checkpointer.close()

    (saved,) = reported
    assert directory.is_dir() and not (tmp_path / "step-1.tmp").exists()
    assert saved.shard.uri == path_to_uri(directory / "__0_0.distcp") and saved.seconds >= stall
    assert saved.stall == pytest.approx(stall)
    assert saved.shard.sha256 == sha256_file(directory / "__0_0.distcp")
    assert [f.uri for f in saved.extra_files] == [path_to_uri(directory / ".metadata")]
    fresh, fresh_model, _, fresh_sampler, fresh_progress = make_state(seed=2)
    load_checkpoint(fresh, directory)
    assert fresh_progress.global_step == 1 and fresh_sampler.position == 4
    for name, p in fresh_model.module.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_a_new_save_waits_for_the_pending_one_and_sync_mode_reports_inside_save(
    world_of_one: None, tmp_path: Path
) -> None:
    state, model, opt, sampler, progress = make_state(seed=1)
    group = dist.new_group(backend="gloo")
    steps_reported: list[str] = []
    checkpointer = Checkpointer(rank=0, mode="async", barrier=dist.barrier, agree=agree_alone, group=group)
    checkpointer.save(state, tmp_path / "a", lambda s: steps_reported.append(s.directory.name))
    checkpointer.save(state, tmp_path / "b", lambda s: steps_reported.append(s.directory.name))
    assert steps_reported == ["a"]
    checkpointer.wait()
    assert steps_reported == ["a", "b"] and checkpointer.pending is None
    with pytest.raises(CheckpointError, match="already exists"):
        checkpointer.save(state, tmp_path / "a")
    checkpointer.close()

    sync = Checkpointer(rank=0, mode="sync", barrier=dist.barrier, agree=agree_alone)
    sync.save(state, tmp_path / "c", lambda s: steps_reported.append(s.directory.name))
    assert steps_reported[-1] == "c" and sync.pending is None and sync.poll() == 0.0


def test_a_failed_background_save_is_a_checkpoint_error_at_the_next_boundary(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainyard.checkpoint as module

    state, *_ = make_state(seed=1)
    group = dist.new_group(backend="gloo")

    def no_shard(directory: Path, rank: int) -> Path:
        raise CheckpointError("disk vanished")

    monkeypatch.setattr(module, "_own_shard", no_shard)
    checkpointer = Checkpointer(rank=0, mode="async", barrier=dist.barrier, agree=agree_alone, group=group)
    reported: list[object] = []
    checkpointer.save(state, tmp_path / "x", reported.append)
    with pytest.raises(CheckpointError, match="background save .* failed on this rank: disk vanished"):
        checkpointer.wait()
    assert reported == [] and not (tmp_path / "x").exists()
    checkpointer.close()
