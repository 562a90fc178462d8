"""initFrom.huggingFace in real trainer ranks (``python -m trainyard_trainer``, 2 gloo ranks): a GPT-2
directory transformers wrote is loaded through tensor and pipeline parallelism (each rank cutting its shard
or taking its stage's entries from the full state) — the checkpoint after one step at lr 1e-9 holds the
transformers weights — and a directory of another shape fails the attempt as ``config`` saying what differs."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainyard_contract import exitcodes
from trainyard_contract.catalog import ModelConfig
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_trainer.hf import from_hf_state_dict

from tests.integration.test_trainer_ranks import (  # noqa: F401 - fixture
    TENANT,
    WORLD,
    load_whole,
    root,
    run_attempt,
)
from tests.support.hfmodels import save_transformers_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GPT = ModelConfig(vocab_size=1024, n_layers=2, n_heads=4, d_model=64, max_seq_len=64)


def spec(parallelism: dict[str, int], config: ModelConfig = GPT) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": config.model_dump(mode="json", by_alias=True),
        "dataset": "tinycorpus@v1", "codeRevision": "test",
        "resources": {"gpuType": "cpu", "gpuCount": WORLD}, "parallelism": parallelism or {"data": WORLD},
        "checkpointPolicy": {"everySteps": 1},
        "initFrom": {"huggingFace": "models/gpt"},
        "training": {"seed": 7, "sequenceLength": 32, "microBatchSize": 2, "globalBatchSize": 4,
                     "learningRate": 1e-9, "lrSchedule": {"name": "constant"}, "maxSteps": 1},
    })


@pytest.fixture(scope="module")
def reference(root: Path) -> object:  # noqa: F811 - the fixture, by name
    return save_transformers_model(ArtifactLayout(root).model_dir(TENANT, "gpt"), GPT, seed=11)


@pytest.mark.parametrize("parallelism", [{"tensor": 2}, {"pipeline": 2}], ids=["tensor", "pipeline"])
def test_each_rank_loads_its_part_of_the_transformers_weights(
        root: Path, reference: object, parallelism: dict[str, int], tmp_path: Path) -> None:  # noqa: F811 - fixtures
    job = f"job-hf-{next(iter(parallelism))}"
    result = run_attempt(root, job, attempt=1, spec=spec(parallelism))
    assert result.codes == [0] * WORLD, "\n".join(result.logs)
    assert result.record is not None
    assert result.record["restore"]["huggingFaceUri"] == ArtifactLayout(root).model_dir(TENANT, "gpt").as_uri()
    saved = load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, job, 1, 1), tmp_path)["model"]
    theirs = from_hf_state_dict(GPT, reference.state_dict())  # type: ignore[attr-defined]  # a transformers model
    assert set(saved) == set(theirs)
    worst = max((saved[n] - theirs[n]).abs().max().item() for n in theirs)
    assert worst <= 1e-6, worst


def test_a_directory_of_another_shape_fails_the_attempt_as_config(root: Path, reference: object) -> None:  # noqa: F811 - fixtures
    wider = GPT.model_copy(update={"d_ff": 128})
    result = run_attempt(root, "job-hf-shape", attempt=1, spec=spec({}, wider))
    assert result.codes == [exitcodes.CONFIG] * WORLD, "\n".join(result.logs)
    assert "config: initFrom.huggingFace 'models/gpt' holds another model than the job's: dFf: 128 in the spec, " \
           "256 in the directory" in result.logs[0]
    assert result.record is not None and result.record["status"] == "failed"
