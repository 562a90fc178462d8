"""The parallel modes that run on gloo, each with 2 real ranks (``python -m trainyard_trainer``) for a few steps.

Every mode must train the same model on the same samples as a plain single-process reference
loop (built here from the trainer's model, optimizer, schedule and sampler, without its loop or
any parallelism), to float tolerance (bf16 autocast: to bf16 tolerance), and write checkpoints
keyed by the model's plain parameter names. FSDP (ZeRO-3) resumes from a ZeRO-2 checkpoint and
ends bitwise identical to the uninterrupted ZeRO-2 run: both keep DTensor shards of the same
layout, resharding after forward and recomputing activations change memory, not arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainyard_common.spec import TrainingSpec
from trainyard_common.storage import ArtifactLayout
from trainyard_trainer.data import STDLIB_SOURCES, TokenDataset, prepare_dataset
from trainyard_trainer.model import build_model
from trainyard_trainer.sampler import BatchLoader, GlobalSampler
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


def mode_spec(**parallelism: int) -> TrainingSpec:
    wire = small_spec().wire()
    wire["modelConfig"]["dropout"] = 0.0  # TP splits attention heads, so dropout draws would differ
    wire["parallelism"] = {"data": 1, **parallelism}
    wire["training"]["maxSteps"] = STEPS
    wire["checkpointPolicy"] = {"everySteps": EVERY}
    return TrainingSpec.model_validate(wire)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parallel") / "artifacts"
    prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:6])
    return root


@pytest.fixture(scope="module")
def reference(root: Path) -> dict[int, float]:
    """Per-step global-batch mean loss of a plain loop: one process, the whole batch, no wrappers."""
    spec = mode_spec(data=2)
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
    return out


def plain_names(checkpoint: dict[str, Any]) -> set[str]:
    return set(checkpoint["model"])


@pytest.fixture(scope="module")
def expected_names(root: Path) -> set[str]:
    return {name for name, _ in build_model(mode_spec(data=2).model_config_ref, seed=0, device=torch.device("cpu"))
            .named_parameters()}


def check_run(result: RunResult, reference: dict[int, float], *, rel: float, layout: dict[str, int]) -> None:
    assert result.codes == [0, 0], "\n".join(result.logs)
    got = losses(result)
    assert got and set(got) <= set(reference)
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=rel), f"step {step}: {loss} vs {reference[step]}"
    for step in range(EVERY, STEPS + 1, EVERY):
        if step in got:
            assert [s.parallelism for s in shards_of(result, step)] == [layout, layout]


MODES = [
    pytest.param({"data": 2}, {"TRAINYARD_SHARDING": "zero1", "TRAINYARD_AUTOCAST": "bf16"}, 1e-3,
                 {"sharding": "zero1", "zeroStage": 1, "precision": "bfloat16-autocast"}, id="zero1+bf16"),
    pytest.param({"tensor": 2}, {}, 1e-5, {"tp": 2, "dp": 1}, id="tensor-parallel"),
    pytest.param({"pipeline": 2}, {"TRAINYARD_ACTIVATION_CHECKPOINTING": "1"}, 1e-5,
                 {"pp": 2, "dp": 1, "activationCheckpointing": True}, id="pipeline+activation-checkpointing"),
]


@pytest.mark.parametrize(("parallelism", "env", "rel", "recorded"), MODES)
def test_mode_trains_like_the_reference(
    root: Path, reference: dict[int, float], expected_names: set[str], tmp_path: Path,
    parallelism: dict[str, int], env: dict[str, str], rel: float, recorded: dict[str, Any],
) -> None:
    job = "job-" + "-".join(f"{k}{v}" for k, v in sorted({**parallelism, **env}.items())).lower().replace("_", "")
    result = run_attempt(root, job[:60], attempt=1, spec=mode_spec(**parallelism), env=env)
    layout = {"dp": 2 // (parallelism.get("tensor", 1) * parallelism.get("pipeline", 1)),
              "tp": parallelism.get("tensor", 1), "pp": parallelism.get("pipeline", 1)}
    check_run(result, reference, rel=rel, layout=layout)
    assert recorded.items() <= result.record["parallelism"].items()
    final = load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, job[:60], 1, STEPS), tmp_path)
    assert plain_names(final) == expected_names  # no wrapper prefixes, every parameter once


@pytest.fixture(scope="module")
def zero2(root: Path) -> RunResult:
    return run_attempt(root, "job-zero2", attempt=1, spec=mode_spec(data=2),
                       env={"TRAINYARD_SHARDING": "zero2", "TRAINYARD_ACTIVATION_CHECKPOINTING": "1"})


def test_zero2_with_activation_checkpointing(zero2: RunResult, reference: dict[int, float]) -> None:
    check_run(zero2, reference, rel=1e-5, layout={"dp": 2, "tp": 1, "pp": 1})
    assert zero2.record["parallelism"]["zeroStage"] == 2 and zero2.record["parallelism"]["activationCheckpointing"]


def test_fsdp_resumes_a_zero2_checkpoint_bitwise(
    root: Path, zero2: RunResult, reference: dict[int, float], expected_names: set[str], tmp_path: Path
) -> None:
    assert zero2.codes == [0, 0]
    manifest = write_manifest(shards_of(zero2, EVERY))
    fsdp = run_attempt(root, "job-zero2", attempt=2, start=ref_for(manifest), spec=mode_spec(data=2),
                       env={"TRAINYARD_SHARDING": "fsdp"})
    check_run(fsdp, reference, rel=1e-5, layout={"dp": 2, "tp": 1, "pp": 1})
    assert sorted(losses(fsdp)) == list(range(EVERY + 1, STEPS + 1))
    assert fsdp.record["parallelism"]["zeroStage"] == 3 and fsdp.record["restore"]["rng"] == "restored"
    layout = ArtifactLayout(root)
    uninterrupted = load_whole(layout.checkpoint_dir(TENANT, "job-zero2", 1, STEPS), tmp_path)
    resumed = load_whole(layout.checkpoint_dir(TENANT, "job-zero2", 2, STEPS), tmp_path)
    assert plain_names(resumed) == expected_names
    assert_bitwise_equal(uninterrupted, resumed)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference loop and the ranks share two cores
    yield
    torch.set_num_threads(threads)
