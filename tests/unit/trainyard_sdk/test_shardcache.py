"""The node-local dataset shard cache: filled only with verified copies, prefetch, metrics; a dataset
read from an s3:// prefix (moto's server) through it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tests.objectstore import moto_s3
from trainyard.data import TokenDataset, prepare_dataset, stdlib_root
from trainyard.shardcache import ShardCache, ShardCacheMetrics, error_kind
from trainyard_common.errors import DataError
from trainyard_common.storage import ObjectPath, commit_bytes


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
    src = tmp_path / "src"
    src.mkdir()
    for name in ("textwrap.py", "bisect.py"):
        (src / name).write_bytes((stdlib_root() / name).read_bytes())
    manifest_path, _, manifest = prepare_dataset(
        tmp_path / "local", "mini", "v1", sources=["textwrap.py", "bisect.py"], source_root=src, vocab_size=300,
        shard_tokens=2000, clock=lambda: datetime(2026, 1, 1, tzinfo=UTC))
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
                {f"{s.sha256}.bin" for s in manifest.shards[:2]} | {f"{manifest.shards[dataset.locate(last)[0]].sha256}.bin"}
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

    src = tmp_path / "src"
    src.mkdir()
    (src / "bisect.py").write_bytes((stdlib_root() / "bisect.py").read_bytes())
    manifest_path, _, manifest = prepare_dataset(
        tmp_path / "local", "mini", "v1", sources=["bisect.py"], source_root=src, vocab_size=300,
        shard_tokens=500, clock=lambda: datetime(2026, 1, 1, tzinfo=UTC))
    with moto_s3() as root:
        remote = ObjectPath.parse(root) / "datasets" / "mini" / "v1"
        assert upload_dataset(manifest_path.parent, remote) == remote / "manifest.json"
        assert upload_dataset(manifest_path.parent, remote) == remote / "manifest.json"  # the same: nothing to do
        with ShardCache(tmp_path / "cache") as cache:
            dataset = TokenDataset(str(remote / "manifest.json"), sequence_length=16, cache=cache)
            np.testing.assert_array_equal(dataset.windows([0, len(dataset) - 1]),
                                          TokenDataset(manifest_path, 16).windows([0, len(dataset) - 1]))
        other = tmp_path / "other"
        prepare_dataset(other, "mini", "v1", sources=["bisect.py"], source_root=src, vocab_size=300,
                        shard_tokens=400, clock=lambda: datetime(2026, 1, 1, tzinfo=UTC))
        with pytest.raises(DataError, match="immutable"):
            upload_dataset(other / "datasets" / "mini" / "v1", remote)
    assert len(manifest.shards) >= 2
