"""initFrom.huggingFace at submission: each refusal names the field and what to do; a usable directory
is fingerprinted for the job's record."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from trainyard_api.jobs import find_start, hugging_face_start
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_api.validation import check_hugging_face_start, resolve_model_config
from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import ConfigError
from trainyard_contract.hfconfig import hf_config
from trainyard_contract.hfdir import HfDir
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout

LLAMA = MODEL_CATALOG["llama-tiny@v1"]


def spec(model: Any = "llama-tiny@v1", directory: str = "models/tiny") -> TrainingSpec:
    data = copy.deepcopy(EXAMPLE_SPEC)
    data["modelConfig"] = model
    data["initFrom"] = {"huggingFace": directory}
    return TrainingSpec.model_validate(data)


def write_dir(path: Path, config: ModelConfig = LLAMA, **overrides: Any) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config(config) | overrides))
    (path / "model.safetensors").write_bytes(b"\0" * 8)
    return path


def check(s: TrainingSpec, layout: ArtifactLayout, tenant: str = "acme") -> tuple[list[Any], HfDir | ConfigError]:
    assert s.init_from is not None and s.init_from.hugging_face is not None
    found = find_start(layout, tenant, s.init_from.hugging_face)
    return check_hugging_face_start(s, resolve_model_config(s, MODEL_CATALOG), found), found


def test_a_directory_of_the_specs_shape_is_accepted_and_fingerprinted(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)
    write_dir(layout.model_dir("acme", "tiny"))
    problems, found = check(spec(), layout)
    assert problems == [] and isinstance(found, HfDir)
    record = hugging_face_start("models/tiny", found)
    assert record.directory == "models/tiny"
    assert record.uri == layout.model_dir("acme", "tiny").as_uri()
    assert record.weight_files == {"model.safetensors": 8}
    assert "indexSha256" not in record.dumps()  # left out when unset


@pytest.mark.parametrize(("setup", "directory", "match"), [
    (lambda lay: write_dir(lay.model_dir("other", "tiny")), "models/tiny", "is not a directory"),  # another tenant's
    (lambda lay: (lay.tenant_dir("acme") / "models").mkdir(parents=True)
     or (lay.tenant_dir("acme") / "models/tiny").symlink_to(write_dir(lay.model_dir("other", "tiny"))),
     "models/tiny", "outside your tenant's prefix"),
    (lambda lay: write_dir(lay.model_dir("acme", "tiny")).joinpath("config.json").unlink(), "models/tiny",
     "has no config.json"),
    (lambda lay: write_dir(lay.model_dir("acme", "tiny"), model_type="mistral"), "models/tiny",
     "model_type = 'mistral': trainyard builds 'gpt2' and 'llama'"),
    (lambda lay: write_dir(lay.model_dir("acme", "tiny")).joinpath("model.safetensors").unlink(), "models/tiny",
     "has no weights"),
])
def test_a_directory_that_cannot_start_the_job_is_refused_on_the_field(
        tmp_path: Path, setup: Any, directory: str, match: str) -> None:
    layout = ArtifactLayout(tmp_path)
    setup(layout)
    problems, _ = check(spec(directory=directory), layout)
    assert [p.field for p in problems] == ["initFrom.huggingFace"]
    assert f"cannot start from {directory!r}" in problems[0].message and match in problems[0].message


def test_another_shape_is_refused_naming_what_differs_and_the_model_config_to_use(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)
    bigger = LLAMA.model_copy(update={"n_layers": 3, "d_ff": 128})
    write_dir(layout.model_dir("acme", "tiny"), bigger)
    problems, _ = check(spec(), layout)
    assert [p.field for p in problems] == ["initFrom.huggingFace"]
    message = problems[0].message
    assert "nLayers: 2 in the spec, 3 in the directory; dFf: 176 in the spec, 128 in the directory" in message
    inline = json.loads(message.split("set modelConfig to ", 1)[1])
    assert ModelConfig.model_validate(inline) == bigger
    # with that inline config the same directory is accepted
    assert check(spec(model=inline), layout)[0] == []


def test_an_api_without_an_artifact_store_refuses_rather_than_guesses() -> None:
    s = spec()
    found = find_start(None, "acme", "models/tiny")
    assert isinstance(found, ConfigError)
    assert "initFrom.jobId" in check_hugging_face_start(s, LLAMA, found)[0].message


def test_an_unknown_model_is_reported_once_on_its_own_field(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)
    found = find_start(layout, "acme", "models/tiny")  # missing too, but the directory problem is independent
    assert isinstance(found, ConfigError)
    write_dir(layout.model_dir("acme", "tiny"))
    ok = find_start(layout, "acme", "models/tiny")
    assert check_hugging_face_start(spec(model="nope@v1"), None, ok) == []
