"""Checkpoint I/O inside a rank: the save protocol, the restore path, and when to save.

Save (every rank, in lock step)::

    1. rank 0 clears a leftover ``<dir>.tmp`` of an interrupted save       barrier
    2. dcp.save into ``<dir>.tmp``: each rank writes ``__<rank>_0.distcp``,
       rank 0 also the shared ``.metadata`` (FileSystemWriter fsyncs both)
    3. each rank fsyncs its own file                                        barrier
    4. rank 0 renames ``<dir>.tmp`` → ``<dir>`` and fsyncs the parent       barrier
    5. each rank hashes its own shard file; it then reports ShardWritten

Step 2 also digests every entry the rank writes (:mod:`trainyard.tensorhash`): the ShardWritten
carries them, and the coordinator combines them into the manifest's ``tensorsHash``, which (unlike
``contentHash``, over the files and DCP's ``.metadata``) is equal for bitwise-identical checkpoints.

The directory is invisible under its final name until every rank's file is durable; it
becomes READY only when the checkpoint coordinator has verified every shard and written
``manifest.json``. Restore refuses anything whose manifest does not verify.

In an object store (the directory is an :class:`~trainyard_contract.storage.ObjectPath`) there is
no rename and no ``.tmp``: rank 0 removes the objects of an interrupted save of the same
directory (never one with a manifest), every rank uploads its shard straight under the final
prefix through DCP's fsspec writer, hashing it as it streams (nothing is read back), and the
manifest the coordinator writes last is the only commit point. A prefix without a manifest is
never loaded, so a half-written one is as invisible as a ``.tmp`` directory.

Asynchronous save (:class:`Checkpointer`, ``mode="async"``) runs the same protocol with steps
2–3 in the background: a thread copies the state into reusable host buffers (overlapping the
next step's forward and backward; only the next optimizer update waits for the copy), then
writes the copy with ``dcp.save`` over a gloo group of its own, fsyncs and hashes its file. At each step boundary the
ranks agree (one small all-reduce) on whether every rank's write has finished; when it has, rank 0 renames and fsyncs
the parent, barrier, and only then each rank reports ShardWritten. One save is in flight at a time: a new save, or the
end of training, waits for the previous one.

Restore with fallback (:func:`choose_checkpoint`): the allocation's start checkpoint is
verified first (manifest, then every file's size and sha256, the hashing split over the
ranks); if it fails, it is refused with the reason and the job's other checkpoints that have a
manifest (READY) are tried, newest first. A directory without a manifest is never loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from trainyard_contract.errors import CheckpointCorruptError, CheckpointError
from trainyard_contract.events import CheckpointRef, FileDigest, TensorDigest
from trainyard_contract.manifest import CheckpointManifest, local_sha256, local_stat_size, verify_manifest
from trainyard_contract.storage import (
    HashingWriter,
    Location,
    ObjectPath,
    as_location,
    fsync_dir,
    fsync_file,
    glob,
    location_uri,
    object_storage_options,
    path_to_uri,
    read_bytes,
    remove_tree,
    sha256_file,
)
from trainyard_contract.storage import exists as location_exists
from trainyard.tensorhash import DigestingWriter

log = logging.getLogger("trainyard")

METADATA_FILE = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn
MANIFEST_FILE = "manifest.json"
SHARD_SUFFIX = ".distcp"


@dataclass(frozen=True)
class SavedShard:
    """What one rank reports after a save: its own shard, plus the shared files on rank 0."""

    directory: Location
    shard: FileDigest
    extra_files: list[FileDigest] = field(default_factory=list)
    seconds: float = 0.0  # from the start of the save until durable under the final name
    stall: float | None = None  # of that, the time training waited (None: all of it, a synchronous save)
    tensors: list[TensorDigest] | None = None  # a digest of every entry this rank wrote (trainyard.tensorhash)


# ----------------------------------------------------------------------------- when to save


@dataclass
class CheckpointSchedule:
    """``everySteps`` or ``everyMinutes``, and always at ``maxSteps``. Pure; the clock is passed in.

    :meth:`due_by_step` is the same on every rank; :meth:`due_by_clock` is not (the ranks' clocks
    disagree), so the ranks agree on it at the step boundary (any rank's clock makes everyone save).
    """

    max_steps: int
    every_steps: int | None = None
    every_minutes: float | None = None
    last_save_at: float = 0.0

    @property
    def needs_agreement(self) -> bool:
        return self.every_minutes is not None

    def due(self, step: int, now: float) -> bool:
        return self.due_by_step(step) or self.due_by_clock(now)

    def due_by_step(self, step: int) -> bool:
        """``maxSteps``, or a multiple of ``everySteps``: every rank knows it alike."""
        return step >= self.max_steps or (self.every_steps is not None and step % self.every_steps == 0)

    def due_by_clock(self, now: float) -> bool:
        """``everyMinutes`` since the last save, by this rank's clock."""
        return (self.every_steps is None and self.every_minutes is not None
                and now - self.last_save_at >= self.every_minutes * 60.0)

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


def _digest(path: Path, *, final: Path | None = None) -> FileDigest:
    """Size and sha256 of ``path``, reported under ``final`` (its name once renamed) when given."""
    return FileDigest(uri=path_to_uri(final or path), size_bytes=path.stat().st_size, sha256=sha256_file(path))


def save_checkpoint(
    state: Mapping[str, Stateful],
    directory: Location,
    *,
    rank: int,
    barrier: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
) -> SavedShard:
    """Run the save protocol above; every rank calls it with the same ``directory``."""
    started = clock()
    prepare_directory(directory, rank=rank, barrier=barrier)
    saved = write_shard(dict(state), directory, rank=rank)
    barrier()
    publish_directory(directory, rank=rank, barrier=barrier)
    return replace(saved, seconds=clock() - started)


def prepare_directory(directory: Location, *, rank: int, barrier: Callable[[], None]) -> None:
    """Step 1, collective: clear what an interrupted save of ``directory`` left; every rank fails
    alike when the checkpoint exists already (locally: the directory; in an object store: its manifest)."""
    if isinstance(directory, ObjectPath):
        if location_exists(directory / MANIFEST_FILE):  # checked by every rank before anything is removed
            raise CheckpointError(f"checkpoint already exists: {directory}")
        if rank == 0:
            remove_tree(directory)  # no manifest: nothing there was ever visible
        barrier()
        return
    tmp = temporary_dir(directory)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    if directory.exists():  # checked by every rank, so all of them fail together
        raise CheckpointError(f"checkpoint directory already exists: {directory}")


def write_shard(state_dict: dict[str, Any], directory: Location, *, rank: int, group: Any = None) -> SavedShard:
    """Steps 2–3: ``dcp.save`` this rank's shard (rank 0 also ``.metadata``), durable, with digests
    reported under the final name."""
    writer: HashingFsspecWriter | DigestingFileSystemWriter = (
        HashingFsspecWriter(directory) if isinstance(directory, ObjectPath)
        else DigestingFileSystemWriter(temporary_dir(directory), single_file_per_rank=True, sync_files=True,
                                       thread_count=1, overwrite=False))
    try:
        dcp.save(state_dict, storage_writer=writer, process_group=group)
    except (CheckpointException, RuntimeError, OSError) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"could not save checkpoint {directory}: {exc}") from exc
    if isinstance(writer, HashingFsspecWriter):
        shard = writer.digest(writer.own_shard(rank))
        extra = [writer.digest(METADATA_FILE)] if rank == 0 else []
        return SavedShard(directory=directory, shard=shard, extra_files=extra, tensors=writer.tensor_digests)
    assert isinstance(directory, Path)
    tmp = temporary_dir(directory)
    own = _own_shard(tmp, rank)
    fsync_file(own)
    shard = _digest(own, final=directory / own.name)
    extra = [_digest(tmp / METADATA_FILE, final=directory / METADATA_FILE)] if rank == 0 else []
    return SavedShard(directory=directory, shard=shard, extra_files=extra, tensors=writer.tensor_digests)


