"""A Hugging Face directory as a start or an import: where it resolves, what it must hold (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import ConfigError
from trainyard_contract.hfconfig import hf_config
from trainyard_contract.hfdir import (
    HfDirError,
    index_shards,
    inline_config,
    inspect_dir,
    resolve_start,
    shape_differences,
)
from trainyard_contract.storage import ArtifactLayout

LLAMA = MODEL_CATALOG["llama-tiny@v1"]


def model_dir(path: Path, config: ModelConfig = LLAMA, *, shards: int = 0) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config(config)))
    if shards:
        names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        for n in names:
            (path / n).write_bytes(b"x" * 10)
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 10 * shards}, "weight_map": {f"w{i}": n for i, n in enumerate(names)}}))
    else:
        (path / "model.safetensors").write_bytes(b"x" * 7)
    return path


def test_a_directory_under_the_tenants_prefix_resolves_there(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)
    d = model_dir(layout.model_dir("acme", "tiny"))
    assert resolve_start(layout, "acme", "models/tiny") == d.resolve()


@pytest.mark.parametrize("relative", ["models/../../other/models/tiny", "models/escape", "models/abs"])
def test_what_resolves_outside_the_tenants_prefix_is_refused(tmp_path: Path, relative: str) -> None:
    layout = ArtifactLayout(tmp_path)
    theirs = model_dir(layout.model_dir("other", "tiny"))
    (layout.tenant_dir("acme") / "models").mkdir(parents=True)
    (layout.tenant_dir("acme") / "models/escape").symlink_to(theirs)  # a symlink into another tenant
    (layout.tenant_dir("acme") / "models/abs").symlink_to(tmp_path)
    with pytest.raises(HfDirError, match="outside your tenant's prefix"):
        resolve_start(layout, "acme", relative)


def test_a_single_file_directory_is_fingerprinted_without_reading_its_weights(tmp_path: Path) -> None:
    found = inspect_dir(model_dir(tmp_path / "m"))
    assert found.config == LLAMA
    assert found.weight_files == (("model.safetensors", 7),)
    assert found.index_sha256 is None and found.export_sha256 is None
    assert len(found.config_sha256) == 64


def test_a_sharded_directory_needs_every_shard_its_index_names(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m", shards=2)
    found = inspect_dir(d)
    assert [n for n, _ in found.weight_files] == ["model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors"]
    assert found.index_sha256 is not None
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HfDirError, match="names model-00002-of-00002.safetensors, which is not in the directory"):
        inspect_dir(d)


@pytest.mark.parametrize(("spoil", "match"), [
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: (d / "config.json").write_text("{"), "config.json is not JSON"),
    (lambda d: (d / "config.json").write_text("[1]"), "not a JSON object"),
    (lambda d: (d / "config.json").write_text(json.dumps(hf_config(LLAMA) | {"model_type": "mistral"})),
     "model_type = 'mistral'"),
    (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"), "safe_serialization=True"),
])
def test_a_directory_that_cannot_start_a_job_says_why(tmp_path: Path, spoil, match: str) -> None:
    d = model_dir(tmp_path / "m")
    spoil(d)
    with pytest.raises(ConfigError, match=match):
        inspect_dir(d)
    with pytest.raises(HfDirError, match="is not a directory"):
        inspect_dir(tmp_path / "nothing")


@pytest.mark.parametrize(("index", "match"), [
    ({}, "no weight_map"), ({"weight_map": {}}, "no weight_map"), ([], "no weight_map"),
    ({"weight_map": {"w": "../x.safetensors"}}, "outside the directory"),
])
def test_an_index_names_shards_in_the_directory_only(index: object, match: str) -> None:
    with pytest.raises(HfDirError, match=match):
        index_shards(index)


def test_shape_differences_name_each_field_with_both_values() -> None:
    other = LLAMA.model_copy(update={"n_layers": 4, "n_kv_heads": None})
    assert shape_differences(LLAMA, other) == ["nLayers: 2 in the spec, 4 in the directory",
                                               "nKvHeads: 2 in the spec, 4 in the directory"]
    assert shape_differences(LLAMA, LLAMA.model_copy(update={"dropout": 0.1})) == []  # not a shape
    # defaults are the same shape as their explicit values
    gpt = MODEL_CATALOG["gpt-tiny@v1"]
    assert shape_differences(gpt, gpt.model_copy(update={"d_ff": 4 * gpt.d_model})) == []
    assert shape_differences(gpt, LLAMA)[0] == "architecture: gpt2 in the spec, llama in the directory"


def test_the_inline_config_pastes_back_as_the_same_model() -> None:
    assert ModelConfig.model_validate(json.loads(inline_config(LLAMA))) == LLAMA
