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

Metrics (Prometheus, per rank): ``trainyard_shard_cache_requests_total{rank,result=hit|miss|prefetching}``
(``prefetching``: the lookup waited for a prefetch still in flight),
``trainyard_shard_fetch_seconds{rank}`` (a miss's fetch, histogram),
``trainyard_object_store_errors_total{rank,kind=throttled|error|sha256}``.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from trainyard_common.errors import DataError
from trainyard_common.storage import HashingWriter, Location, iter_chunks

__all__ = ["ShardCache", "ShardCacheMetrics", "error_kind"]

_THROTTLED = ("slowdown", "throttl", "too many requests", "503", "requestlimitexceeded")


def error_kind(exc: BaseException) -> str:
    """``throttled`` for an object store's back-off answers (SlowDown, 503, throttling), else ``error``."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "throttled" if any(word in text for word in _THROTTLED) else "error"


class ShardCacheMetrics:
    """The cache's Prometheus metrics, registered once per registry."""

    _by_registry: dict[int, ShardCacheMetrics] = {}
    _lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("trainyard_shard_cache_requests", "dataset shard lookups in the node-local cache",
                                ["rank", "result"], registry=registry)
        self.fetch_seconds = Histogram("trainyard_shard_fetch_seconds",
                                       "time to fetch and verify a dataset shard on a cache miss", ["rank"],
                                       buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry)
        self.errors = Counter("trainyard_object_store_errors", "failed shard fetches from the artifact store",
                              ["rank", "kind"], registry=registry)

    @classmethod
    def of(cls, registry: CollectorRegistry | None = None) -> ShardCacheMetrics:
        registry = registry or REGISTRY
        with cls._lock:
            if id(registry) not in cls._by_registry:
                cls._by_registry[id(registry)] = cls(registry)
            return cls._by_registry[id(registry)]


class ShardCache:
    """Verified, content-addressed copies of dataset shards in ``directory`` (node-local)."""

    def __init__(self, directory: Path, *, rank: int = 0, workers: int = 2,
                 metrics: ShardCacheMetrics | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = str(rank)
        self.metrics = metrics or ShardCacheMetrics.of()
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trainyard-shard-fetch")
        self._inflight: dict[str, Future[Path]] = {}
        self._lock = threading.Lock()

    def path_of(self, sha256: str) -> Path:
        return self.directory / f"{sha256}.bin"

    def get(self, source: Location, sha256: str, size_bytes: int) -> Path:
        """The local path of the shard at ``source``: cached, or fetched and verified now."""
        path = self.path_of(sha256)
        with self._lock:
            future = self._inflight.get(sha256)
        if future is None and _has(path, size_bytes):
            self.metrics.requests.labels(self.rank, "hit").inc()
            return path
        self.metrics.requests.labels(self.rank, "miss" if future is None else "prefetching").inc()
        return (future or self._submit(source, sha256, size_bytes)).result()

    def prefetch(self, source: Location, sha256: str, size_bytes: int) -> None:
        """Start fetching a shard the rank will read soon (nothing when cached or in flight)."""
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

    def _fetch(self, source: Location, sha256: str, size_bytes: int) -> Path:
        started = self.clock()
        final = self.path_of(sha256)
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


def _has(path: Path, size_bytes: int) -> bool:
    try:
        return path.stat().st_size == size_bytes
    except FileNotFoundError:
        return False