class DigestingFileSystemWriter(DigestingWriter, FileSystemWriter):
    """DCP's local writer, digesting every entry it writes (:mod:`trainyard.tensorhash`)."""


def publish_directory(directory: Location, *, rank: int, barrier: Callable[[], None]) -> None:
    """Step 4, collective: rank 0 renames ``<dir>.tmp`` → ``<dir>`` (an object store has nothing to
    rename: the coordinator's manifest is the commit point)."""
    if rank == 0 and not isinstance(directory, ObjectPath):
        os.rename(temporary_dir(directory), directory)
        fsync_dir(directory.parent)
    barrier()


class _HashingFileSystem(FsspecFileSystem):
    """DCP's fsspec filesystem, with every written stream hashed and counted on its way out."""

    def __init__(self, inner: FsspecFileSystem) -> None:
        super().__init__()
        self.fs = inner.fs
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingWriter(stream)
            yield hashing
        with self._lock:
            self.digests[os.path.basename(os.fspath(path))] = (hashing.size, hashing.hexdigest())

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP's .metadata.tmp → .metadata (a server-side copy)
        with self._lock:
            digest = self.digests.pop(os.path.basename(os.fspath(path)), None)
            if digest is not None:
                self.digests[os.path.basename(os.fspath(new_path))] = digest


