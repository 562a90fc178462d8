"""The node-local cache of users' code trees, one entry per archive hash, shared by every attempt
and job on this node, and the paths a rank of user code runs with.

An entry is ``<cache dir>/<hex>/``: ``tree/`` (the extracted archive: files 0444 or 0555,
directories 0555), ``digest.json`` (its :class:`~trainyard_common.codetree.TreeDigest`),
``entry.json`` (archive id, size) and ``last-used`` (its mtime drives eviction).

* Materialise once per hash: read the archive from the artifact store, check its sha256 (a
  mismatch is refused, never run), extract into ``.tmp-…``, write the digest, make the tree
  read-only, then rename the whole entry into place. Two agents or attempts racing on one hash
  both extract; the first rename wins, the loser drops its copy and uses the winner's (rename
  of a directory onto a non-empty one fails atomically).
* Before every launch the tree is verified against its digest; a tampered entry is moved aside
  (atomic rename to ``.trash-…``), counted, and materialised again.
* Eviction (:func:`choose_evictions`, pure): past ``max_bytes`` the least recently used entries
  that no live rank uses go first.

The blocking work runs in a thread (:meth:`CodeCache.acquire` is async).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections import Counter as Tally
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter
from trainyard_common.codetree import (
    CodeTreeError,
    TreeDigest,
    archive_hex,
    extract,
    verify_tree,
)
from trainyard_common.spec import Code
from trainyard_common.storage import ArtifactLayout

log = logging.getLogger(__name__)

TAMPERED = Counter("trainyard_node_agent_code_cache_tampered_total",
                   "cached code trees that no longer matched their digest before a launch (removed, re-materialised)")
MATERIALISED = Counter("trainyard_node_agent_code_cache_materialised_total",
                       "code archives extracted into the node's code cache")
EVICTED = Counter("trainyard_node_agent_code_cache_evicted_total",
                  "code cache entries removed to stay under TRAINYARD_CODE_CACHE_MAX_BYTES")

TREE, DIGEST, META, USED = "tree", "digest.json", "entry.json", "last-used"
_STALE_TMP_S = 3600.0


# ----------------------------------------------------------------------------- pure helpers


@dataclass(frozen=True)
class CacheEntry:
    """One materialised tree, as eviction sees it."""

    hex: str
    size_bytes: int
    last_used: float  # seconds since the epoch


def choose_evictions(entries: Sequence[CacheEntry], *, in_use: AbstractSet[str], max_bytes: int) -> list[str]:
    """The entries to remove so the cache fits in ``max_bytes``: least recently used first, never one
    in ``in_use`` (entries in use still count towards the total, so the cache may stay over)."""
    total = sum(e.size_bytes for e in entries)
    evict = []
    for entry in sorted(entries, key=lambda e: (e.last_used, e.hex)):
        if total <= max_bytes:
            break
        if entry.hex in in_use:
            continue
        evict.append(entry.hex)
        total -= entry.size_bytes
    return evict


@dataclass(frozen=True)
class RankPaths:
    """Everything on disk a rank of user code may touch. One place, so a sandbox (a later issue) can
    bind exactly these: the code tree read-only, the datasets read-only, the job's checkpoint
    prefix and the rank's scratch directory writable, plus the attempt's own files."""

    code_dir: Path  # the verified tree (TRAINYARD_CODE_DIR), read-only
    cwd: Path  # <code_dir>/<workingDir or .>
    datasets: tuple[Path, ...]  # read-only
    checkpoints: Path  # the job's checkpoint prefix, writable
    scratch: Path  # the rank's own scratch directory (TRAINYARD_SCRATCH_DIR), writable, per attempt
    attempt_dir: Path  # logs, spool, exit note, checkpoint request file


def rank_paths(layout: ArtifactLayout, *, tenant: str, job_id: str, attempt: int, rank: int, dataset: str,
               code_dir: Path, working_dir: str | None) -> RankPaths:
    """The paths of one rank of user code (no I/O)."""
    name, _, version = dataset.partition("@")
    attempt_dir = layout.attempt_dir(tenant, job_id, attempt)
    return RankPaths(
        code_dir=code_dir, cwd=code_dir / (working_dir or "."), datasets=(layout.dataset_dir(name, version),),
        checkpoints=layout.checkpoints_dir(tenant, job_id), scratch=attempt_dir / "scratch" / f"rank-{rank}",
        attempt_dir=attempt_dir,
    )


def code_archive_path(layout: ArtifactLayout, tenant: str, hex_digest: str) -> Path:
    """``<artifact root>/tenants/<tenant>/code/sha256/<hex>.tar.gz``: where the API stored the archive."""
    return layout.code_archive(tenant, hex_digest)


def check_archive(data: bytes, hex_digest: str, where: Path) -> None:
    """CodeTreeError unless ``data`` is the archive ``sha256:<hex_digest>``."""
    got = hashlib.sha256(data).hexdigest()
    if got != hex_digest:
        raise CodeTreeError(f"the code archive at {where} is sha256:{got}, not the sha256:{hex_digest} the job "
                            "names (corrupted or replaced after upload): not running it; submit the code again")


# ----------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class CodeTree:
    """A verified tree, ready to run."""

    hex: str
    root: Path  # <entry>/tree
    materialised: bool  # extracted for this launch (False: reused from the cache)


class CodeCache:
    """The node's code cache under ``root``; see the module docstring. ``close()`` only drops pins."""

    def __init__(self, root: Path, layout: ArtifactLayout, *, max_bytes: int) -> None:
        self.root = root
        self.layout = layout
        self.max_bytes = max_bytes
        self._locks: dict[str, asyncio.Lock] = {}
        self._pins: Tally[str] = Tally()  # hashes being prepared for a launch right now
        self._mutex = threading.Lock()  # guards _pins against the GC thread

    def entry_dir(self, hex_digest: str) -> Path:
        return self.root / hex_digest

    def tree_dir(self, hex_digest: str) -> Path:
        return self.entry_dir(hex_digest) / TREE

    async def acquire(self, tenant: str, code: Code) -> CodeTree:
        """The verified tree of ``code.archive``, materialised if needed, pinned until :meth:`release`.

        CodeTreeError (a ConfigError: the job's fault) when the archive is missing, not the one named,
        or cannot be extracted."""
        if code.archive is None:
            raise CodeTreeError("code.archive is not set: the API resolves code.repo to an archive at submission")
        hex_digest = archive_hex(code.archive)
        with self._mutex:
            self._pins[hex_digest] += 1
        try:
            async with self._locks.setdefault(hex_digest, asyncio.Lock()):  # one materialisation per hash here
                return await asyncio.to_thread(self.prepare, tenant, hex_digest)
        except BaseException:
            self.release(hex_digest)
            raise

    def release(self, hex_digest: str) -> None:
        with self._mutex:
            self._pins[hex_digest] -= 1
            if self._pins[hex_digest] <= 0:
                del self._pins[hex_digest]

    def prepare(self, tenant: str, hex_digest: str) -> CodeTree:
        """Blocking: verify the cached tree (re-materialise a tampered one) or materialise it."""
        entry = self.entry_dir(hex_digest)
        if entry.is_dir():
            problems = self.problems(hex_digest)
            if not problems:
                self._touch(hex_digest)
                return CodeTree(hex_digest, self.tree_dir(hex_digest), materialised=False)
            TAMPERED.inc()
            log.error("cached code tree sha256:%s does not match its digest (%s): removing it and "
                      "extracting it again", hex_digest, "; ".join(problems[:5]))
            self._discard(entry)
        self.materialise(tenant, hex_digest)
        problems = self.problems(hex_digest)
        if problems:  # only a concurrent writer could do this: never run it
            raise CodeTreeError(f"the code tree sha256:{hex_digest} changed right after extraction "
                                f"({'; '.join(problems[:5])})")
        self._touch(hex_digest)
        return CodeTree(hex_digest, self.tree_dir(hex_digest), materialised=True)

    def problems(self, hex_digest: str) -> list[str]:
        """Differences between the cached tree and its stored digest (empty: intact)."""
        try:
            expected = TreeDigest.loads((self.entry_dir(hex_digest) / DIGEST).read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [f"{DIGEST}: unreadable ({exc})"]
        tree = self.tree_dir(hex_digest)
        if not tree.is_dir():
            return [f"{TREE}/: missing"]
        return verify_tree(tree, expected)

    def materialise(self, tenant: str, hex_digest: str) -> None:
        """Read, check, extract, seal and rename one archive into place (losing a race is fine)."""
        source = code_archive_path(self.layout, tenant, hex_digest)
        try:
            data = source.read_bytes()
        except FileNotFoundError:
            raise CodeTreeError(f"the code archive sha256:{hex_digest} is not in the artifact store ({source}): "
                                "upload it again (trainyard submit --code DIR)") from None
        except OSError as exc:
            raise CodeTreeError(f"cannot read the code archive {source}: {exc}") from exc
        check_archive(data, hex_digest, source)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".tmp-{hex_digest[:12]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            digest = _extract(data, staging / TREE)
            (staging / DIGEST).write_text(digest.dumps())
            size = sum((staging / TREE / name).stat().st_size for name in digest.files)
            (staging / META).write_text(json.dumps({"archive": f"sha256:{hex_digest}", "bytes": size,
                                                    "materialisedAt": time.time()}))
            seal(staging / TREE)
            for name in (DIGEST, META):
                os.chmod(staging / name, 0o444)
            try:
                os.rename(staging, self.entry_dir(hex_digest))
            except OSError:  # another agent or attempt won: use its entry (verified by the caller)
                if not self.entry_dir(hex_digest).is_dir():
                    raise
                log.info("code tree sha256:%s was materialised concurrently; using that copy", hex_digest)
                remove_tree(staging)
                return
        except BaseException:
            remove_tree(staging)
            raise
        MATERIALISED.inc()
        log.info("materialised code tree sha256:%s (%d files, %d bytes) at %s", hex_digest, len(digest.files),
                 size, self.tree_dir(hex_digest))

    # ------------------------------------------------------------------ garbage collection
    def entries(self) -> list[CacheEntry]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for path in self.root.iterdir():
                if path.name.startswith(".") or not path.is_dir():
                    continue
                try:
                    size = int(json.loads((path / META).read_text())["bytes"])
                except (OSError, ValueError, KeyError, TypeError):
                    size = _du(path)
                try:
                    used = (path / USED).stat().st_mtime
                except OSError:
                    used = path.stat().st_mtime
                found.append(CacheEntry(path.name, size, used))
        return found

    def collect(self, in_use: Iterable[str]) -> list[str]:
        """Blocking: remove what :func:`choose_evictions` picks (plus leftovers of crashed extractions)."""
        self._sweep_leftovers()
        with self._mutex:
            keep = set(in_use) | set(self._pins)
        evicted = choose_evictions(self.entries(), in_use=keep, max_bytes=self.max_bytes)
        for hex_digest in evicted:
            log.info("evicting code tree sha256:%s from the cache (least recently used)", hex_digest)
            self._discard(self.entry_dir(hex_digest))
            EVICTED.inc()
        return evicted

    async def acollect(self, in_use: Iterable[str]) -> list[str]:
        return await asyncio.to_thread(self.collect, list(in_use))

    def _sweep_leftovers(self) -> None:
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            for path in self.root.iterdir():
                if path.name.startswith(".trash-"):
                    remove_tree(path)
                elif path.name.startswith(".tmp-"):
                    with contextlib.suppress(OSError):
                        if now - path.stat().st_mtime > _STALE_TMP_S:
                            remove_tree(path)

    def _discard(self, entry: Path) -> None:
        """Move an entry out of the way atomically (no reader ever sees half of it), then delete it."""
        trash = self.root / f".trash-{entry.name[:12]}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return
        remove_tree(trash)

    def _touch(self, hex_digest: str) -> None:
        with contextlib.suppress(OSError):
            (self.entry_dir(hex_digest) / USED).touch()


def _extract(data: bytes, dest: Path) -> TreeDigest:
    """:func:`extract`, with the node's own trouble (disk full, permissions) raised as the OSError it is:
    that is not the job's fault, unlike an archive that cannot be read."""
    try:
        return extract(data, dest)
    except CodeTreeError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError) and not isinstance(cause, FileExistsError):
            raise OSError(cause.errno, f"extracting into the code cache: {cause.strerror}", cause.filename) from exc
        raise


def seal(tree: Path) -> None:
    """Make a tree read-only: files 0444 (0555 if executable), directories 0555 (bottom-up)."""
    for directory, dirnames, filenames in os.walk(tree, topdown=False):
        base = Path(directory)
        for name in filenames:
            path = base / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            os.chmod(path, 0o555 if mode & stat.S_IXUSR else 0o444)
        for name in dirnames:
            if not (base / name).is_symlink():
                os.chmod(base / name, 0o555)
    os.chmod(tree, 0o555)


def remove_tree(path: Path) -> None:
    """``rm -rf`` that also works on a sealed tree (directories made writable first)."""
    if not path.exists() and not path.is_symlink():
        return
    for directory, dirnames, _ in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o755)
        for name in dirnames:
            with contextlib.suppress(OSError):
                if not (Path(directory) / name).is_symlink():
                    os.chmod(Path(directory) / name, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def _du(path: Path) -> int:
    total = 0
    for directory, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += (Path(directory) / name).lstat().st_size
    return total
