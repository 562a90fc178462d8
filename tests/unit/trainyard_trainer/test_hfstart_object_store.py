"""initFrom.huggingFace under an object-store artifact root (moto's S3 server): `trainyard models import`
uploads a transformers directory (config.json last, then its listing), the API's check reads the prefix,
and a rank fetches the files once per node — verified against the listing — and loads logits equal to the
transformers model's; a tampered weight object is refused; `models list` reads the prefix too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from trainyard.runrecord import RestoreRecord
from trainyard_api.jobs import find_start, hugging_face_start
from trainyard_cli.models import import_model, list_models
from trainyard_contract.errors import CheckpointError, ConfigError
from trainyard_contract.hfdir import CONFIG_FILE, MODEL_LISTING, HfDirError, inspect_dir, resolve_start
from trainyard_contract.storage import ArtifactLayout, ObjectPath, commit_bytes, list_children, read_bytes, sha256_file
from trainyard_trainer.hfstart import fetch_hf_dir, maybe_init_from_hugging_face
from trainyard_trainer.model import build_model

from tests.objectstore import moto_s3
from tests.support.hfmodels import hf_logits, save_transformers_model
from tests.unit.trainyard_trainer.test_hfstart import GQA, GPT, spec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def s3_root() -> Iterator[str]:
    with moto_s3() as root:
        yield root


def test_an_import_uploads_the_model_config_last_and_a_listing_then_is_idempotent(
    tmp_path: Path, s3_root: str
) -> None:
    source = tmp_path / "hf"
    save_transformers_model(source, GQA, seed=1, max_shard_size="20KB")
    layout = ArtifactLayout(f"{s3_root}/import")
    done = import_model(source, layout, "acme", "m")
    target = layout.model_dir("acme", "m")
    assert done.created and isinstance(target, ObjectPath) and done.directory == target
    listing = json.loads(read_bytes(target / MODEL_LISTING))
    assert {f["name"]: f["sha256"] for f in listing["files"]} == done.files
    assert {f["name"] for f in listing["files"]} == {p.name for p in source.iterdir()}
    assert [f["name"] for f in listing["files"]][-1] == CONFIG_FILE  # uploaded last of the model's files
    assert all(done.files[p.name] == sha256_file(p) for p in source.iterdir())
    found, local = inspect_dir(target), inspect_dir(source)
    assert (found.config, found.config_sha256, found.weight_files, found.index_sha256) == \
        (local.config, local.config_sha256, local.weight_files, local.index_sha256)
    again = import_model(source, layout, "acme", "m")
    assert not again.created and again.files == done.files
    other = tmp_path / "other"
    save_transformers_model(other, GQA, seed=2, max_shard_size="20KB")
    with pytest.raises(ConfigError, match="a different model is already imported as 'm'"):
        import_model(other, layout, "acme", "m")
    assert [(name, getattr(f, "config", None)) for name, f in list_models(layout, "acme")] == [("m", GQA)]


def test_the_api_check_reads_the_prefix_and_refuses_what_is_not_a_model(tmp_path: Path, s3_root: str) -> None:
    layout = ArtifactLayout(f"{s3_root}/check")
    save_transformers_model(tmp_path / "hf", GPT, seed=3)
    import_model(tmp_path / "hf", layout, "acme", "gpt")
    found = find_start(layout, "acme", "models/gpt")
    assert not isinstance(found, ConfigError) and found.config == GPT
    recorded = hugging_face_start("models/gpt", found)
    assert recorded.uri == f"{s3_root}/check/tenants/acme/models/gpt"
    missing = find_start(layout, "acme", "models/nothing-here")
    assert isinstance(missing, HfDirError) and "is not a directory" in missing.message
    commit_bytes(layout.model_dir("acme", "half") / "model.safetensors", b"weights without a config")
    half = find_start(layout, "acme", "models/half")
    assert isinstance(half, HfDirError) and "has no config.json" in half.message
    with pytest.raises(HfDirError):
        resolve_start(layout, "acme", "models/../../other-tenant/models/m")


def test_a_rank_fetches_once_per_node_verifies_and_loads_equal_logits(tmp_path: Path, s3_root: str) -> None:
    layout = ArtifactLayout(f"{s3_root}/fetch")
    reference = save_transformers_model(tmp_path / "hf", GQA, seed=4, max_shard_size="20KB")
    import_model(tmp_path / "hf", layout, "acme", "m")
    cache = tmp_path / "node" / "hf-cache"
    model = build_model(GQA, seed=0, device=CPU).eval()
    restored = RestoreRecord(manifest_uri=None, reason="no checkpoint to start from", rng="fresh")
    assert maybe_init_from_hugging_face(spec(GQA), GQA, model, restored, layout, "acme", cache_dir=cache)
    idx = torch.randint(0, GQA.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf_logits(reference, idx), atol=1e-5, rtol=0)
    assert restored.hugging_face_uri == f"{s3_root}/fetch/tenants/acme/models/m"
    (copy,) = [p for p in cache.iterdir() if p.is_dir()]
    assert (copy / ".complete").exists()
    assert {p.name for p in copy.iterdir()} >= {CONFIG_FILE, "model.safetensors.index.json"}
    stamp = (copy / CONFIG_FILE).stat().st_mtime_ns
    assert fetch_hf_dir(layout.model_dir("acme", "m"), cache) == copy  # the node's copy: not fetched again
    assert (copy / CONFIG_FILE).stat().st_mtime_ns == stamp

    # a weight object replaced behind the listing's back (same size): refused, and no copy marked complete
    target = layout.model_dir("acme", "m")
    shard = next(c.name for c in list_children(target) if c.name.startswith("model-"))
    data = bytearray(read_bytes(target / shard))
    data[-1] ^= 0xFF
    commit_bytes(target / shard, bytes(data))
    other_cache = tmp_path / "other-node"
    with pytest.raises(CheckpointError, match="not what the directory lists"):
        fetch_hf_dir(target, other_cache)
    assert not list(other_cache.glob("*/.complete"))


def test_without_a_node_directory_an_object_store_start_says_what_is_missing(tmp_path: Path, s3_root: str) -> None:
    layout = ArtifactLayout(f"{s3_root}/nocache")
    save_transformers_model(tmp_path / "hf", GPT, seed=5)
    import_model(tmp_path / "hf", layout, "acme", "m")
    model = build_model(GPT, seed=0, device=CPU)
    restored = RestoreRecord(manifest_uri=None, reason="no checkpoint to start from", rng="fresh")
    with pytest.raises(ConfigError, match="TRAINYARD_NODE_STATE_DIR"):
        maybe_init_from_hugging_face(spec(GPT), GPT, model, restored, layout, "acme")


def test_the_command_imports_into_an_object_store_and_lists_it(tmp_path: Path, s3_root: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from trainyard_cli.main import app

    monkeypatch.chdir(tmp_path)
    save_transformers_model(tmp_path / "hf", GPT, seed=6)
    root = f"{s3_root}/cli"
    result = CliRunner().invoke(app, ["models", "import", str(tmp_path / "hf"), "--name", "gpt", "--tenant", "acme",
                                      "--artifact-root", root, "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["created"] and out["directory"] == f"{root}/tenants/acme/models/gpt"
    assert out["initFrom"] == {"huggingFace": "models/gpt"}
    listed = CliRunner().invoke(app, ["models", "list", "--tenant", "acme", "--artifact-root", root])
    assert listed.exit_code == 0 and listed.stdout.startswith("models/gpt\tgpt2 2x32"), listed.stdout
