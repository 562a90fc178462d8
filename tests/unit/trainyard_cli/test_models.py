"""``trainyard models import|list``: a directory transformers wrote is checked, copied whole into the tenant's
models/ (never over a different model), and the command prints the initFrom to use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from trainyard_cli.main import app
from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.storage import ArtifactLayout, sha256_file
from typer.testing import CliRunner

from tests.support.hfmodels import save_transformers_model

LLAMA = MODEL_CATALOG["llama-tiny@v1"]


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_API_URL", raising=False)
    return CliRunner()


def run(runner: CliRunner, root: Path, *args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["models", *args, "--tenant", "acme", "--artifact-root", str(root)])
    return result.exit_code, result.stdout, result.stderr


def test_import_copies_the_directory_whole_and_prints_the_start(runner: CliRunner, tmp_path: Path) -> None:
    source = tmp_path / "hf"
    save_transformers_model(source, LLAMA, seed=0, max_shard_size="100KB")
    (source / "pytorch_model.bin").write_bytes(b"not read")  # other weight formats are not copied
    (source / "tokenizer.json").symlink_to(source / "config.json")  # a cache's symlink: its content is copied
    root = tmp_path / "artifacts"
    code, out, _ = run(runner, root, "import", str(source), "--name", "tiny", "--json")
    assert code == 0, out
    summary = json.loads(out)
    target = ArtifactLayout(root).model_dir("acme", "tiny")
    assert summary["directory"] == str(target) and summary["created"] is True
    assert summary["initFrom"] == {"huggingFace": "models/tiny"}
    assert ModelConfig.model_validate(summary["modelConfig"]) == LLAMA
    copied = sorted(p.name for p in target.iterdir())
    expected = sorted(p.name for p in source.iterdir() if p.name != "pytorch_model.bin")
    assert copied == expected and "model.safetensors.index.json" in copied
    assert all(sha256_file(target / n) == sha256_file(source / n) == summary["files"][n] for n in copied)
    assert not (target / "tokenizer.json").is_symlink()
    assert [p.name for p in target.parent.iterdir()] == ["tiny"]  # no temporary left behind

    # again: the same files are already imported; another model under that name is refused
    code, out, err = run(runner, root, "import", str(source), "--name", "tiny")
    assert code == 0 and "already imported" in err and "initFrom: {huggingFace: models/tiny}" in out
    other = tmp_path / "other"
    save_transformers_model(other, LLAMA, seed=1)
    code, _, err = run(runner, root, "import", str(other), "--name", "tiny")
    assert code == 2 and "a different model is already imported as 'tiny'" in err and "--name" in err
    assert sha256_file(target / "config.json") == sha256_file(source / "config.json")

    code, out, _ = run(runner, root, "list")
    assert code == 0 and out.startswith("models/tiny\tllama 2x64 vocab 1024")


@pytest.mark.parametrize(("spoil", "match"), [
    (lambda d: (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text())
                                                         | {"model_type": "mistral"})), "model_type = 'mistral'"),
    (lambda d: (d / "model.safetensors").unlink(), "has no weights"),
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
])
def test_an_incompatible_directory_is_refused_and_nothing_is_written(runner: CliRunner, tmp_path: Path,
                                                                     spoil, match: str) -> None:
    source = tmp_path / "hf"
    save_transformers_model(source, LLAMA, seed=0)
    spoil(source)
    root = tmp_path / "artifacts"
    code, _, err = run(runner, root, "import", str(source), "--name", "tiny")
    assert code == 2 and match in err
    assert not ArtifactLayout(root).model_dir("acme", "tiny").exists()


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", ""])
def test_a_name_must_be_one_path_component(runner: CliRunner, tmp_path: Path, name: str) -> None:
    source = tmp_path / "hf"
    save_transformers_model(source, LLAMA, seed=0)
    code, _, err = run(runner, tmp_path / "artifacts", "import", str(source), "--name", name)
    assert code == 2 and "a model name is letters" in err
    assert not (tmp_path / "artifacts").exists() or not any(os.scandir(tmp_path / "artifacts"))
