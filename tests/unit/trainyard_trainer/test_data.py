import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from trainyard_contract.errors import DataError
from trainyard.data import (
    STDLIB_SOURCES,
    TokenDataset,
    load_dataset_manifest,
    prepare_dataset,
    samples_in_shard,
    split_into_shards,
    stdlib_root,
    train_tokenizer,
    verify_dataset,
)

FIXED = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A small corpus: two real stdlib modules copied into a source directory of our own."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("textwrap.py", "bisect.py"):
        (src / name).write_bytes((stdlib_root() / name).read_bytes())
    return src


def prepare(root: Path, corpus: Path, **kw: object):
    return prepare_dataset(root, "mini", "v1", sources=["textwrap.py", "bisect.py"], source_root=corpus,
                           vocab_size=300, shard_tokens=2000, clock=lambda: FIXED, **kw)


def test_prepare_writes_shards_tokenizer_and_manifest(tmp_path: Path, corpus: Path) -> None:
    path, sha, manifest = prepare(tmp_path / "root", corpus)
    assert path == tmp_path / "root" / "datasets" / "mini" / "v1" / "manifest.json"
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    wire = json.loads(path.read_bytes())
    assert {"name", "version", "tokenizer", "shards", "numTokens", "sources", "createdAt"} <= set(wire)
    assert set(wire["tokenizer"]) >= {"file", "sha256", "vocabSize", "version"}
    assert set(wire["shards"][0]) == {"file", "sha256", "sizeBytes", "numTokens"}
    assert manifest.tokenizer.version == f"bpe300-{manifest.tokenizer.sha256[:12]}"
    assert [s.file for s in manifest.shards] == [f"shard-{i:05d}.bin" for i in range(len(manifest.shards))]
    assert len(manifest.shards) > 1 and all(s.num_tokens == 2000 for s in manifest.shards[:-1])
    assert manifest.num_tokens == sum(s.num_tokens for s in manifest.shards)
    for s in manifest.shards:
        raw = (path.parent / s.file).read_bytes()
        assert len(raw) == s.size_bytes == 2 * s.num_tokens and hashlib.sha256(raw).hexdigest() == s.sha256
    assert [(s.path, s.sha256) for s in manifest.sources] == [
        (n, hashlib.sha256((corpus / n).read_bytes()).hexdigest()) for n in ("textwrap.py", "bisect.py")
    ]
    assert not list(path.parent.parent.glob(".v1.tmp-*"))  # the staging directory is gone


def test_tokens_round_trip_to_the_source_text(tmp_path: Path, corpus: Path) -> None:
    from tokenizers import Tokenizer

    path, _, manifest = prepare(tmp_path, corpus)
    ids = np.concatenate([np.fromfile(path.parent / s.file, dtype="<u2") for s in manifest.shards])
    assert ids.max() < 300
    tokenizer = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    eot = "<|endoftext|>"
    assert text == (corpus / "textwrap.py").read_text() + eot + (corpus / "bisect.py").read_text() + eot


def test_prepare_is_deterministic_and_idempotent(tmp_path: Path, corpus: Path) -> None:
    a_path, a_sha, a = prepare(tmp_path / "a", corpus)
    _, b_sha, b = prepare(tmp_path / "b", corpus)
    assert (a_sha, a) == (b_sha, b)  # same sources, same clock: same bytes
    mtime = a_path.stat().st_mtime_ns
    again = prepare(tmp_path / "a", corpus)
    assert again == (a_path, a_sha, a) and a_path.stat().st_mtime_ns == mtime


def test_existing_version_that_does_not_verify_is_an_error(tmp_path: Path, corpus: Path) -> None:
    path, _, manifest = prepare(tmp_path, corpus)
    shard = path.parent / manifest.shards[0].file
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))
    assert verify_dataset(path.parent, manifest) == [
        f"shard-00000.bin sha256 {hashlib.sha256(raw).hexdigest()[:12]}… does not match manifest "
        f"{manifest.shards[0].sha256[:12]}…"
    ]
    with pytest.raises(DataError, match="does not verify"):
        prepare(tmp_path, corpus)


def test_a_directory_without_manifest_is_rebuilt(tmp_path: Path, corpus: Path) -> None:
    leftover = tmp_path / "datasets" / "mini" / "v1"
    leftover.mkdir(parents=True)
    (leftover / "shard-00000.bin").write_bytes(b"half")
    path, _, manifest = prepare(tmp_path, corpus)
    assert verify_dataset(path.parent, manifest) == []


def test_missing_source_is_a_data_error(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(DataError, match="nope.py"):
        prepare_dataset(tmp_path, "x", "v1", sources=["nope.py"], source_root=corpus)


def test_tinycorpus_sources_exist_in_this_python() -> None:
    root = stdlib_root()
    assert all((root / rel).is_file() for rel in STDLIB_SOURCES)
    assert 2_000_000 < sum((root / rel).stat().st_size for rel in STDLIB_SOURCES) < 5_000_000


def test_tokenizer_training_is_deterministic() -> None:
    texts = ["def f(x):\n    return x + 1\n" * 50, "class A:\n    pass\n" * 40]
    assert train_tokenizer(texts, 280) == train_tokenizer(texts, 280)


def test_split_into_shards() -> None:
    ids = np.arange(10, dtype="<u2")
    assert [s.tolist() for s in split_into_shards(ids, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ----------------------------------------------------------------------------- reading


def test_windows_are_in_one_shard_with_stride_sequence_length(tmp_path: Path, corpus: Path) -> None:
    path, _, manifest = prepare(tmp_path, corpus)
    ds = TokenDataset(path, sequence_length=16)
    assert len(ds) == sum(samples_in_shard(s.num_tokens, 16) for s in manifest.shards)
    shard0 = np.fromfile(path.parent / manifest.shards[0].file, dtype="<u2")
    assert ds.window(1).tolist() == shard0[16:33].tolist()
    first_of_shard1 = samples_in_shard(manifest.shards[0].num_tokens, 16)
    assert ds.locate(first_of_shard1) == (1, 0)
    batch = ds.windows([0, 5, first_of_shard1])
    assert batch.shape == (3, 17) and batch.dtype == np.int64
    with pytest.raises(IndexError):
        ds.window(len(ds))


def test_shard_with_wrong_sha256_is_refused_when_opened(tmp_path: Path, corpus: Path) -> None:
    path, _, manifest = prepare(tmp_path, corpus)
    last = path.parent / manifest.shards[-1].file
    raw = bytearray(last.read_bytes())
    raw[-1] ^= 0xFF
    last.write_bytes(bytes(raw))
    ds = TokenDataset(path, sequence_length=16)
    ds.window(0)  # shard 0 is intact
    with pytest.raises(DataError, match="sha256"):
        ds.window(len(ds) - 1)


def test_missing_or_malformed_manifest(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_dataset_manifest(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(DataError, match="malformed"):
        load_dataset_manifest(tmp_path / "manifest.json")
