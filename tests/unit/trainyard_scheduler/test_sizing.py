"""The scheduler's device-memory floor: the spec under its most memory-frugal layout."""

from __future__ import annotations

from typing import Any

from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_contract.spec import TrainingSpec
from trainyard_planner import LayoutAssumption, Transformer, estimate_memory, spec_layout
from trainyard_scheduler.sizing import min_device_memory


def spec_of(model: Any = "gpt-tiny@v1", *, data: int = 2, micro: int = 2, seq: int = 64) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": model, "dataset": "tinycorpus@v1", "codeRevision": "t",
        "resources": {"gpuType": "h100", "gpuCount": data}, "parallelism": {"data": data},
        "checkpointPolicy": {"everySteps": 10},
        "training": {"sequenceLength": seq, "microBatchSize": micro, "globalBatchSize": micro * data * 2,
                     "learningRate": 0.001, "maxSteps": 20},
    })


def test_the_floor_is_the_most_frugal_layout_without_headroom() -> None:
    for data in (1, 4):
        spec = spec_of(data=data)
        model = Transformer.from_model_config(MODEL_CATALOG["gpt-tiny@v1"], seq_len=64)
        frugal = estimate_memory(model, spec_layout(spec, assume=LayoutAssumption.MOST_FRUGAL), headroom=0.0)
        assert min_device_memory(spec) == int(frugal.required_bytes_per_device) > 0


def test_the_floor_is_below_what_the_trainer_runs_with() -> None:
    spec = spec_of(data=4)
    model = Transformer.from_model_config(MODEL_CATALOG["gpt-tiny@v1"], seq_len=64)
    trainer = estimate_memory(model, spec_layout(spec, assume=LayoutAssumption.TRAINER_DEFAULTS), headroom=0.0)
    assert min_device_memory(spec) < trainer.required_bytes_per_device



def test_a_model_the_catalog_lacks_turns_the_check_off_with_a_warning(caplog: Any) -> None:
    assert min_device_memory(spec_of("no-such-model@v9")) == 0
    assert "no device-memory floor" in caplog.text and "no-such-model@v9" in caplog.text
