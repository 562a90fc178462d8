"""Data near the workers: a node-local cache of dataset shards, with prefetch.

A shard is fetched from the artifact store (an object store, or a shared filesystem) into a
temporary file of the cache directory while its sha256 is computed; only when size and sha256
match the dataset manifest is it renamed to its content-addressed name ``<cache>/<sha256>.bin``.
A file under that name is therefore a verified copy, and a lookup is a hit without re-hashing;
the manifest stays the source of truth (the name *is* the manifest's digest). Ranks of one node
share the directory: concurrent fills of one shard each write their own temporary file, and the
rename is atomic.

:meth:`ShardCache.prefetch` starts fetching the shards a rank reads next in a small thread pool;
:meth:`ShardCache.get` waits for an in-flight fetch instead of starting a second one.

The cache is bounded: before a fetch, least recently used shards (a hit or a fill touches a
shard's mtime) are deleted until the new shard fits within ``max_bytes`` and leaves ``min_free_bytes``
free on the filesystem (:func:`plan_evictions`, pure). Shards this rank is reading or fetching are
never chosen. Deleting a shard another rank has memory-mapped is safe (its pages stay until it is
unmapped); one that was about to open it fetches it again. The bounds are targets: when only shards in
use are left, the fetch goes ahead over the budget rather than failing the rank. Temporary files of
fetches whose process died are deleted too.

Metrics (Prometheus, per rank): ``trainyard_shard_cache_requests_total{rank,result=hit|miss|prefetching}``
(``prefetching``: the lookup waited for a prefetch still in flight),
``trainyard_shard_fetch_seconds{rank}`` (a miss's fetch, histogram),
``trainyard_object_store_errors_total{rank,kind=throttled|error|sha256}``,
``trainyard_shard_cache_evictions_total{rank}`` (shards deleted to make room),
``trainyard_shard_cache_bytes{rank}`` (the cache's size as this rank last saw it).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING, Any

from trainyard_contract.errors import DataError
from trainyard_contract.lru import least_recently_used
from trainyard_contract.storage import HashingWriter, Location, iter_chunks

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["CachedShard", "ShardCache", "ShardCacheMetrics", "error_kind", "plan_evictions"]

log = logging.getLogger(__name__)

_THROTTLED = ("slowdown", "throttl", "too many requests", "503", "requestlimitexceeded")


def error_kind(exc: BaseException) -> str:
    """``throttled`` for an object store's back-off answers (SlowDown, 503, throttling), else ``error``."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "throttled" if any(word in text for word in _THROTTLED) else "error"


class _Unrecorded:
    """A metric that records nothing: the rank's environment has no prometheus-client (it is the SDK's
    ``metrics`` extra, not a dependency: a training environment installs the contract alone)."""

    def labels(self, *_: Any, **__: Any) -> _Unrecorded:
        return self

    def inc(self, *_: Any) -> None: ...

    def observe(self, *_: Any) -> None: ...

    def set(self, *_: Any) -> None: ...


class ShardCacheMetrics:
    """The cache's Prometheus metrics, registered once per registry (unrecorded without prometheus-client)."""

    # by the registry itself, held weakly: an id() can be reused once a registry is gone (tests make many)
    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ShardCacheMetrics] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()
    # prometheus-client's metrics, or stand-ins that record nothing
    requests: Any
    fetch_seconds: Any
    errors: Any
    evictions: Any
    bytes: Any

    def __init__(self, registry: CollectorRegistry | None) -> None:
        if registry is None:
            self.requests = self.fetch_seconds = self.errors = self.evictions = self.bytes = _Unrecorded()
            return
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter("trainyard_shard_cache_requests", "dataset shard lookups in the node-local cache",
                                ["rank", "result"], registry=registry)
        self.fetch_seconds = Histogram("trainyard_shard_fetch_seconds",
                                       "time to fetch and verify a dataset shard on a cache miss", ["rank"],
                                       buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry)
        self.errors = Counter("trainyard_object_store_errors", "failed shard fetches from the artifact store",
                              ["rank", "kind"], registry=registry)
        self.evictions = Counter("trainyard_shard_cache_evictions", "cached dataset shards deleted to make room",
                                 ["rank"], registry=registry)
        self.bytes = Gauge("trainyard_shard_cache_bytes", "bytes of verified shards in the node-local cache",
                           ["rank"], registry=registry)

    @classmethod
    def of(cls, registry: CollectorRegistry | None = None) -> ShardCacheMetrics:
        if registry is None:
            try:
                from prometheus_client import REGISTRY
            except ImportError:
                return cls(None)
            registry = REGISTRY
        with cls._lock:
            if registry not in cls._by_registry:
                cls._by_registry[registry] = cls(registry)
            return cls._by_registry[registry]


