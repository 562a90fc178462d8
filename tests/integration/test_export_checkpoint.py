"""Checkpoints written by real 2-rank gloo trainers under FSDP2 and DDP (llama), tensor and
pipeline parallelism (GPT-2), exported with ``trainyard-export`` and loaded with transformers.

Each checkpoint's DCP metadata shows the model spread over both ranks' files (FSDP and TP shards,
PP stages) — so the export had to gather it — and the exported model's logits equal, within 1e-5, those of the
single-process model loaded from the same checkpoint (by torch's own dcp_to_torch_save, not by
the code under test). The tokenizer the export ships is the dataset's and loads with AutoTokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from trainyard_contract.catalog import ModelConfig
from trainyard_contract.events import ShardWritten
from trainyard_contract.exitcodes import CHECKPOINT
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout, path_to_uri
from trainyard.data import (
    STDLIB_SOURCES,
    load_dataset_manifest,
    prepare_dataset,
)
from trainyard_trainer.hf import LISTING_FILE
from trainyard_trainer.model import build_model

from tests.integration.test_trainer_ranks import (
    copy_checkpoint,
    flip_a_byte,
    load_whole,
    run_attempt,
    shards_of,
    small_spec,
    write_manifest,
)

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers  # noqa: E402 - after the offline switch above

STEPS = 2
LLAMA = {"architecture": "llama", "vocabSize": 1024, "nLayers": 2, "nHeads": 4, "nKvHeads": 2, "dModel": 64,
         "dFf": 176, "maxSeqLen": 64}
GPT2 = {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 64, "maxSeqLen": 64}


def spec_of(model: dict[str, object], **parallelism: int) -> TrainingSpec:
    wire = small_spec().wire()
    wire["modelConfig"] = {**model, "dropout": 0.0}
    wire["parallelism"] = {"data": 1, **parallelism}
    wire["training"]["maxSteps"] = STEPS
    wire["checkpointPolicy"] = {"everySteps": STEPS}
    return TrainingSpec.model_validate(wire)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export") / "artifacts"
    prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:6])
    return root


@pytest.fixture(scope="module")
def dataset_dir(root: Path) -> Path:
    return ArtifactLayout(root).dataset_dir("tinycorpus", "v1")


def export(manifest: Path, out: Path, config: ModelConfig, dataset_dir: Path) -> subprocess.CompletedProcess[str]:
    separator = load_dataset_manifest(dataset_dir / "manifest.json").separator
    return subprocess.run(
        [sys.executable, "-m", "trainyard_trainer.export_cli", "--checkpoint", str(manifest), "--out", str(out),
         "--model-config", config.model_dump_json(by_alias=True), "--tokenizer", str(dataset_dir / "tokenizer.json"),
         "--eos-token", separator, "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False,
    )


# split: how the model is spread over the two ranks' files (None: replicated, DCP picks who writes)
CASES = [
    pytest.param(LLAMA, {"data": 2}, {"TRAINYARD_SHARDING": "fsdp"}, "sharded", id="llama-fsdp2"),
    pytest.param(LLAMA, {"data": 2}, {}, None, id="llama-ddp"),
    pytest.param(LLAMA, {"tensor": 2}, {}, "sharded", id="llama-tensor-parallel"),
    pytest.param(GPT2, {"tensor": 2}, {}, "sharded", id="gpt2-tensor-parallel"),
    pytest.param(GPT2, {"pipeline": 2}, {}, "stages", id="gpt2-pipeline"),
]


def first_weight(config: ModelConfig) -> str:
    return "model.blocks.0." + ("self_attn.q_proj.weight" if config.architecture == "llama" else "attn.qkv.weight")


class Trained:
    """Each case's 2-rank run, once per module: (its final checkpoint's manifest, its shard events)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, tuple[Path, list[ShardWritten]]] = {}

    def __call__(self, spec: TrainingSpec, env: dict[str, str]) -> tuple[Path, list[ShardWritten]]:
        config = spec.model_config_ref
        assert isinstance(config, ModelConfig)
        job = "job-export-" + "-".join(f"{k}{v}" for k, v in sorted(spec.parallelism.model_dump().items()))
        job += ("-fsdp-" if env else "-") + config.architecture
        if job not in self.runs:
            result = run_attempt(self.root, job, attempt=1, spec=spec, env=env)
            assert result.codes == [0, 0], "\n".join(result.logs)
            shards = shards_of(result, STEPS)
            self.runs[job] = (write_manifest(shards), shards)
        return self.runs[job]


@pytest.fixture(scope="module")
def trained(root: Path) -> Trained:
    return Trained(root)


@pytest.mark.parametrize(("model", "parallelism", "env", "split"), CASES)
def test_a_parallel_checkpoint_exports_to_a_model_transformers_loads_with_its_logits(
    trained: Trained, dataset_dir: Path, tmp_path: Path,
    model: dict[str, object], parallelism: dict[str, int], env: dict[str, str], split: str | None,
) -> None:
    spec = spec_of(model, **parallelism)
    config = spec.model_config_ref
    assert isinstance(config, ModelConfig)
    manifest, _ = trained(spec, env)
    checkpoint = manifest.parent
    if split:  # the model really is spread over both ranks' files: the export has to gather it
        metadata = FileSystemReader(checkpoint).read_metadata()
        files = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn.startswith("model.")}
        assert len(files) == 2
        chunks = len(metadata.state_dict_metadata[first_weight(config)].chunks)
        assert chunks == (2 if split == "sharded" else 1)  # a pipeline stage saves its layers whole

    out = tmp_path / "export"
    done = export(manifest, out, config, dataset_dir)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["uri"] == path_to_uri(out) and (out / LISTING_FILE).is_file()

    reference = build_model(config, seed=0, device=torch.device("cpu")).eval()
    reference.load_state_dict(load_whole(checkpoint, tmp_path)["model"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "def main(argv=None):\n    parser = argparse.ArgumentParser()\n    return 0\n"
    idx = torch.tensor([tokenizer(text)["input_ids"][: config.max_seq_len]])
    assert idx.shape[1] > 5
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, reference(idx)[0], rtol=0, atol=1e-5)
    generated = theirs.generate(idx[:, :5], max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert generated.shape == (1, 10)
    assert tokenizer.eos_token == load_dataset_manifest(dataset_dir / "manifest.json").separator


def test_a_checkpoint_with_a_corrupt_shard_is_refused_naming_it(
    root: Path, trained: Trained, dataset_dir: Path, tmp_path: Path
) -> None:
    spec = spec_of(LLAMA, data=2)
    manifest, shards = trained(spec, {"TRAINYARD_SHARDING": "fsdp"})
    copy = copy_checkpoint(ArtifactLayout(root), manifest.parent, "job-export-corrupt", shards)
    shard = min(copy.parent.glob("__1_*.distcp"))
    flip_a_byte(shard)
    out = tmp_path / "export"
    manifest = copy
    done = export(manifest, out, spec.model_config_ref, dataset_dir)
    assert done.returncode == CHECKPOINT, done.stderr
    assert shard.name in done.stderr and "refused" in done.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks share two cores
    yield
    torch.set_num_threads(threads)
