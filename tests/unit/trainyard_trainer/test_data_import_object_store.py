"""trainyard-data import under an ``s3://`` artifact root, against a real S3 HTTP endpoint (moto's server):
the shards and tokenizer go straight under the version's prefix, each hashed as it streams up, the
manifest last and create-only; the same inputs give the same manifest bytes as on a filesystem; a
failed import leaves no object, an interrupted one's are cleared; an existing version is verified."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.objectstore import moto_s3
from trainyard_contract.errors import DataError
from trainyard_contract.storage import (
    ArtifactLayout,
    ObjectPath,
    commit_bytes,
    list_children,
    read_bytes,
    sha256_of,
)
from trainyard_trainer import data_import
from trainyard.data import load_dataset_manifest, train_tokenizer
from trainyard_trainer.data_import import ImportOptions, import_dataset

DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(i % 13 + 1)) for i in range(60)]


@pytest.fixture(scope="module")
def s3_root() -> Iterator[str]:
    with moto_s3() as root:
        yield root


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(train_tokenizer(DOCS, 300))
    return corpus, tokenizer


def build(root: Any, inputs: tuple[Path, Path], version: str = "v1") -> data_import.ImportResult:
    corpus, tokenizer = inputs
    return import_dataset(root, "mine", version, [str(corpus)], tokenizer=str(tokenizer),
                          options=ImportOptions(shard_tokens=97), workers=1, tenant="t")


def test_an_import_uploads_shards_hashed_as_they_stream_and_the_manifest_last(
    s3_root: str, inputs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploads: list[tuple[str, bool]] = []
    real_upload = data_import.upload

    def recording(location: ObjectPath, **kw: Any) -> Any:
        uploads.append((location.name, kw.get("exclusive", False)))
        return real_upload(location, **kw)

    monkeypatch.setattr(data_import, "upload", recording)
    result = build(s3_root, inputs)
    directory = ArtifactLayout(s3_root).dataset_dir("mine", "v1", "t")
    assert result.created and result.manifest_path == directory / "manifest.json"
    shards = [s.file for s in result.manifest.shards]
    assert len(shards) > 2
    # tokenizer and shards first, straight under the final prefix; the manifest last, create-only
    assert uploads == [("tokenizer.json", False), *((s, False) for s in shards), ("manifest.json", True)]
    assert sorted(c.name for c in list_children(directory)) == sorted(["manifest.json", "tokenizer.json", *shards])
    assert result.sha256 == sha256_of(result.manifest_path)
    for shard in result.manifest.shards:  # the streamed digests are the objects'
        assert sha256_of(directory / shard.file) == shard.sha256

    # the same inputs on a filesystem: the same manifest, byte for byte
    local = build(tmp_path / "local", inputs)
    assert local.manifest_path.read_bytes() == read_bytes(result.manifest_path) and local.sha256 == result.sha256

    # imported again: verified against the objects and left alone
    uploads.clear()
    again = build(s3_root, inputs)
    assert (again.created, again.sha256, uploads) == (False, result.sha256, [])


def test_a_failed_import_leaves_nothing_and_an_interrupted_ones_objects_are_cleared(
    s3_root: str, inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = ArtifactLayout(s3_root).dataset_dir("mine", "v2", "t")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\nnot json\n")
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        build(s3_root, (bad, inputs[1]), "v2")
    assert list_children(directory) == []

    commit_bytes(directory / "shard-00042.bin", b"left by an import that died before its manifest")
    result = build(s3_root, inputs, "v2")
    assert "shard-00042.bin" not in {c.name for c in list_children(directory)}
    assert result.created and sha256_of(result.manifest_path) == result.sha256


def test_an_existing_version_with_a_corrupted_shard_is_an_error_not_overwritten(
    s3_root: str, inputs: tuple[Path, Path]
) -> None:
    result = build(s3_root, inputs, "v3")
    shard = ArtifactLayout(s3_root).dataset_dir("mine", "v3", "t") / result.manifest.shards[1].file
    data = bytearray(read_bytes(shard))
    data[0] ^= 0xFF
    commit_bytes(shard, bytes(data))
    with pytest.raises(DataError, match=r"exists but does not verify: shard-00001.bin sha256 .* does not match"):
        build(s3_root, inputs, "v3")
    assert read_bytes(shard) == bytes(data)  # a published version is never rewritten


def test_the_command_imports_to_an_object_store_and_verifies_there(
    s3_root: str, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from trainyard_contract import exitcodes
    from trainyard_trainer.data_cli import main

    corpus, tokenizer = inputs
    root = f"{s3_root}/cli"
    assert main(["import", "--name", "mine", "--version", "v1", "--artifact-root", root, "--workers", "1",
                 "--tokenizer", str(tokenizer), "--no-progress", str(corpus)]) == exitcodes.OK
    out = json.loads(capsys.readouterr().out)
    manifest = ObjectPath.parse(f"{root}/datasets/mine/v1/manifest.json")
    assert out["manifestUri"] == str(manifest) and out["sha256"] == sha256_of(manifest)
    assert main(["verify", "--name", "mine", "--version", "v1", "--artifact-root", root]) == exitcodes.OK
    assert json.loads(capsys.readouterr().out) == out

    name = load_dataset_manifest(manifest).shards[-1].file
    data = bytearray(read_bytes(manifest.parent / name))
    data[0] ^= 0xFF
    commit_bytes(manifest.parent / name, bytes(data))
    assert main(["verify", "--name", "mine", "--version", "v1", "--artifact-root", root]) == exitcodes.DATA
    assert f"{name} sha256" in capsys.readouterr().err
    assert main(["verify", "--name", "mine", "--version", "v9", "--artifact-root", root]) == exitcodes.DATA
    err = capsys.readouterr().err
    assert "no dataset version mine@v9" in err and "Traceback" not in err


def test_prepare_builds_the_example_and_uploads_it_manifest_last(
    s3_root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainyard_contract import exitcodes
    from trainyard_trainer.data_cli import main

    root = f"{s3_root}/prepared"
    args = ["--artifact-root", root, "--vocab-size", "300", "--shard-tokens", "200000"]
    assert main(["prepare", *args]) == exitcodes.OK
    out = json.loads(capsys.readouterr().out)
    manifest = ObjectPath.parse(f"{root}/datasets/tinycorpus/v1/manifest.json")
    assert out["manifestUri"] == str(manifest) and out["sha256"] == sha256_of(manifest) and out["shards"] >= 2
    assert main(["verify", "--artifact-root", root]) == exitcodes.OK
    assert json.loads(capsys.readouterr().out) == out
    assert main(["prepare", *args]) == exitcodes.OK  # the same version again: nothing to upload
    assert json.loads(capsys.readouterr().out) == out
