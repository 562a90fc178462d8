"""initFrom.huggingFace in the trainer: a directory transformers wrote loads into our model (logits equal
within 1e-5, both architectures, sharded too); another shape fails ``config:`` naming the difference; a
start with a checkpoint of the job's own does not look at the directory."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from trainyard.runrecord import RestoreRecord
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import ConfigError
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_trainer.hf import read_hf_model
from trainyard_trainer.hfstart import load_full_state, maybe_init_from_hugging_face
from trainyard_trainer.model import build_model

from tests.support.hfmodels import hf_logits, save_transformers_model

CPU = torch.device("cpu")
GQA = ModelConfig(architecture="llama", vocab_size=97, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
                  max_seq_len=16)
GPT = ModelConfig(vocab_size=97, n_layers=2, n_heads=4, d_model=32, max_seq_len=16)


def spec(config: ModelConfig, directory: str = "models/m") -> TrainingSpec:
    data = copy.deepcopy(EXAMPLE_SPEC)
    data["modelConfig"] = config.model_dump(mode="json", by_alias=True)
    data["initFrom"] = {"huggingFace": directory}
    data["training"]["sequenceLength"] = 16
    return TrainingSpec.model_validate(data)


def fresh() -> RestoreRecord:
    return RestoreRecord(manifest_uri=None, reason="no checkpoint to start from", rng="fresh")


@pytest.mark.parametrize("config", [GQA, GPT, MODEL_CATALOG["llama-tiny@v1"]], ids=["llama-gqa", "gpt2", "llama-tiny"])
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_a_transformers_directory_loads_with_equal_logits(tmp_path: Path, config: ModelConfig,
                                                         shard: str | None) -> None:
    layout = ArtifactLayout(tmp_path)
    directory = layout.model_dir("acme", "m")
    reference = save_transformers_model(directory, config, seed=5, **({"max_shard_size": shard} if shard else {}))
    assert (directory / "model.safetensors.index.json").exists() == (shard is not None)
    model = build_model(config, seed=0, device=CPU).eval()
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    before = model(idx)[0].detach()
    restored = fresh()
    assert maybe_init_from_hugging_face(spec(config), config, model, restored, layout, "acme")
    with torch.no_grad():
        ours = model(idx)[0]
    theirs = hf_logits(reference, idx)
    assert (before - theirs).abs().max() > 1e-2  # the check below can fail: a random model is far off
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert restored.hugging_face_uri == directory.as_uri()
    assert "initialised from the Hugging Face directory models/m" in restored.reason


def test_another_shape_fails_as_config_naming_the_difference(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)
    save_transformers_model(layout.model_dir("acme", "m"), GQA.model_copy(update={"n_layers": 3}), seed=0)
    model = build_model(GQA, seed=0, device=CPU)
    with pytest.raises(ConfigError, match=r"^config: initFrom.huggingFace 'models/m' .*nLayers: 2 in the spec, 3"):
        maybe_init_from_hugging_face(spec(GQA), GQA, model, fresh(), layout, "acme")


def test_a_resumed_attempt_keeps_its_own_checkpoint_and_never_reads_the_directory(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)  # no directory at all: reading it would fail
    model = build_model(GQA, seed=0, device=CPU)
    own = RestoreRecord(manifest_uri="file:///ckpt/manifest.json", global_step=7, reason="resumed")
    assert not maybe_init_from_hugging_face(spec(GQA), GQA, model, own, layout, "acme")
    assert own.hugging_face_uri is None


def test_a_state_without_an_entry_of_the_model_is_refused_by_name(tmp_path: Path) -> None:
    save_transformers_model(tmp_path / "m", GQA, seed=0)
    _, state = read_hf_model(tmp_path / "m")
    del state["norm.weight"]
    from trainyard_contract.errors import CheckpointError
    with pytest.raises(CheckpointError, match="no weights for norm.weight"):
        load_full_state(build_model(GQA, seed=0, device=CPU), state)


@pytest.mark.parametrize("config", [GQA, GPT], ids=["llama-gqa", "gpt2"])
def test_an_export_starts_a_job_with_exactly_the_exported_weights(tmp_path: Path, config: ModelConfig) -> None:
    """Continue training an export: its directory (sharded here) loads back bit for bit, and the job's record
    of it names the export's listing, whose sha256 is the export artifact's hash."""
    from trainyard_contract.hfdir import inspect_dir
    from trainyard_trainer.hf import write_hf_model

    layout = ArtifactLayout(tmp_path)
    trained = build_model(config, seed=4, device=CPU)
    relative = "jobs/job-a/exports/step-000000040-a1/hf"
    listing = write_hf_model(layout.tenant_dir("acme") / relative, config, trained.state_dict(),
                             tokenizer_json=None, eos_token=None, max_shard_bytes=20_000)
    found = inspect_dir(listing.directory)
    assert found.export_sha256 == listing.sha256 and found.index_sha256 is not None
    model = build_model(config, seed=0, device=CPU)
    assert maybe_init_from_hugging_face(spec(config, relative), config, model, fresh(), layout, "acme")
    for name, tensor in trained.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
