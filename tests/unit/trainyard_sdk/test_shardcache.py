"""The node-local dataset shard cache: filled only with verified copies, prefetch, metrics; a dataset
read from an s3:// prefix (moto's server) through it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tests.objectstore import moto_s3
from trainyard.data import DatasetManifest, TokenDataset, prepare_dataset, stdlib_root
from trainyard.shardcache import CachedShard, ShardCache, ShardCacheMetrics, error_kind, plan_evictions
from trainyard_contract.errors import DataError
from trainyard_contract.storage import ObjectPath, commit_bytes


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def cache(tmp_path: Path, registry: CollectorRegistry) -> Iterator[ShardCache]:
    with ShardCache(tmp_path / "cache", rank=3, metrics=ShardCacheMetrics.of(registry)) as c:
        yield c


def shard(tmp_path: Path, data: bytes, name: str = "shard-00000.bin") -> tuple[Path, str]:
    (tmp_path / "store").mkdir(exist_ok=True)
    path = tmp_path / "store" / name
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def mini_dataset(tmp_path: Path, sources: list[str], shard_tokens: int) -> tuple[Path, DatasetManifest]:
    """A small dataset version built locally from standard-library files: (manifest path, manifest)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for name in sources:
        (src / name).write_bytes((stdlib_root() / name).read_bytes())
    manifest_path, _, manifest = prepare_dataset(
        tmp_path / "local", "mini", "v1", sources=sources, source_root=src, vocab_size=300,
        shard_tokens=shard_tokens, clock=lambda: datetime(2026, 1, 1, tzinfo=UTC))
    return manifest_path, manifest


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_a_miss_fetches_and_verifies_then_the_next_lookup_is_a_hit(
    tmp_path: Path, cache: ShardCache, registry: CollectorRegistry
) -> None:
    source, sha = shard(tmp_path, b"tokens" * 1000)
    path = cache.get(source, sha, 6000)
    assert path == cache.path_of(sha) and path.read_bytes() == source.read_bytes()
    assert cache.get(source, sha, 6000) == path
    assert value(registry, "trainyard_shard_cache_requests_total", rank="3", result="miss") == 1
    assert value(registry, "trainyard_shard_cache_requests_total", rank="3", result="hit") == 1
    assert value(registry, "trainyard_shard_fetch_seconds_count", rank="3") == 1


def test_a_shard_that_does_not_match_the_manifest_is_never_cached(
    tmp_path: Path, cache: ShardCache, registry: CollectorRegistry
) -> None:
    source, sha = shard(tmp_path, b"good bytes")
    source.write_bytes(b"evil bytes")  # same size, other content
    with pytest.raises(DataError, match="not cached"):
        cache.get(source, sha, 10)
    assert list(cache.directory.iterdir()) == []  # no copy, no temporary file
    assert value(registry, "trainyard_object_store_errors_total", rank="3", kind="sha256") == 1
    source.write_bytes(b"good bytes")  # repaired at the source: fetched again, not remembered as bad
    assert cache.get(source, sha, 10).read_bytes() == b"good bytes"


def test_a_failed_fetch_is_a_retryable_error_counted_by_kind(
    tmp_path: Path, cache: ShardCache, registry: CollectorRegistry
) -> None:
    with pytest.raises(DataError) as caught:
        cache.get(tmp_path / "missing.bin", "0" * 64, 1)
    assert caught.value.retryable
    assert value(registry, "trainyard_object_store_errors_total", rank="3", kind="error") == 1


@pytest.mark.parametrize(("message", "kind"), [
    ("An error occurred (SlowDown) when calling the PutObject operation", "throttled"),
    ("503 Service Unavailable", "throttled"), ("Throttling: Rate exceeded", "throttled"),
    ("Connection reset by peer", "error"), ("Access Denied", "error"),
])
def test_error_kinds(message: str, kind: str) -> None:
    assert error_kind(OSError(message)) == kind


