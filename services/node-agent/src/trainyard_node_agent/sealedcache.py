"""A node-local cache of sealed, content-addressed trees shared by every attempt and job on this node (and
by several agents pointed at one directory): the machinery the code cache (:mod:`codecache`, users' code
trees) and the environment cache (:mod:`envcache`, jobs' Python packages) share.

An entry is ``<cache dir>/<hex>/``: ``tree/`` (files 0444 or 0555, directories 0555), ``digest.json`` (its
:class:`~trainyard_contract.codetree.TreeDigest`), ``entry.json`` (what built it, its size) and ``last-used``
(its mtime drives eviction).

* Materialise once per hash: the subclass builds the tree into ``.tmp-…`` (:meth:`SealedCache.build`), the
  digest is written, the tree made read-only, then the whole entry renamed into place. Two agents or attempts
  racing on one hash both build; the first rename wins, the loser drops its copy and uses the winner's (rename
  of a directory onto a non-empty one fails atomically).
* Before every launch the tree is verified against its digest; a
  tampered entry is counted, moved aside (atomic rename to ``.quarantine/<hex>-<n>``) and built again (an intact
  one the subclass finds out of date, :meth:`SealedCache.stale`, too, without the alarm). It is
  not deleted there and then: ranks of an earlier attempt may still run from it. Collection deletes a
  quarantined tree once no live rank uses that hash (:func:`choose_purges`, pure).
* Eviction (:func:`choose_evictions`, pure): past ``max_bytes`` the least recently used entries that no live
  rank uses go first (quarantined trees do not count: they go as soon as unused).
* Several agents may share one cache directory: an agent holds a shared ``flock`` on ``.holds/<hex>`` for every
  entry it is launching with or its ranks use, and evicts or purges a tree only under an exclusive,
  non-blocking lock of it, so one agent never deletes a tree another agent's ranks use. The kernel drops an
  agent's holds when it dies; the lock files (empty) stay.

The blocking work runs in a thread (:meth:`SealedCache.acquire_entry` is async).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
import contextlib
import errno
import fcntl
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
from typing import Any

from prometheus_client import Counter
from trainyard_contract.codetree import CodeTreeError, TreeDigest, digest_tree, verify_tree
from trainyard_contract.lru import least_recently_used

log = logging.getLogger(__name__)

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
    """The quarantined trees to delete now: those of a hash no live rank uses (or is being launched
    with). A rank started before the tree was moved aside uses that hash, so it keeps the tree; a new
    attempt with the same hash keeps it too, which is merely cautious."""
    return sorted(q.name for q in quarantined if q.hex not in in_use)


@dataclass(frozen=True)
class Collection:
    """What one collection removed."""

    evicted: list[str]  # hashes of entries evicted (least recently used)
    purged: list[str]  # quarantined trees deleted (``<hex>-<n>``)


@dataclass(frozen=True)
class CacheCounters:
    """What a cache counts (each cache its own metric names)."""

    tampered: Counter
    materialised: Counter
    evicted: Counter
    purged: Counter


@dataclass(frozen=True)
class Sealed:
    """A verified entry, ready to use."""

    hex: str
    root: Path  # <entry>/tree
    materialised: bool  # built for this launch (False: reused from the cache)


# ----------------------------------------------------------------------------- the cache


class SealedCache(ABC):
    """A cache of sealed trees under ``root``; see the module docstring. Subclasses say how a tree is built
    (:meth:`build`) and when an intact entry is out of date (:meth:`stale`). ``close()`` drops its
    holds. ``what`` names the entries in logs (``code tree``, ``environment``)."""

    what = "tree"

    def __init__(self, root: Path, *, max_bytes: int, counters: CacheCounters) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.counters = counters
        self._locks: dict[str, asyncio.Lock] = {}
        self._pins: Tally[str] = Tally()  # hashes being prepared for a launch right now
        self._mutex = threading.Lock()  # guards _pins and _holds against the GC thread
        self._holds: dict[str, int] = {}  # hex -> fd holding a shared flock (see the module docstring)

    def entry_dir(self, hex_digest: str) -> Path:
        return self.root / hex_digest

    def tree_dir(self, hex_digest: str) -> Path:
        return self.entry_dir(hex_digest) / TREE

    # ------------------------------------------------------------------ what subclasses say
    @abstractmethod
    def build(self, staging_tree: Path, hex_digest: str, source: Any) -> dict[str, Any]:
        """Blocking: build the tree of ``hex_digest`` from ``source`` into ``staging_tree`` (not there yet);
        what to record in ``entry.json`` besides its size. Raise the job's error (a ConfigError) for the job's
        fault, OSError for this node's."""

    def stale(self, hex_digest: str, meta: dict[str, Any]) -> list[str]:
        """Why an intact entry (its tree matches its digest) is out of date and must be built again (empty: it is
        current), e.g. built over another base. Not tampering: it is moved aside and rebuilt without alarm."""
        return []

    # ------------------------------------------------------------------ acquiring
    async def acquire_entry(self, hex_digest: str, source: Any) -> Sealed:
        """The verified entry of ``hex_digest``, built from ``source`` if needed, pinned until :meth:`release`."""
        with self._mutex:
            self._pins[hex_digest] += 1
        try:
            async with self._locks.setdefault(hex_digest, asyncio.Lock()):  # one build per hash here
                return await asyncio.to_thread(self.prepare, hex_digest, source)
        except BaseException:
            self.release(hex_digest)
            raise

    def release(self, hex_digest: str) -> None:
        with self._mutex:
            self._pins[hex_digest] -= 1
            if self._pins[hex_digest] <= 0:
                del self._pins[hex_digest]

    def prepare(self, hex_digest: str, source: Any) -> Sealed:
        """Blocking: verify the cached entry (build a tampered one again) or build it."""
        self._hold(hex_digest)  # before looking: another agent's collection waits for it, or is done
        entry = self.entry_dir(hex_digest)
        if entry.is_dir():
            problems = self.problems(hex_digest)
            stale = [] if problems else self.stale(hex_digest, self.meta(hex_digest))
            if not problems and not stale:
                self._touch(hex_digest)
                return Sealed(hex_digest, self.tree_dir(hex_digest), materialised=False)
            moved = self.quarantine(hex_digest)
            if problems:
                self.counters.tampered.inc()
                log.error("cached %s sha256:%s does not match its digest (%s): moved aside to %s (ranks still running "
                          "from it keep it until they end) and building it again", self.what, hex_digest,
                          "; ".join(problems[:5]), moved or "(moved by another agent)")
            else:
                log.info("cached %s sha256:%s is out of date (%s): moved aside to %s and building it again",
                         self.what, hex_digest, "; ".join(stale), moved or "(moved by another agent)")
        self.materialise(hex_digest, source)
        problems = self.problems(hex_digest)
        if problems:  # only a concurrent writer could do this: never run it
            raise CodeTreeError(f"the {self.what} sha256:{hex_digest} changed right after it was built "
                                f"({'; '.join(problems[:5])})")
        self._touch(hex_digest)
        return Sealed(hex_digest, self.tree_dir(hex_digest), materialised=True)

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

    def materialise(self, hex_digest: str, source: Any) -> None:
        """Build, digest, seal and rename one entry into place (losing a race is fine)."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".tmp-{hex_digest[:12]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            started = time.monotonic()
            extra = self.build(staging / TREE, hex_digest, source)
            digest = digest_tree(staging / TREE)
            (staging / DIGEST).write_text(digest.dumps())
            size = sum((staging / TREE / name).stat().st_size for name in digest.files)
            (staging / META).write_text(json.dumps({**extra, "bytes": size, "builtAt": time.time(),
                                                    "buildSeconds": round(time.monotonic() - started, 3)}))
            seal(staging / TREE)
            for name in (DIGEST, META):
                os.chmod(staging / name, 0o444)
            try:
                os.rename(staging, self.entry_dir(hex_digest))
            except OSError:  # another agent or attempt won: use its entry (verified by the caller)
                if not self.entry_dir(hex_digest).is_dir():
                    raise
                log.info("%s sha256:%s was built concurrently; using that copy", self.what, hex_digest)
                remove_tree(staging)
                return
        except BaseException:
            remove_tree(staging)
            raise
        self.counters.materialised.inc()
        log.info("built %s sha256:%s (%d files, %d bytes) at %s", self.what, hex_digest, len(digest.files),
                 size, self.tree_dir(hex_digest))

    def meta(self, hex_digest: str) -> dict[str, Any]:
        """What ``entry.json`` of an entry records ({} when unreadable)."""
        try:
            data = json.loads((self.entry_dir(hex_digest) / META).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

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
        :func:`choose_evictions` picks (plus leftovers of crashed builds). ``in_use``: the hashes live ranks
        use; the ones being launched here are added."""
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
                log.info("deleting the quarantined %s %s: no running rank uses it any more", self.what, name)
                remove_tree(self.root / QUARANTINE / name)
                self.counters.purged.inc()
                purged.append(name)
        evicted = []
        for hex_digest in choose_evictions(self.entries(), in_use=keep, max_bytes=self.max_bytes):
            with self._unheld(hex_digest) as free:
                if not free:
                    continue
                log.info("evicting %s sha256:%s from the cache (least recently used)", self.what, hex_digest)
                self._discard(self.entry_dir(hex_digest))
                self.counters.evicted.inc()
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
        """Blocking: a shared flock on the entry's hold file, kept until no rank of ours uses it."""
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
        """Whether no agent holds the entry (and it stays so inside the block): an exclusive,
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
                log.info("%s sha256:%s is in use by another agent sharing %s: kept", self.what, hex_digest, self.root)
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
