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

Object-store mode (``--store s3://bucket/prefix``, or ``--moto``: a moto S3 server started in
this process on a free local port, with its bucket): the trainer's save into the object store
(DCP's fsspec writer, sha256 computed while uploading, no rename) against a raw s3fs upload of the
same number of bytes to one object, in the same run; then verify (sha256 read back from the
store) and load. Credentials and endpoint come from the standard AWS configuration.

    python bench/checkpoint_io/run.py [--model gpt-small@v1] [--repeats 3] [--dir PATH]
    python bench/checkpoint_io/run.py --moto [--model gpt-small@v1] [--repeats 3]
    python bench/checkpoint_io/run.py --store s3://bucket/prefix
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from trainyard_contract.catalog import resolve_model
from trainyard_contract.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_contract.spec import LrSchedule
from trainyard_contract.storage import atomic_write_bytes
from trainyard.checkpoint import Checkpointer, load_checkpoint, save_checkpoint, verified_checkpoint_dir
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import apply_ddp
from trainyard.sampler import GlobalSampler
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard.state import Progress, RngState, checkpoint_state


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
    parser.add_argument("--store", default=None, help="object-store mode: an fsspec URL prefix (s3://bucket/prefix)")
    parser.add_argument("--moto", action="store_true", help="object-store mode against an in-process moto S3 server")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.store or args.moto:
        object_store_main(args)
        return
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


def object_store_main(args: argparse.Namespace) -> None:
    """DCP save MB/s into the object store ÷ raw s3fs upload MB/s of the same bytes, same run."""
    import uuid

    from trainyard_contract.storage import ObjectPath, commit_bytes, object_filesystem, remove_tree

    with contextlib.ExitStack() as stack:
        store = args.store or stack.enter_context(_moto_bucket())
        root = ObjectPath.parse(store) / f"ckpt-bench-{uuid.uuid4().hex[:8]}"
        fs = object_filesystem(root)
        base = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
        dist.init_process_group("gloo", init_method=f"file://{base / 'pg'}", rank=0, world_size=1)
        save, raw, verify, load = [], [], [], []
        nbytes = 0
        try:
            state = make_state(args.model, seed=1)
            for i in range(args.repeats):
                directory = root / f"sync-{i}"
                started = time.perf_counter()
                saved = save_checkpoint(state, directory, rank=0, barrier=lambda: None)
                save.append(time.perf_counter() - started)
                nbytes = saved.shard.size_bytes + sum(f.size_bytes for f in saved.extra_files)
                data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
                started = time.perf_counter()
                with fs.open((root / f"raw-{i}.bin").path, "wb") as fh:  # s3fs's default part size, like DCP's
                    fh.write(data)
                raw.append(time.perf_counter() - started)
                shards = [ShardEntry(rank=0, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes,
                                     sha256=saved.shard.sha256)]
                manifest = CheckpointManifest(job_id="bench", tenant="t", attempt=1, epoch=1, global_step=0,
                                              world_size=1, shards=shards, extra_files=saved.extra_files,
                                              content_hash=content_hash(shards, saved.extra_files))
                commit_bytes(directory / "manifest.json", manifest.to_bytes())
                fresh = make_state(args.model, seed=2)
                started = time.perf_counter()
                loadable = verified_checkpoint_dir(manifest, str(directory / "manifest.json"))
                verify.append(time.perf_counter() - started)
                started = time.perf_counter()
                load_checkpoint(fresh, loadable)
                load.append(time.perf_counter() - started)
                remove_tree(directory)
                remove_tree(root / f"raw-{i}.bin")
        finally:
            dist.destroy_process_group()
            shutil.rmtree(base, ignore_errors=True)
            remove_tree(root)

    med = statistics.median
    mb = nbytes / 1e6
    raw_rate, save_rate = mb / med(raw), mb / med(save)
    print(f"checkpoint of {args.model} into {'moto S3 (in-process)' if not args.store else args.store}: "
          f"{mb:.1f} MB, median of {args.repeats}")
    print(f"  raw s3fs upload of the same bytes {med(raw):7.3f} s  {raw_rate:8.1f} MB/s")
    print(f"  DCP save (fsspec, sha256 inline)  {med(save):7.3f} s  {save_rate:8.1f} MB/s")
    print(f"  restore: verify (sha256 read back) {med(verify):7.3f} s;  load {med(load):.3f} s")
    print(f"RATIO object-store DCP save / raw s3fs upload MB/s = {save_rate / raw_rate:.3f}")


@contextlib.contextmanager
def _moto_bucket() -> Iterator[str]:
    """An in-process moto S3 server with a bucket; this process's AWS configuration points at it."""
    import logging

    from moto.server import ThreadedMotoServer

    from trainyard_contract.storage import object_filesystem

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL_S3=f"http://{host}:{port}")
    try:
        object_filesystem("s3://trainyard-bench").makedirs("trainyard-bench", exist_ok=True)
        yield "s3://trainyard-bench"
    finally:
        server.stop()


def _save_without_hash(state: dict, directory: Path) -> None:
    """The protocol's I/O part: DCP save into <dir>.tmp with fsync, rename, fsync the parent."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from trainyard_contract.storage import fsync_dir
    from trainyard.checkpoint import temporary_dir

    tmp = temporary_dir(directory)
    dcp.save(dict(state), storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True,
                                                          thread_count=1, overwrite=False))
    os.rename(tmp, directory)
    fsync_dir(directory.parent)


if __name__ == "__main__":
    main()
