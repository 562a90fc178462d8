"""The parallel modes that run on gloo, each with 2 real ranks (``python -m trainyard_trainer``) for a few steps,
for both architectures: the GPT, and a llama with grouped-query attention (8 query heads sharing 4 key/value
heads, so that under TP each rank holds 2 kv heads, each shared by 2 of its 4 query heads).

Every mode must train the same model on the same samples as a plain single-process reference
loop (built here from the trainer's model, optimizer, schedule and sampler, without its loop or
any parallelism), to float tolerance (bf16 autocast: to bf16 tolerance), and write checkpoints
keyed by the model's plain parameter names: the final checkpoint, gathered whatever its layout
(TP shards, pipeline stages), loads strictly into the plain network and holds the reference's
weights. FSDP (ZeRO-3) resumes from a ZeRO-2 checkpoint and ends bitwise identical to the
uninterrupted ZeRO-2 run: both keep DTensor shards of the same layout, resharding after forward
and recomputing activations change memory, not arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard.data import STDLIB_SOURCES, TokenDataset, prepare_dataset
from trainyard_trainer.model import build_model
from trainyard.sampler import BatchLoader, GlobalSampler
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard_trainer.training import build_optimizer
from tests.integration.test_trainer_ranks import (
    TENANT,
    RunResult,
    assert_bitwise_equal,
    load_whole,
    losses,
    ref_for,
    run_attempt,
    shards_of,
    small_spec,
    write_manifest,
)

STEPS = 4
EVERY = 2


# gpt-tiny's shape (small_spec's), and its llama counterpart: GQA with 2 kv heads per TP rank.
MODELS: dict[str, dict[str, Any]] = {
    "gpt2": small_spec().wire()["modelConfig"],
    "llama": {"architecture": "llama", "vocabSize": 1024, "nLayers": 2, "nHeads": 8, "nKvHeads": 4, "dModel": 64,
              "dFf": 176, "maxSeqLen": 64},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def architecture(request: pytest.FixtureRequest) -> str:
    return request.param


def model_config(architecture: str) -> ModelConfig:
    # TP splits heads: dropout draws would differ
    return ModelConfig.model_validate({**MODELS[architecture], "dropout": 0.0})


def mode_spec(architecture: str, **parallelism: int) -> TrainingSpec:
    wire = small_spec().wire()
    wire["modelConfig"] = model_config(architecture).model_dump(mode="json", by_alias=True)
    wire["parallelism"] = {"data": 1, **parallelism}
    wire["training"]["maxSteps"] = STEPS
    wire["checkpointPolicy"] = {"everySteps": EVERY}
    return TrainingSpec.model_validate(wire)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parallel") / "artifacts"
    prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:6])
    return root


@dataclass
class Reference:
    losses: dict[int, float]  # per-step global-batch mean loss
    final: dict[str, torch.Tensor]  # the model's state after the last step


@pytest.fixture(scope="module")
def reference(root: Path, architecture: str) -> Reference:
    """A plain loop: one process, the whole batch, no wrappers."""
    spec = mode_spec(architecture, data=2)
    t = spec.training
    dataset = TokenDataset(ArtifactLayout(root).dataset_dir("tinycorpus", "v1") / "manifest.json", t.sequence_length)
    loader = BatchLoader(dataset, GlobalSampler(len(dataset), seed=t.seed, global_batch=t.global_batch_size,
                                                micro_batch=t.micro_batch_size, dp=1, dp_rank=0), torch.device("cpu"))
    model = build_model(spec.model_config_ref, seed=t.seed, device=torch.device("cpu"))
    optimizer = build_optimizer(model, spec)
    schedule = build_lr_scheduler(optimizer, schedule=t.lr_schedule, max_steps=t.max_steps)
    out = {}
    for step in range(1, STEPS + 1):
        batches = loader.next_step()
        total = 0.0
        for inputs, targets in batches:
            _, loss = model(inputs, targets)
            (loss / len(batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        out[step] = total / len(batches)
    return Reference(losses=out, final={k: v.detach().clone() for k, v in model.state_dict().items()})


def plain_names(checkpoint: dict[str, Any]) -> set[str]:
    return set(checkpoint["model"])


@pytest.fixture(scope="module")
def expected_names(architecture: str) -> set[str]:
    return {name for name, _ in build_model(model_config(architecture), seed=0, device=torch.device("cpu"))
            .named_parameters()}


def assert_loads_as_the_reference(checkpoint: dict[str, Any], architecture: str, reference: Reference) -> None:
    """The gathered model state is the plain network's state dict (strict load) with the reference's weights.

    To 1e-4: Adam divides by the gradient's own magnitude, so an element whose gradient is near zero
    turns a rounding difference of the reduction order into a visible part of one 3e-3 step.
    """
    plain = build_model(model_config(architecture), seed=1, device=torch.device("cpu"))
    plain.load_state_dict(checkpoint["model"], strict=True)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, reference.final[name], rtol=1e-3, atol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def check_run(result: RunResult, reference: Reference, *, rel: float, layout: dict[str, int]) -> None:
    assert result.codes == [0, 0], "\n".join(result.logs)
    got = losses(result)
    assert got and set(got) <= set(reference.losses)
    for step, loss in got.items():
        expected = reference.losses[step]
        assert loss == pytest.approx(expected, rel=rel), f"step {step}: {loss} vs {expected}"
    for step in range(EVERY, STEPS + 1, EVERY):
        if step in got:
            assert [s.parallelism for s in shards_of(result, step)] == [layout, layout]


MODES = [
    pytest.param({"data": 2}, {}, 1e-5, {"sharding": "ddp", "zeroStage": 0}, id="ddp"),
    pytest.param({"data": 2}, {"TRAINYARD_SHARDING": "zero1", "TRAINYARD_AUTOCAST": "bf16"}, 1e-3,
                 {"sharding": "zero1", "zeroStage": 1, "precision": "bfloat16-autocast"}, id="zero1+bf16"),
    pytest.param({"tensor": 2}, {}, 1e-5, {"tp": 2, "dp": 1}, id="tensor-parallel"),
    pytest.param({"pipeline": 2}, {"TRAINYARD_ACTIVATION_CHECKPOINTING": "1"}, 1e-5,
                 {"pp": 2, "dp": 1, "activationCheckpointing": True}, id="pipeline+activation-checkpointing"),
]


@pytest.mark.parametrize(("parallelism", "env", "rel", "recorded"), MODES)
def test_mode_trains_like_the_reference(
    root: Path, architecture: str, reference: Reference, expected_names: set[str], tmp_path: Path,
    parallelism: dict[str, int], env: dict[str, str], rel: float, recorded: dict[str, Any],
) -> None:
    name = "-".join(f"{k}{v}" for k, v in sorted({**parallelism, **env}.items())).lower().replace("_", "")
    job = f"job-{architecture}-{name}"[:60]
    result = run_attempt(root, job, attempt=1, spec=mode_spec(architecture, **parallelism), env=env)
    layout = {"dp": 2 // (parallelism.get("tensor", 1) * parallelism.get("pipeline", 1)),
              "tp": parallelism.get("tensor", 1), "pp": parallelism.get("pipeline", 1)}
    check_run(result, reference, rel=rel, layout=layout)
    assert recorded.items() <= result.record["parallelism"].items()
    final = load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, job, 1, STEPS), tmp_path)
    assert plain_names(final) == expected_names  # no wrapper prefixes, every parameter once
    if "TRAINYARD_AUTOCAST" not in env:  # bf16 autocast matches the fp32 reference's losses, not its weights
        assert_loads_as_the_reference(final, architecture, reference)


@pytest.fixture(scope="module")
def zero2(root: Path, architecture: str) -> RunResult:
    return run_attempt(root, f"job-{architecture}-zero2", attempt=1, spec=mode_spec(architecture, data=2),
                       env={"TRAINYARD_SHARDING": "zero2", "TRAINYARD_ACTIVATION_CHECKPOINTING": "1"})


def test_zero2_with_activation_checkpointing(zero2: RunResult, reference: Reference) -> None:
    check_run(zero2, reference, rel=1e-5, layout={"dp": 2, "tp": 1, "pp": 1})
    assert zero2.record["parallelism"]["zeroStage"] == 2 and zero2.record["parallelism"]["activationCheckpointing"]


def test_fsdp_resumes_a_zero2_checkpoint_bitwise(
    root: Path, architecture: str, zero2: RunResult, reference: Reference, expected_names: set[str], tmp_path: Path
) -> None:
    assert zero2.codes == [0, 0]
    job = f"job-{architecture}-zero2"
    manifest = write_manifest(shards_of(zero2, EVERY))
    fsdp = run_attempt(root, job, attempt=2, start=ref_for(manifest), spec=mode_spec(architecture, data=2),
                       env={"TRAINYARD_SHARDING": "fsdp"})
    check_run(fsdp, reference, rel=1e-5, layout={"dp": 2, "tp": 1, "pp": 1})
    assert sorted(losses(fsdp)) == list(range(EVERY + 1, STEPS + 1))
    assert fsdp.record["parallelism"]["zeroStage"] == 3 and fsdp.record["restore"]["rng"] == "restored"
    layout = ArtifactLayout(root)
    uninterrupted = load_whole(layout.checkpoint_dir(TENANT, job, 1, STEPS), tmp_path)
    resumed = load_whole(layout.checkpoint_dir(TENANT, job, 2, STEPS), tmp_path)
    assert plain_names(resumed) == expected_names
    assert_bitwise_equal(uninterrupted, resumed)
    assert_loads_as_the_reference(resumed, architecture, reference)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference loop and the ranks share two cores
    yield
    torch.set_num_threads(threads)