class HashingFsspecWriter(DigestingWriter, FsspecWriter):
    """DCP's fsspec writer into an object-store prefix, one file per rank, that knows the size and
    sha256 of every object it uploaded (computed while streaming) and the digest of every entry."""

    def __init__(self, directory: ObjectPath) -> None:
        super().__init__(str(directory), single_file_per_rank=True, sync_files=False, thread_count=1,
                         overwrite=False, **object_storage_options())
        self.directory = directory
        self.fs = self.hashing = _HashingFileSystem(self.fs)  # type: ignore[assignment, arg-type]  # torch types fs as its local FileSystem

    def own_shard(self, rank: int) -> str:
        names = sorted(n for n in self.hashing.digests if n.startswith(f"__{rank}_") and n.endswith(SHARD_SUFFIX))
        if len(names) != 1:
            raise CheckpointError(f"rank {rank} expected one shard object in {self.directory}, wrote {names}")
        return names[0]

    def digest(self, name: str) -> FileDigest:
        size, sha = self.hashing.digests[name]
        return FileDigest(uri=str(self.directory / name), size_bytes=size, sha256=sha)


# ----------------------------------------------------------------------------- restore


def read_checkpoint_manifest(ref: CheckpointRef) -> CheckpointManifest:
    """Parse the manifest ``ref`` points at; missing or malformed is CheckpointCorruptError."""
    try:
        manifest = CheckpointManifest.model_validate_json(read_bytes(as_location(ref.manifest_uri)))
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


def check_restorable(manifest: CheckpointManifest, *, world_size: int | None = None,
                     spec_hash: str | None) -> list[str]:
    """Why this run cannot restore ``manifest`` (empty when it can). Pure.

    A different world size is not a reason: model and optimizer entries are keyed by parameter
    name and DCP reshards them; the sampler's state is the global sample index (elastic resume).
    """
    problems = []
    if spec_hash and manifest.spec_hash and manifest.spec_hash != spec_hash:
        problems.append(f"checkpoint spec hash {manifest.spec_hash} differs from this job's {spec_hash}")
    return problems


def verified_checkpoint_dir(manifest: CheckpointManifest, manifest_uri: str) -> Location:
    """Verify every shard and shared file (size, sha256, content hash); the directory to load."""
    if problems := verify_manifest(manifest, stat_size=local_stat_size, file_sha256=local_sha256):
        raise CheckpointCorruptError(
            f"checkpoint step {manifest.global_step} ({manifest_uri}) failed verification: " + "; ".join(problems)
        )
    return checkpoint_dir_of(manifest, manifest_uri)


def checkpoint_dir_of(manifest: CheckpointManifest, manifest_uri: str) -> Location:
    """The directory of ``manifest``; CheckpointCorruptError when a file it lists is elsewhere."""
    directory = as_location(manifest_uri).parent
    for uri in [s.uri for s in manifest.shards] + [f.uri for f in manifest.extra_files]:
        if as_location(uri).parent != directory:
            raise CheckpointCorruptError(f"checkpoint file {uri} is not beside its manifest {manifest_uri}")
    return directory


