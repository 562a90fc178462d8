"""Checkpoint I/O inside a rank: the save protocol, the restore path, and when to save.

Save (every rank, in lock step)::

    1. rank 0 clears a leftover ``<dir>.tmp`` of an interrupted save       barrier
    2. dcp.save into ``<dir>.tmp``: each rank writes ``__<rank>_0.distcp``,
       rank 0 also the shared ``.metadata`` (FileSystemWriter fsyncs both)
    3. each rank fsyncs its own file                                        barrier
    4. rank 0 renames ``<dir>.tmp`` → ``<dir>`` and fsyncs the parent       barrier
    5. each rank hashes its own shard file; it then reports ShardWritten

The directory is invisible under its final name until every rank's file is durable; it
becomes READY only when the checkpoint coordinator has verified every shard and written
``manifest.json``. Restore refuses anything whose manifest does not verify.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from trainyard_common.errors import CheckpointCorruptError, CheckpointError
from trainyard_common.events import CheckpointRef, FileDigest
from trainyard_common.manifest import CheckpointManifest, local_sha256, local_stat_size, verify_manifest
from trainyard_common.storage import fsync_dir, fsync_file, path_to_uri, sha256_file, uri_to_path

METADATA_FILE = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn
SHARD_SUFFIX = ".distcp"


@dataclass(frozen=True)
class SavedShard:
    """What one rank reports after a save: its own shard, plus the shared files on rank 0."""

    directory: Path
    shard: FileDigest
    extra_files: list[FileDigest] = field(default_factory=list)
    seconds: float = 0.0


# ----------------------------------------------------------------------------- when to save


@dataclass
class CheckpointSchedule:
    """``everySteps`` or ``everyMinutes``, and always at ``maxSteps``. Pure; the clock is passed in.

    With ``everyMinutes`` the ranks' clocks disagree, so the caller must agree on rank 0's
    answer (see ``train``): :meth:`due` is asked on rank 0 and broadcast.
    """

    max_steps: int
    every_steps: int | None = None
    every_minutes: float | None = None
    last_save_at: float = 0.0

    @property
    def needs_agreement(self) -> bool:
        return self.every_minutes is not None

    def due(self, step: int, now: float) -> bool:
        if step >= self.max_steps:
            return True
        if self.every_steps is not None:
            return step % self.every_steps == 0
        if self.every_minutes is not None:
            return now - self.last_save_at >= self.every_minutes * 60.0
        return False

    def saved(self, now: float) -> None:
        self.last_save_at = now


# ----------------------------------------------------------------------------- save


def temporary_dir(directory: Path) -> Path:
    return directory.with_name(directory.name + ".tmp")


def rank_shard_files(directory: Path, rank: int) -> list[Path]:
    """The files FileSystemWriter wrote for ``rank``: ``__<rank>_<n>.distcp``."""
    return sorted(directory.glob(f"__{rank}_*{SHARD_SUFFIX}"))


def _own_shard(directory: Path, rank: int) -> Path:
    files = rank_shard_files(directory, rank)
    if len(files) != 1:
        raise CheckpointError(f"rank {rank} expected one shard file in {directory}, found {[f.name for f in files]}")
    return files[0]


def _digest(path: Path) -> FileDigest:
    return FileDigest(uri=path_to_uri(path), size_bytes=path.stat().st_size, sha256=sha256_file(path))


def save_checkpoint(
    state: Mapping[str, Stateful],
    directory: Path,
    *,
    rank: int,
    barrier: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
) -> SavedShard:
    """Run the save protocol above; every rank calls it with the same ``directory``."""
    started = clock()
    tmp = temporary_dir(directory)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    if directory.exists():  # checked by every rank, so all of them fail together
        raise CheckpointError(f"checkpoint directory already exists: {directory}")
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
    try:
        dcp.save(dict(state), storage_writer=writer)
    except (CheckpointException, RuntimeError, OSError) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"could not save checkpoint {directory}: {exc}") from exc
    fsync_file(_own_shard(tmp, rank))
    barrier()
    if rank == 0:
        os.rename(tmp, directory)
        fsync_dir(directory.parent)
    barrier()
    shard = _digest(_own_shard(directory, rank))
    extra = [_digest(directory / METADATA_FILE)] if rank == 0 else []
    return SavedShard(directory=directory, shard=shard, extra_files=extra, seconds=clock() - started)


# ----------------------------------------------------------------------------- restore


def read_checkpoint_manifest(ref: CheckpointRef) -> CheckpointManifest:
    """Parse the manifest ``ref`` points at; missing or malformed is CheckpointCorruptError."""
    path = uri_to_path(ref.manifest_uri)
    try:
        manifest = CheckpointManifest.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint manifest not found: {ref.manifest_uri}") from None
    except (ValidationError, ValueError) as exc:
        raise CheckpointCorruptError(f"checkpoint manifest {ref.manifest_uri} is malformed: {exc}") from exc
    if ref.content_hash and ref.content_hash != manifest.content_hash:
        raise CheckpointCorruptError(
            f"checkpoint manifest {ref.manifest_uri} has content hash {manifest.content_hash}, "
            f"the allocation expected {ref.content_hash}"
        )
    if manifest.global_step != ref.global_step:
        raise CheckpointCorruptError(
            f"checkpoint manifest {ref.manifest_uri} is for step {manifest.global_step}, expected {ref.global_step}"
        )
    return manifest


def check_restorable(manifest: CheckpointManifest, *, world_size: int, spec_hash: str | None) -> list[str]:
    """Why this run cannot restore ``manifest`` (empty when it can). Pure."""
    problems = []
    if manifest.world_size != world_size:
        problems.append(
            f"checkpoint was written by {manifest.world_size} ranks, this run has {world_size} "
            "(elastic resume is not supported yet)"
        )
    if spec_hash and manifest.spec_hash and manifest.spec_hash != spec_hash:
        problems.append(f"checkpoint spec hash {manifest.spec_hash} differs from this job's {spec_hash}")
    return problems


def verified_checkpoint_dir(manifest: CheckpointManifest, manifest_uri: str) -> Path:
    """Verify every shard and shared file (size, sha256, content hash); the directory to load."""
    if problems := verify_manifest(manifest, stat_size=local_stat_size, file_sha256=local_sha256):
        raise CheckpointCorruptError(
            f"checkpoint step {manifest.global_step} ({manifest_uri}) failed verification: " + "; ".join(problems)
        )
    directory = uri_to_path(manifest_uri).parent
    for uri in [s.uri for s in manifest.shards] + [f.uri for f in manifest.extra_files]:
        if uri_to_path(uri).parent != directory:
            raise CheckpointCorruptError(f"checkpoint file {uri} is not beside its manifest {manifest_uri}")
    return directory


def load_checkpoint(state: Mapping[str, Stateful], directory: Path) -> None:
    """``dcp.load`` into ``state`` in place (each Stateful's load_state_dict is called)."""
    try:
        dcp.load(dict(state), storage_reader=FileSystemReader(directory))
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"could not load checkpoint {directory}: {exc}") from exc