@dataclass(frozen=True)
class CachedShard:
    """A verified shard in the cache: its sha256, size and when a rank last used it (mtime)."""

    sha256: str
    size_bytes: int
    last_used: float


def plan_evictions(cached: Sequence[CachedShard], *, incoming: int, max_bytes: int | None, free_bytes: int,
                   min_free_bytes: int, keep: Collection[str]) -> list[str]:
    """The shards to delete, least recently used first and none in ``keep``, so that a new shard of
    ``incoming`` bytes fits: the cache at most ``max_bytes`` (None: no budget) and at least
    ``min_free_bytes`` left free on the filesystem. Fewer (possibly none) when the shards not in ``keep``
    do not suffice: the bounds are targets, not a reason to fail a rank."""
    total = sum(c.size_bytes for c in cached)
    over_budget = 0 if max_bytes is None else total + incoming - max_bytes
    short_of_free = min_free_bytes - (free_bytes - incoming)
    return least_recently_used(((c.sha256, c.size_bytes, c.last_used) for c in cached),
                               need_bytes=max(over_budget, short_of_free), keep=keep)


class ShardCache:
    """Verified, content-addressed copies of dataset shards in ``directory`` (node-local), at most
    ``max_bytes`` of them (None: bounded by ``min_free_bytes`` of free disk only). The ``keep_recent``
    shards this rank last got or prefetched are never evicted (a reader keeps a few mapped)."""

    def __init__(self, directory: Path, *, rank: int = 0, workers: int = 2, max_bytes: int | None = None,
                 min_free_bytes: int = 1 << 30, keep_recent: int = 16, metrics: ShardCacheMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = str(rank)
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.keep_recent = keep_recent
        self.metrics = metrics or ShardCacheMetrics.of()
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trainyard-shard-fetch")
        self._inflight: dict[str, Future[Path]] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def path_of(self, sha256: str) -> Path:
        return self.directory / f"{sha256}.bin"

    def get(self, source: Location, sha256: str, size_bytes: int) -> Path:
        """The local path of the shard at ``source``: cached, or fetched and verified now."""
        path = self.path_of(sha256)
        with self._lock:
            future = self._inflight.get(sha256)
        self._used(sha256)
        if future is None and _has(path, size_bytes):
            self.metrics.requests.labels(self.rank, "hit").inc()
            _touch(path)
            return path
        self.metrics.requests.labels(self.rank, "miss" if future is None else "prefetching").inc()
        return (future or self._submit(source, sha256, size_bytes)).result()

    def prefetch(self, source: Location, sha256: str, size_bytes: int) -> None:
        """Start fetching a shard the rank will read soon (nothing when cached or in flight)."""
        self._used(sha256)
        if not _has(self.path_of(sha256), size_bytes):
            self._submit(source, sha256, size_bytes)

    def close(self) -> None:
        """Stop prefetching (in-flight fetches finish). Idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, source: Location, sha256: str, size_bytes: int) -> Future[Path]:
        with self._lock:
            if (future := self._inflight.get(sha256)) is not None:
                return future
            future = self._pool.submit(self._fetch, source, sha256, size_bytes)
            self._inflight[sha256] = future
        # outside the lock: a future already done runs the callback here, at once
        future.add_done_callback(lambda done: self._forget(sha256, done))
        return future

    def _forget(self, sha256: str, done: Future[Path]) -> None:
        with self._lock:
            if self._inflight.get(sha256) is done:
                del self._inflight[sha256]

    def _used(self, sha256: str) -> None:
        with self._lock:
            self._recent[sha256] = None
            self._recent.move_to_end(sha256)
            while len(self._recent) > self.keep_recent:
                self._recent.popitem(last=False)

    def make_room(self, incoming: int) -> list[str]:
        """Delete least recently used shards so that ``incoming`` more bytes fit the bounds; the deleted
        shards' sha256. Also deletes temporary files of fetches whose process is gone. The size gauge
        counts the incoming shard."""
        cached = self._scan()
        with self._lock:
            keep = set(self._inflight) | set(self._recent)
        free = shutil.disk_usage(self.directory).free
        chosen = plan_evictions(cached, incoming=incoming, max_bytes=self.max_bytes, free_bytes=free,
                                min_free_bytes=self.min_free_bytes, keep=keep)
        for sha256 in chosen:
            self.path_of(sha256).unlink(missing_ok=True)  # another rank may have deleted it first
        if chosen:
            self.metrics.evictions.labels(self.rank).inc(len(chosen))
            log.info("shard cache %s: deleted %d least recently used shard(s) to make room for %d bytes",
                     self.directory, len(chosen), incoming)
        gone = set(chosen)
        self.metrics.bytes.labels(self.rank).set(sum(c.size_bytes for c in cached if c.sha256 not in gone) + incoming)
        return chosen

    def _scan(self) -> list[CachedShard]:
        cached = []
        for entry in os.scandir(self.directory):
            try:
                if entry.name.startswith("."):
                    _remove_if_orphaned(entry)
                elif entry.name.endswith(".bin"):
                    st = entry.stat()
                    cached.append(CachedShard(entry.name[: -len(".bin")], st.st_size, st.st_mtime))
            except FileNotFoundError:
                continue  # deleted meanwhile by another rank
        return cached

    def _fetch(self, source: Location, sha256: str, size_bytes: int) -> Path:
        started = self.clock()
        final = self.path_of(sha256)
        self.make_room(size_bytes)
        tmp = final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as out:
                hashing = HashingWriter(out)
                try:
                    for chunk in iter_chunks(source):
                        hashing.write(chunk)
                except OSError as exc:
                    self.metrics.errors.labels(self.rank, error_kind(exc)).inc()
                    raise DataError(f"cannot fetch dataset shard {source}: {exc}", retryable=True) from exc
                if hashing.size != size_bytes or hashing.hexdigest() != sha256:
                    self.metrics.errors.labels(self.rank, "sha256").inc()
                    raise DataError(f"dataset shard {source} has {hashing.size} bytes, sha256 "
                                    f"{hashing.hexdigest()[:12]}…; the manifest says {size_bytes} bytes, "
                                    f"{sha256[:12]}…: not cached")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)  # only a verified copy ever has the content-addressed name
        finally:
            tmp.unlink(missing_ok=True)
        self.metrics.fetch_seconds.labels(self.rank).observe(self.clock() - started)
        return final


def _touch(path: Path) -> None:
    """Mark a shard used now (its mtime orders evictions)."""
    try:
        os.utime(path)
    except OSError:
        pass  # deleted meanwhile: the caller maps it or fetches it again


def _remove_if_orphaned(entry: os.DirEntry[str]) -> None:
    """Delete ``.<sha256>.bin.<pid>-<hex>``, a fetch's temporary file, once that process is gone."""
    try:
        pid = int(entry.name.rsplit(".", 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        Path(entry.path).unlink(missing_ok=True)
    except PermissionError:
        pass  # alive, someone else's


def _has(path: Path, size_bytes: int) -> bool:
    try:
        return path.stat().st_size == size_bytes
    except FileNotFoundError:
        return False