def verify_files_shared(
    manifest: CheckpointManifest, *, rank: int, world_size: int,
    gather: Callable[[list[str]], list[list[str]]] | None = None,
) -> list[str]:
    """``verify_manifest`` with the hashing split over the ranks: rank ``r`` reads files ``r, r+W, …``
    and takes the manifest's word for the others; ``gather`` (all_gather_object) unites the
    findings, so every rank returns the same list. Without ``gather`` this rank checks everything."""
    entries = [(s.uri, s.size_bytes, s.sha256) for s in manifest.shards]
    entries += [(f.uri, f.size_bytes, f.sha256) for f in manifest.extra_files]
    if gather is None:
        mine = {uri for uri, _, _ in entries}
    else:
        mine = {uri for uri, _, _ in entries[rank::world_size]}
    expected = {uri: (size, sha) for uri, size, sha in entries}

    def stat_size(uri: str) -> int | None:
        return local_stat_size(uri) if uri in mine else expected[uri][0]

    def file_sha256(uri: str) -> str:
        return local_sha256(uri) if uri in mine else expected[uri][1]

    problems = verify_manifest(manifest, stat_size=stat_size, file_sha256=file_sha256)
    if gather is None:
        return problems
    merged: list[str] = []
    for found in gather(problems):
        merged.extend(p for p in found if p not in merged)
    return merged


def load_checkpoint(state: Mapping[str, Stateful], directory: Location) -> None:
    """``dcp.load`` into ``state`` in place (each Stateful's load_state_dict is called)."""
    reader = (FsspecReader(str(directory), **object_storage_options()) if isinstance(directory, ObjectPath)
              else FileSystemReader(directory))
    try:
        dcp.load(dict(state), storage_reader=reader)
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"could not load checkpoint {directory}: {exc}") from exc


# ----------------------------------------------------------------------------- which checkpoint to restore


@dataclass(frozen=True)
class Candidate:
    """A checkpoint that might be restored: its manifest, or why the manifest could not be read."""

    manifest_uri: str
    global_step: int | None
    attempt: int | None = None
    manifest: CheckpointManifest | None = None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refusal:
    manifest_uri: str
    global_step: int | None
    problems: list[str]
    attempt: int | None = None  # the attempt that wrote it


class NoVerifiedCheckpointError(CheckpointCorruptError):
    """Neither the start checkpoint nor any earlier READY one verifies; ``refused`` says why, each."""

    def __init__(self, refused: list[Refusal]) -> None:
        self.refused = refused
        super().__init__(
            "no checkpoint of this job verifies: "
            + " | ".join(f"step {r.global_step} ({r.manifest_uri}): {'; '.join(r.problems)}" for r in refused)
        )


@dataclass(frozen=True)
class RestoreChoice:
    """What to load (None: start fresh), why, and everything refused on the way."""

    candidate: Candidate | None
    reason: str
    requested: Candidate | None = None
    refused: list[Refusal] = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        return bool(self.refused)


def requested_candidate(ref: CheckpointRef) -> Candidate:
    """The allocation's start checkpoint as a candidate (a manifest that does not match the ref is a problem)."""
    try:
        manifest = read_checkpoint_manifest(ref)
    except CheckpointCorruptError as exc:
        return Candidate(ref.manifest_uri, ref.global_step, ref.attempt, problems=(str(exc),))
    return Candidate(ref.manifest_uri, manifest.global_step, manifest.attempt, manifest)


def find_ready_checkpoints(checkpoints_dir: Location) -> list[Candidate]:
    """Every checkpoint under the job's ``checkpoints_dir`` that has a ``manifest.json``, newest first.

    A directory without a manifest (an interrupted save, a checkpoint the coordinator never
    verified) is not a candidate. A manifest that does not parse is one, with its problem.
    """
    found = []
    for manifest_path in glob(checkpoints_dir, f"*/{MANIFEST_FILE}"):
        uri = location_uri(manifest_path)
        try:
            manifest = CheckpointManifest.model_validate_json(read_bytes(manifest_path))
        except (OSError, ValidationError, ValueError) as exc:
            found.append(Candidate(uri, None, problems=(f"manifest {uri} is malformed: {exc}",)))
            continue
        found.append(Candidate(uri, manifest.global_step, manifest.attempt, manifest))
    return sorted(found, key=lambda c: (c.global_step or -1, c.attempt or -1), reverse=True)