def test_prefetch_fills_the_cache_in_the_background_and_get_waits_for_it(
    tmp_path: Path, cache: ShardCache, registry: CollectorRegistry
) -> None:
    source, sha = shard(tmp_path, b"x" * 5000)
    cache.prefetch(source, sha, 5000)
    cache.prefetch(source, sha, 5000)  # in flight or cached: not fetched twice
    assert cache.get(source, sha, 5000).read_bytes() == b"x" * 5000
    assert value(registry, "trainyard_shard_fetch_seconds_count", rank="3") == 1
    cache.prefetch(source, sha, 5000)  # cached: nothing to do
    assert value(registry, "trainyard_shard_fetch_seconds_count", rank="3") == 1


def test_a_dataset_in_s3_is_read_through_the_cache_with_the_next_shard_prefetched(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    manifest_path, manifest = mini_dataset(tmp_path, ["textwrap.py", "bisect.py"], shard_tokens=2000)
    assert len(manifest.shards) >= 3
    local = TokenDataset(manifest_path, sequence_length=16)
    with moto_s3() as root:
        remote = ObjectPath.parse(root) / "datasets" / "mini" / "v1"
        for file in manifest_path.parent.iterdir():
            commit_bytes(remote / file.name, file.read_bytes())
        with pytest.raises(DataError, match="ShardCache"):
            TokenDataset(str(remote / "manifest.json"), sequence_length=16)
        with ShardCache(tmp_path / "cache", rank=0, metrics=ShardCacheMetrics.of(registry)) as cache:
            dataset = TokenDataset(str(remote / "manifest.json"), sequence_length=16, cache=cache)
            assert len(dataset) == len(local)
            np.testing.assert_array_equal(dataset.windows([0, 1, 2]), local.windows([0, 1, 2]))
            cache.get(remote / manifest.shards[1].file, manifest.shards[1].sha256, manifest.shards[1].size_bytes)
            requests = {r: value(registry, "trainyard_shard_cache_requests_total", rank="0", result=r)
                        for r in ("hit", "miss", "prefetching")}
            assert requests["miss"] == 1 and requests["hit"] + requests["prefetching"] == 1  # shard 1 was prefetched
            last = len(dataset) - 1
            dataset.prefetch([last])
            np.testing.assert_array_equal(dataset.window(last), local.window(last))
            assert sorted(p.name for p in cache.directory.iterdir()) == sorted(
                {f"{s.sha256}.bin" for s in manifest.shards[:2]}
                | {f"{manifest.shards[dataset.locate(last)[0]].sha256}.bin"}
                | ({f"{manifest.shards[dataset.locate(last)[0] + 1].sha256}.bin"}
                   if dataset.locate(last)[0] + 1 < len(manifest.shards) else set()))


def test_the_loader_prefetches_the_shards_of_the_samples_of_its_next_step() -> None:
    import torch

    from trainyard.loader import DataLoader
    from trainyard.sampler import GlobalSampler

    class Recording:
        cache = object()  # read through a cache: the loader prefetches

        def __init__(self) -> None:
            self.prefetched: list[list[int]] = []
            self.read: list[int] = []

        def windows(self, ids: list[int]) -> np.ndarray:
            self.read += ids
            return np.zeros((len(ids), 9), dtype=np.int64)

        def prefetch(self, samples: list[int]) -> None:
            self.prefetched.append(list(samples))

    dataset = Recording()
    loader = DataLoader(dataset, GlobalSampler(100, seed=1, global_batch=8, micro_batch=2, dp=2, dp_rank=1),
                        torch.device("cpu"))
    next(loader)
    assert len(dataset.prefetched) == 1 and len(dataset.prefetched[0]) == 4
    dataset.read.clear()
    next(loader)
    assert dataset.read == dataset.prefetched[0]  # what it prefetched is what the next step read


def test_a_dataset_version_is_uploaded_manifest_last_once_and_never_replaced(tmp_path: Path) -> None:
    from trainyard.data import upload_dataset

    manifest_path, manifest = mini_dataset(tmp_path, ["bisect.py"], shard_tokens=500)
    with moto_s3() as root:
        remote = ObjectPath.parse(root) / "datasets" / "mini" / "v1"
        assert upload_dataset(manifest_path.parent, remote) == remote / "manifest.json"
        assert upload_dataset(manifest_path.parent, remote) == remote / "manifest.json"  # the same: nothing to do
        with ShardCache(tmp_path / "cache") as cache:
            dataset = TokenDataset(str(remote / "manifest.json"), sequence_length=16, cache=cache)
            np.testing.assert_array_equal(dataset.windows([0, len(dataset) - 1]),
                                          TokenDataset(manifest_path, 16).windows([0, len(dataset) - 1]))
        other = tmp_path / "other"
        prepare_dataset(other, "mini", "v1", sources=["bisect.py"], source_root=tmp_path / "src", vocab_size=300,
                        shard_tokens=400, clock=lambda: datetime(2026, 1, 1, tzinfo=UTC))
        with pytest.raises(DataError, match="immutable"):
            upload_dataset(other / "datasets" / "mini" / "v1", remote)
    assert len(manifest.shards) >= 2


# ----------------------------------------------------------------------------- bounds


def cached(*entries: tuple[str, int, float]) -> list[CachedShard]:
    return [CachedShard(sha, size, used) for sha, size, used in entries]


@pytest.mark.parametrize(("budget", "free", "floor", "keep", "expected"), [
    (None, 10_000, 0, set(), []),                       # no budget, plenty of disk: nothing
    (3000, 10_000, 0, set(), []),                       # 2000 + 1000 fits 3000 exactly
    (2500, 10_000, 0, set(), ["a"]),                    # 500 over: the least recently used goes
    (1500, 10_000, 0, set(), ["a", "b"]),               # 1500 over: both
    (2500, 10_000, 0, {"a"}, ["b"]),                    # a is in use: the next one instead
    (1500, 10_000, 0, {"a", "b"}, []),                  # only shards in use: over budget rather than fail
    (None, 1_500, 1_000, set(), ["a"]),                 # 1500 free - 1000 incoming < the 1000 floor: 500 short
    (None, 1_500, 2_000, set(), ["a", "b"]),            # 1500 short: both
    (2500, 1_500, 2_000, set(), ["a", "b"]),            # the larger of the two needs rules
])
def test_plan_evictions(budget: int | None, free: int, floor: int, keep: set[str], expected: list[str]) -> None:
    shards = cached(("b", 1000, 20.0), ("a", 1000, 10.0))
    assert plan_evictions(shards, incoming=1000, max_bytes=budget, free_bytes=free, min_free_bytes=floor,
                          keep=keep) == expected


def test_equal_times_evict_in_a_stable_order() -> None:
    shards = cached(("b", 10, 5.0), ("a", 10, 5.0), ("c", 10, 5.0))
    assert plan_evictions(shards, incoming=10, max_bytes=20, free_bytes=10**9, min_free_bytes=0,
                          keep=()) == ["a", "b"]


def used_at(cache: ShardCache, sha: str, when: float) -> None:
    os.utime(cache.path_of(sha), (when, when))


def test_a_fill_over_the_budget_deletes_the_least_recently_used_shard(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    (a, sha_a), (b, sha_b), (c, sha_c) = (shard(tmp_path, bytes([n]) * 1000, f"s{n}.bin") for n in range(3))
    with ShardCache(tmp_path / "cache", rank=1, max_bytes=2500, min_free_bytes=0, keep_recent=1,
                    metrics=ShardCacheMetrics.of(registry)) as cache:
        cache.get(a, sha_a, 1000)
        cache.get(b, sha_b, 1000)
        used_at(cache, sha_a, 1_000.0)
        used_at(cache, sha_b, 2_000.0)
        cache.get(a, sha_a, 1000)  # a hit marks a used now: b is now the least recently used
        cache.get(c, sha_c, 1000)
        assert sorted(p.name for p in cache.directory.iterdir()) == sorted(f"{s}.bin" for s in (sha_a, sha_c))
        assert value(registry, "trainyard_shard_cache_evictions_total", rank="1") == 1
        assert value(registry, "trainyard_shard_cache_bytes", rank="1") == 2000
        assert cache.get(b, sha_b, 1000).read_bytes() == b"\x01" * 1000  # fetched again when read again


def test_shards_in_use_are_kept_over_the_budget_and_the_fetch_goes_ahead(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    sources = [shard(tmp_path, bytes([n]) * 1000, f"s{n}.bin") for n in range(3)]
    with ShardCache(tmp_path / "cache", max_bytes=1500, min_free_bytes=0, keep_recent=3,
                    metrics=ShardCacheMetrics.of(registry)) as cache:
        for source, sha in sources:
            assert cache.get(source, sha, 1000).read_bytes() == source.read_bytes()
        assert len(list(cache.directory.glob("*.bin"))) == 3
        assert value(registry, "trainyard_shard_cache_evictions_total", rank="0") == 0


def test_the_free_disk_floor_evicts_what_is_not_in_use(tmp_path: Path, registry: CollectorRegistry) -> None:
    sources = [shard(tmp_path, bytes([n]) * 100, f"s{n}.bin") for n in range(4)]
    with ShardCache(tmp_path / "cache", min_free_bytes=10**18, keep_recent=2,  # a floor no disk meets
                    metrics=ShardCacheMetrics.of(registry)) as cache:
        for source, sha in sources:
            cache.get(source, sha, 100)
        # each fill deleted every shard but the two last used (the one being fetched is one of them)
        assert sorted(p.name for p in cache.directory.iterdir()) == sorted(f"{sha}.bin" for _, sha in sources[2:])
        assert value(registry, "trainyard_shard_cache_evictions_total", rank="0") == 2


def test_temporary_files_of_dead_fetches_are_deleted_and_live_ones_kept(tmp_path: Path, cache: ShardCache) -> None:
    dead = cache.directory / f".{'a' * 64}.bin.999999999-0f0f0f0f"  # above any pid_max: no such process
    live = cache.directory / f".{'b' * 64}.bin.{os.getpid()}-0f0f0f0f"
    odd = cache.directory / ".not-a-fetch"
    for path in (dead, live, odd):
        path.write_bytes(b"partial")
    assert cache.make_room(0) == []
    assert not dead.exists() and live.exists() and odd.exists()


def test_a_shard_deleted_between_lookup_and_mapping_is_fetched_again_and_few_stay_mapped(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    manifest_path, manifest = mini_dataset(tmp_path, ["textwrap.py"], shard_tokens=2000)
    assert len(manifest.shards) >= 3
    local = TokenDataset(manifest_path, sequence_length=16)

    class EvictedUnderfoot(ShardCache):
        """Another rank's eviction deletes each shard once, right after the lookup found it."""

        deleted: set[str] = set()

        def get(self, source: Any, sha256: str, size_bytes: int) -> Path:
            path = super().get(source, sha256, size_bytes)
            if sha256 not in self.deleted:
                self.deleted.add(sha256)
                path.unlink()
            return path

    with EvictedUnderfoot(tmp_path / "cache", metrics=ShardCacheMetrics.of(registry)) as cache:
        dataset = TokenDataset(manifest_path, sequence_length=16, cache=cache)
        dataset.OPEN_CACHED = 2
        samples = [dataset._starts[i] for i in range(len(manifest.shards))]  # the first window of each shard
        np.testing.assert_array_equal(dataset.windows(samples), local.windows(samples))
        assert len(dataset._open) == 2
        assert cache.deleted == {s.sha256 for s in manifest.shards}


def test_each_registry_gets_metrics_registered_in_it_even_when_an_earlier_one_is_gone() -> None:
    """The metrics are remembered per registry object, not per id(): a new registry that lands at a freed one's
    address (id() reuse made a test here count into a dead registry once) gets its own; two live ones too."""
    import gc

    first, second = CollectorRegistry(), CollectorRegistry()
    ShardCacheMetrics.of(first).evictions.labels("1").inc(2)
    ShardCacheMetrics.of(second).evictions.labels("1").inc()
    assert (value(first, "trainyard_shard_cache_evictions_total", rank="1"),
            value(second, "trainyard_shard_cache_evictions_total", rank="1")) == (2, 1)
    for _ in range(20):
        gone = CollectorRegistry()
        ShardCacheMetrics.of(gone).requests.labels("0", "hit").inc()
        del gone
        gc.collect()
        fresh = CollectorRegistry()
        ShardCacheMetrics.of(fresh).requests.labels("0", "hit").inc()
        assert value(fresh, "trainyard_shard_cache_requests_total", rank="0", result="hit") == 1
