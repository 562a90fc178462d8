"""Checkpoint I/O of the trainer against the disk it writes to (printed ratios, not a test).

One process, a gloo world of one, the full training state of ``gpt-small@v1`` after one AdamW
step (weights + both moments, ~130 MB). In the same run and the same directory:

- raw: the same number of bytes written sequentially to one file, then fsync'd (the disk's speed);
- sync save: the trainer's synchronous save protocol (``save_checkpoint``: DCP save into a
  temporary directory, fsync, rename, fsync the parent), and the same plus the sha256 the rank
  reports in ShardWritten;
- async save: what training waits for, against the synchronous save time: ``Checkpointer.save``
  in async mode, then the next step's forward/backward (which the staging copy overlaps), then
  ``before_update`` (the wait for the copy before the optimizer may change the state); then the
  background completion;
- restore: verifying the manifest (size + sha256 of every file) and loading into a fresh state.

Targets: sync MB/s / raw MB/s >= 0.8; async stall / sync save <= 0.03. Each figure is the
median of REPEATS runs.

    python bench/checkpoint_io/run.py [--model gpt-small@v1] [--repeats 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainyard_common.catalog import resolve_model
from trainyard_common.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_common.spec import LrSchedule
from trainyard_common.storage import atomic_write_bytes
from trainyard_trainer.checkpoint import Checkpointer, load_checkpoint, save_checkpoint, verified_checkpoint_dir
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import apply_ddp
from trainyard_trainer.sampler import GlobalSampler
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard_trainer.state import Progress, RngState, checkpoint_state


def make_state(model_ref: str, seed: int) -> dict:
    config = resolve_model(model_ref)
    model = apply_ddp(build_model(config, seed=seed, device=torch.device("cpu")), device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, config.vocab_size, (1, 17))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    opt.zero_grad()
    sched = build_lr_scheduler(opt, schedule=LrSchedule(warmup_steps=2), max_steps=10)
    sampler = GlobalSampler(1000, seed=7, global_batch=4, micro_batch=4, dp=1, dp_rank=0)
    return checkpoint_state(model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, progress=Progress(),
                            rng=RngState(0, torch.device("cpu"), seed=seed))


def next_step_compute(state: dict) -> float:
    """The forward and backward of a micro step (4 x 128 tokens): what the staging copy overlaps."""
    model = state["model"].model
    config = model.module.config
    x = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    model(x[:, :-1], x[:, 1:])[1].backward()
    return time.perf_counter() - started


def raw_write(path: Path, nbytes: int) -> float:
    data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
    started = time.perf_counter()
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - started


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def manifest_for(saved, directory: Path) -> Path:
    shards = [ShardEntry(rank=0, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes, sha256=saved.shard.sha256)]
    m = CheckpointManifest(job_id="bench", tenant="t", attempt=1, epoch=1, global_step=0, world_size=1, shards=shards,
                           extra_files=saved.extra_files, content_hash=content_hash(shards, saved.extra_files))
    atomic_write_bytes(directory / "manifest.json", m.to_bytes())
    return directory / "manifest.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small@v1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    dist.init_process_group("gloo", init_method=f"file://{base / 'pg'}", rank=0, world_size=1)
    background = dist.new_group(backend="gloo")
    try:
        state = make_state(args.model, seed=1)
        raw, sync, sync_hashed, stall, async_total, verify, load, overlapped = [], [], [], [], [], [], [], []
        nbytes = 0
        for i in range(args.repeats):
            directory = base / f"sync-{i}"
            started = time.perf_counter()
            saved = save_checkpoint(state, directory, rank=0, barrier=lambda: None)
            sync_hashed.append(time.perf_counter() - started)
            nbytes = directory_bytes(directory)
            # the same protocol without the sha256 pass (hashing is reported separately)
            shutil.rmtree(base / f"nohash-{i}", ignore_errors=True)
            started = time.perf_counter()
            _save_without_hash(state, base / f"nohash-{i}")
            sync.append(time.perf_counter() - started)
            raw.append(raw_write(base / f"raw-{i}.bin", nbytes))

            checkpointer = Checkpointer(rank=0, mode="async", barrier=lambda: None, agree=lambda v: list(v),
                                        group=background)
            started = time.perf_counter()
            held = checkpointer.save(state, base / f"async-{i}")
            compute = next_step_compute(state)
            held += checkpointer.before_update()
            stall.append(held)
            overlapped.append(compute)
            checkpointer.wait()
            async_total.append(time.perf_counter() - started)
            checkpointer.close()

            manifest = manifest_for(saved, directory)
            fresh = make_state(args.model, seed=2)
            started = time.perf_counter()
            m = CheckpointManifest.model_validate_json(manifest.read_bytes())
            loadable = verified_checkpoint_dir(m, manifest.as_uri())
            verify.append(time.perf_counter() - started)
            started = time.perf_counter()
            load_checkpoint(fresh, loadable)
            load.append(time.perf_counter() - started)
            for stale in (directory, base / f"nohash-{i}", base / f"async-{i}", base / f"raw-{i}.bin"):
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(base, ignore_errors=True)

    med = statistics.median
    mb = nbytes / 1e6
    raw_rate, sync_rate, hashed_rate = mb / med(raw), mb / med(sync), mb / med(sync_hashed)
    print(f"checkpoint of {args.model}: {mb:.1f} MB (model + AdamW moments + schedule/sampler/RNG), "
          f"median of {args.repeats}, written under {base.parent}")
    print(f"  raw sequential write + fsync     {med(raw):7.3f} s  {raw_rate:8.1f} MB/s")
    print(f"  sync save (DCP, fsync, rename)   {med(sync):7.3f} s  {sync_rate:8.1f} MB/s")
    print(f"  sync save + sha256 for the event {med(sync_hashed):7.3f} s  {hashed_rate:8.1f} MB/s")
    print(f"  async save: training stalled     {med(stall):7.3f} s   (over a {med(overlapped):.3f} s forward/backward; "
          f"durable after {med(async_total):.3f} s)")
    print(f"  restore: verify manifest+sha256  {med(verify):7.3f} s;  load {med(load):.3f} s")
    print(f"RATIO sync/raw MB/s               = {sync_rate / raw_rate:.3f}   (target >= 0.8)")
    print(f"RATIO sync incl. sha256/raw MB/s  = {hashed_rate / raw_rate:.3f}")
    print(f"RATIO async stall / sync save     = {med(stall) / med(sync_hashed):.4f}  (target <= 0.03)")


def _save_without_hash(state: dict, directory: Path) -> None:
    """The protocol's I/O part: DCP save into <dir>.tmp with fsync, rename, fsync the parent."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from trainyard_common.storage import fsync_dir
    from trainyard_trainer.checkpoint import temporary_dir

    tmp = temporary_dir(directory)
    dcp.save(dict(state), storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True,
                                                          thread_count=1, overwrite=False))
    os.rename(tmp, directory)
    fsync_dir(directory.parent)


if __name__ == "__main__":
    main()