def choose_checkpoint(
    requested: Candidate | None,
    available: Sequence[Candidate],
    verify: Callable[[Candidate], list[str]],
) -> RestoreChoice:
    """The requested checkpoint if it verifies, else the newest earlier one that does. Pure
    (``verify`` is injected: it returns a candidate's problems, empty when it can be loaded).

    Only checkpoints no newer than the requested one are fallbacks (a newer one was not READY
    when the scheduler chose). None verifying is a CheckpointCorruptError listing every reason.
    """
    if requested is None:
        return RestoreChoice(None, "no start checkpoint in the allocation: training starts at step 0")
    problems = list(requested.problems) or verify(requested)
    if not problems:
        return RestoreChoice(requested, f"the allocation's start checkpoint (step {requested.global_step}) verified",
                             requested=requested)
    refused = [Refusal(requested.manifest_uri, requested.global_step, problems, requested.attempt)]
    limit = requested.global_step
    for candidate in available:
        if candidate.manifest_uri == requested.manifest_uri:
            continue
        if limit is not None and candidate.global_step is not None and candidate.global_step > limit:
            continue
        problems = list(candidate.problems) or verify(candidate)
        if not problems:
            reason = (f"the allocation's start checkpoint (step {requested.global_step}, {requested.manifest_uri}) "
                      f"was refused: {'; '.join(refused[0].problems)}; fell back to the previous READY checkpoint, "
                      f"step {candidate.global_step}")
            if len(refused) > 1:
                reason += f" ({len(refused) - 1} more refused on the way)"
            return RestoreChoice(candidate, reason, requested=requested, refused=refused)
        refused.append(Refusal(candidate.manifest_uri, candidate.global_step, problems, candidate.attempt))
    raise NoVerifiedCheckpointError(refused)


# ----------------------------------------------------------------------------- sync / async saving


