"""The node-local cache of users' code trees, one entry per archive hash, shared by every attempt
and job on this node, and the paths a rank of user code runs with.

An entry is ``<cache dir>/<hex>/``: ``tree/`` (the extracted archive: files 0444 or 0555,
directories 0555), ``digest.json`` (its :class:`~trainyard_contract.codetree.TreeDigest`),
``entry.json`` (archive id, size) and ``last-used`` (its mtime drives eviction).

* Materialise once per hash: read the archive from the artifact store, check its sha256 (a
  mismatch is refused, never run), extract into ``.tmp-…``, write the digest, make the tree
  read-only, then rename the whole entry into place. Two agents or attempts racing on one hash
  both extract; the first rename wins, the loser drops its copy and uses the winner's (rename
  of a directory onto a non-empty one fails atomically).
* Before every launch the tree is verified against its digest; a tampered entry is counted, moved
  aside (atomic rename to ``.quarantine/<hex>-<n>``) and materialised again. It is not deleted
  there and then: ranks of an earlier attempt may still run from it (their working directory and
  the files they import next are in it). Collection deletes a quarantined tree once no live rank
  runs that archive (:func:`choose_purges`, pure).
* Eviction (:func:`choose_evictions`, pure): past ``max_bytes`` the least recently used entries
  that no live rank uses go first (quarantined trees do not count: they go as soon as unused).
* Several agents may share one cache directory (agents of one host pointed at one
  ``TRAINYARD_CODE_CACHE_DIR``): an agent holds a shared ``flock`` on ``.holds/<hex>`` for every
  archive it is launching or its ranks run, and evicts or purges a tree only under an exclusive,
  non-blocking lock of it, so one agent never deletes a tree another agent's ranks run from. The
  kernel drops an agent's holds when it dies; the lock files (empty) stay.

The blocking work runs in a thread (:meth:`CodeCache.acquire` is async).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
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
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter
from trainyard_contract.codetree import (
    CodeTreeError,
    TreeDigest,
    archive_hex,
    extract,
    verify_tree,
)
from trainyard_contract.lru import least_recently_used
from trainyard_contract.spec import Code
from trainyard_contract.storage import ArtifactLayout, read_bytes

log = logging.getLogger(__name__)

TAMPERED = Counter("trainyard_node_agent_code_cache_tampered_total",
                   "cached code trees that no longer matched their digest before a launch (quarantined, "
                   "re-materialised)")
MATERIALISED = Counter("trainyard_node_agent_code_cache_materialised_total",
                       "code archives extracted into the node's code cache")
EVICTED = Counter("trainyard_node_agent_code_cache_evicted_total",
                  "code cache entries removed to stay under TRAINYARD_CODE_CACHE_MAX_BYTES")
PURGED = Counter("trainyard_node_agent_code_cache_quarantine_purged_total",
                 "quarantined (tampered) code trees deleted once no running rank used them")

TREE, DIGEST, META, USED = "tree", "digest.json", "entry.json", "last-used"
QUARANTINE = ".quarantine"
HOLDS = ".holds"
_QUARANTINE_TRIES = 100
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
    return least_recently_used(((e.hex, e.size_bytes, e.last_used) for e in entries),
                               need_bytes=sum(e.size_bytes for e in entries) - max_bytes, keep=in_use)


@dataclass(frozen=True)
class Quarantined:
    """A tampered entry moved aside (``.quarantine/<name>``, name ``<hex>-<n>``)."""

    name: str
    hex: str


def quarantine_name(hex_digest: str, taken: Iterable[str]) -> str:
    """``<hex>-<n>``, ``n`` one past the highest already used for this hash (1 for the first)."""
    used = [int(q.name.rpartition("-")[2]) for q in map(parse_quarantined, taken)
            if q is not None and q.hex == hex_digest]
    return f"{hex_digest}-{max(used, default=0) + 1}"


def parse_quarantined(name: str) -> Quarantined | None:
    """The entry a ``.quarantine`` directory name stands for, or None for anything else."""
    head, _, number = name.rpartition("-")
    return Quarantined(name, head) if head and number.isdigit() else None


def choose_purges(quarantined: Sequence[Quarantined], *, in_use: AbstractSet[str]) -> list[str]:
    """The quarantined trees to delete now: those of an archive no live rank runs (or is being launched
    with). A rank started before the tree was moved aside runs that archive, so it keeps the tree; a new
    attempt of the same archive keeps it too, which is merely cautious."""
    return sorted(q.name for q in quarantined if q.hex not in in_use)


@dataclass(frozen=True)
class Collection:
    """What one collection removed."""

    evicted: list[str]  # hashes of entries evicted (least recently used)
    purged: list[str]  # quarantined trees deleted (``<hex>-<n>``)


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
               code_dir: Path, working_dir: str | None, node_layout: ArtifactLayout | None = None) -> RankPaths:
    """The paths of one rank of user code (no I/O); its attempt directory under ``node_layout`` (this
    node's own files) when given, else under ``layout``."""
    attempt_dir = (node_layout or layout).attempt_dir(tenant, job_id, attempt)
    return RankPaths(
        code_dir=code_dir, cwd=code_dir / (working_dir or "."), datasets=(layout.dataset_ref_dir(dataset),),
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
    """The node's code cache under ``root``; see the module docstring. ``close()`` drops its holds."""

    def __init__(self, root: Path, layout: ArtifactLayout, *, max_bytes: int) -> None:
        self.root = root
        self.layout = layout
        self.max_bytes = max_bytes
        self._locks: dict[str, asyncio.Lock] = {}
        self._pins: Tally[str] = Tally()  # hashes being prepared for a launch right now
        self._mutex = threading.Lock()  # guards _pins and _holds against the GC thread
        self._holds: dict[str, int] = {}  # hex -> fd holding a shared flock (see the module docstring)

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
        self._hold(hex_digest)  # before looking: another agent's collection waits for it, or is done
        entry = self.entry_dir(hex_digest)
        if entry.is_dir():
            problems = self.problems(hex_digest)
            if not problems:
                self._touch(hex_digest)
                return CodeTree(hex_digest, self.tree_dir(hex_digest), materialised=False)
            TAMPERED.inc()
            moved = self.quarantine(hex_digest)
            log.error("cached code tree sha256:%s does not match its digest (%s): moved aside to %s (ranks "
                      "still running from it keep it until they end) and extracting it again", hex_digest,
                      "; ".join(problems[:5]), moved or "(moved by another agent)")
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
            data = read_bytes(source)  # a file, or an object under an object-store root
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

    def quarantined(self) -> list[Quarantined]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for path in (self.root / QUARANTINE).iterdir():
                if (q := parse_quarantined(path.name)) is not None:
                    found.append(q)
        return found

    def quarantine(self, hex_digest: str) -> Path | None:
        """Blocking: move an entry aside into ``.quarantine/<hex>-<n>`` (one atomic rename: a rank running
        from it keeps every file); None when it is gone already (another agent moved it)."""
        place = self.root / QUARANTINE
        place.mkdir(parents=True, exist_ok=True)
        for _ in range(_QUARANTINE_TRIES):
            target = place / quarantine_name(hex_digest, (p.name for p in place.iterdir()))
            if target.exists():  # taken since the listing (another agent): list again
                continue
            try:
                os.rename(self.entry_dir(hex_digest), target)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another agent took that name: the next one
                    continue
                raise
            return target
        raise OSError(errno.EEXIST, f"cannot find a free name in {place} for sha256:{hex_digest}")

    def collect(self, in_use: Iterable[str]) -> Collection:
        """Blocking: delete the quarantined trees :func:`choose_purges` picks and evict what
        :func:`choose_evictions` picks (plus leftovers of crashed extractions). ``in_use``: the archives
        (hex) live ranks run; the ones being launched here are added."""
        self._sweep_leftovers()
        with self._mutex:
            keep = set(in_use) | set(self._pins)
            for hex_digest in set(self._holds) - keep:  # no rank of ours runs it any more
                os.close(self._holds.pop(hex_digest))
            unheld = keep - set(self._holds)
        for hex_digest in unheld:  # ranks adopted after an agent restart: hold what they run
            self._hold(hex_digest)
        purged = []
        for name in choose_purges(self.quarantined(), in_use=keep):
            hex_digest = parse_quarantined(name).hex  # type: ignore[union-attr]  # it parsed when listed
            with self._unheld(hex_digest) as free:
                if not free:
                    continue
                log.info("deleting the quarantined code tree %s: no running rank uses it any more", name)
                remove_tree(self.root / QUARANTINE / name)
                PURGED.inc()
                purged.append(name)
        evicted = []
        for hex_digest in choose_evictions(self.entries(), in_use=keep, max_bytes=self.max_bytes):
            with self._unheld(hex_digest) as free:
                if not free:
                    continue
                log.info("evicting code tree sha256:%s from the cache (least recently used)", hex_digest)
                self._discard(self.entry_dir(hex_digest))
                EVICTED.inc()
                evicted.append(hex_digest)
        return Collection(evicted=evicted, purged=purged)

    def close(self) -> None:
        """Drop this agent's holds (the process ending drops them too). Idempotent."""
        with self._mutex:
            while self._holds:
                os.close(self._holds.popitem()[1])

    def _hold_file(self, hex_digest: str) -> Path:
        return self.root / HOLDS / hex_digest

    def _hold(self, hex_digest: str) -> None:
        """Blocking: a shared flock on the archive's hold file, kept until no rank of ours runs it."""
        with self._mutex:
            if hex_digest in self._holds:
                return
        (self.root / HOLDS).mkdir(parents=True, exist_ok=True)
        fd = os.open(self._hold_file(hex_digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while another agent evicts it (moments)
        except BaseException:
            os.close(fd)
            raise
        with self._mutex:
            if hex_digest in self._holds:  # held meanwhile by another launch here
                os.close(fd)
            else:
                self._holds[hex_digest] = fd

    @contextlib.contextmanager
    def _unheld(self, hex_digest: str) -> Iterator[bool]:
        """Whether no agent holds the archive (and it stays so inside the block): an exclusive,
        non-blocking flock of its hold file."""
        try:
            (self.root / HOLDS).mkdir(parents=True, exist_ok=True)
            fd = os.open(self._hold_file(hex_digest), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            log.warning("cannot open the hold file of sha256:%s (%s): leaving it alone", hex_digest, exc)
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("code tree sha256:%s is in use by another agent sharing %s: kept", hex_digest, self.root)
                yield False
                return
            yield True
        finally:
            os.close(fd)

    async def acollect(self, in_use: Iterable[str]) -> Collection:
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
        """Move an unused entry out of the way atomically (no reader ever sees half of it), then delete it."""
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