class StagingBuffers:
    """A host copy of the training state, allocated once and refilled for every save.

    Reusing the buffers saves the page faults of fresh allocations on every checkpoint; on CUDA
    they are pinned, so the device-to-host copies run asynchronously on a side stream.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._signature: tuple[Any, ...] | None = None

    def stage(self, state_dict: dict[str, Any], *, pin: bool = False) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        signature = _signature(state_dict)
        if self._cache is None or signature != self._signature:
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=pin)
            self._signature = signature
        return _copy_state_dict(state_dict, self._cache, non_blocking=pin, type_check=False)


def _signature(tree: Any, path: str = "") -> tuple[Any, ...]:
    if isinstance(tree, dict):
        return tuple(item for key in sorted(tree, key=str) for item in _signature(tree[key], f"{path}/{key}"))
    if isinstance(tree, torch.Tensor):
        return ((path, tuple(tree.shape), tree.dtype, type(tree).__name__),)
    return ()


@dataclass
class _Pending:
    directory: Location
    started: float
    future: Future[SavedShard]
    on_durable: Callable[[SavedShard], None]
    serial: int  # the how-manyth save of this run: the same on every rank (saves are collective)
    staged: threading.Event = field(default_factory=threading.Event)
    stall: float = 0.0


class Checkpointer:
    """Saves checkpoints with the protocol of the module docstring, in ``sync`` or ``async`` mode.

    ``barrier`` and ``agree`` (an element-wise sum over all ranks of a few ints) are collectives
    every rank calls at the same points; ``group`` is the gloo group the background writes use.
    A save's ``on_durable(saved)`` runs on every rank once its shard is under its final, durable
    name (``saved.seconds``: from the start of the save to then). Each public method returns the
    seconds training was held up (the checkpoint stall).

    Async mode, precisely: :meth:`save` takes each Stateful's ``state_dict()`` (references to the
    live tensors, values of everything else) and hands it to a background thread, which copies
    the tensors into :class:`StagingBuffers`, then runs ``dcp.save`` of the copy over ``group``,
    fsyncs and hashes this rank's file. Forward and backward passes do not modify parameters or
    optimizer state, so the next step's computation overlaps the copy; only its optimizer update
    must wait for it (:meth:`before_update`). That wait, and :meth:`save` itself, are the stall.
    """

    def __init__(
        self,
        *,
        rank: int,
        mode: Literal["sync", "async"] = "async",
        barrier: Callable[[], None],
        agree: Callable[[list[int]], list[int]],
        group: Any = None,
        device: torch.device | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.rank = rank
        self.mode = mode
        self.barrier = barrier
        self.agree = agree
        self.group = group
        self.device = device or torch.device("cpu")
        self.clock = clock
        self.pending: _Pending | None = None
        self._serial = 0
        self._buffers = StagingBuffers()

    def save(
        self, state: Mapping[str, Stateful], directory: Location,
        on_durable: Callable[[SavedShard], None] = lambda saved: None,
    ) -> float:
        """Start (async) or run (sync) a save of ``state`` into ``directory``."""
        started = self.clock()
        if self.mode == "sync":
            saved = save_checkpoint(state, directory, rank=self.rank, barrier=self.barrier, clock=self.clock)
            on_durable(saved)
            return self.clock() - started
        self.wait()
        prepare_directory(directory, rank=self.rank, barrier=self.barrier)
        live = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # the copy starts after the work queued so far (the last optimizer step)
        staged = threading.Event()
        future: Future[SavedShard] = Future()

        def write() -> None:
            try:
                future.set_result(self._write_in_background(live, directory, staged, ready))
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread through the future
                future.set_exception(exc)

        # A daemon thread: a rank that fails exits at once instead of waiting for a write (possibly
        # blocked on a dead peer) at interpreter shutdown; an unfinished save never gets its final name.
        threading.Thread(target=write, name=f"trainyard-ckpt-{directory.name}", daemon=True).start()
        self._serial += 1
        self.pending = _Pending(directory, started, future, on_durable, self._serial, staged)
        self.pending.stall = self.clock() - started
        return self.pending.stall

    def before_update(self) -> float:
        """Before an optimizer step changes the state: wait until the pending save has its copy."""
        if self.pending is None or self.pending.staged.is_set():
            return 0.0
        started = self.clock()
        self.pending.staged.wait()
        waited = self.clock() - started
        self.pending.stall += waited
        return waited

    def _write_in_background(
        self, live: dict[str, Any], directory: Location, staged: threading.Event, ready: Any
    ) -> SavedShard:
        try:
            if ready is not None:
                side = torch.cuda.Stream(self.device)
                with torch.cuda.stream(side):
                    side.wait_event(ready)
                    copy = self._buffers.stage(live, pin=True)
                side.synchronize()
            else:
                copy = self._buffers.stage(live)
        finally:
            staged.set()  # never leave training waiting; a failure is reported by the future
        live.clear()
        return write_shard(copy, directory, rank=self.rank, group=self.group)

    def poll(self) -> float:
        """At a step boundary: complete the pending save if every rank's write has finished."""
        if self.pending is None:
            return 0.0
        started = self.clock()
        done, failed = self._agree_on(self.pending)
        if done:
            self._complete(failed)
        return self.clock() - started

    def local_status(self) -> dict[str, Any]:
        """The pending save's serial (0: none), whether its write is done here, whether it failed
        here: what a caller folds into its own agreement (then :meth:`settle` with the answer)."""
        if self.pending is None:
            return {"pending_save": 0, "done": False, "failed": False}
        future = self.pending.future
        return {"pending_save": self.pending.serial, "done": future.done(),
                "failed": future.done() and future.exception() is not None}

    def settle(self, *, done_save: int, failed_save: int) -> float:
        """:meth:`poll` with the agreement made by the caller: complete the pending save when it is
        the save ``done_save`` names (finished on every rank); it failed when ``failed_save`` names it."""
        if self.pending is None or done_save != self.pending.serial:
            return 0.0
        started = self.clock()
        self._complete(failed_save == self.pending.serial)
        return self.clock() - started

    def wait(self) -> float:
        """Block until the pending save (if any) is durable and reported."""
        if self.pending is None:
            return 0.0
        started = self.clock()
        try:
            self.pending.future.result()
        except Exception:  # noqa: BLE001 - reported to every rank through the agreement below
            pass
        _, failed = self._agree_on(self.pending)
        self._complete(failed)
        return self.clock() - started

    def close(self) -> None:
        """Forget a pending save (abandoned: it never gets its final name). Idempotent."""
        self.pending = None

    def _agree_on(self, pending: _Pending) -> tuple[bool, bool]:
        future = pending.future
        not_done = 0 if future.done() else 1
        failed = 1 if future.done() and future.exception() is not None else 0
        total_not_done, total_failed = self.agree([not_done, failed])
        return total_not_done == 0, total_failed > 0

    def _complete(self, failed: bool) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None
        if failed:
            exc = pending.future.exception()
            raise CheckpointError(
                f"background save of {pending.directory} failed"
                + (f" on this rank: {exc}" if exc else " on another rank")
            ) from exc
        saved = pending.future.result()
        publish_directory(pending.directory, rank=self.rank, barrier=self.barrier)
        saved = replace(saved, seconds=self.clock() - pending.started, stall=pending.stall)
        pending.on_durable(saved)
