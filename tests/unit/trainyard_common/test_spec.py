"""TrainingSpec validation and hashing."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from trainyard_common.spec import TrainingSpec, spec_hash

BASE = {
    "specVersion": "v1",
    "modelConfig": "gpt-tiny@v1",
    "dataset": "tinycorpus@v1",
    "codeRevision": "abc123",
    "resources": {"gpuType": "cpu", "gpuCount": 2},
    "parallelism": {"data": 2, "tensor": 1, "pipeline": 1},
    "checkpointPolicy": {"everySteps": 10, "keepLast": 2},
    "training": {"sequenceLength": 64, "microBatchSize": 8, "globalBatchSize": 32,
                 "learningRate": 0.003, "maxSteps": 40},
}


def spec(**changes: object) -> dict:
    data = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = data
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return data


def test_valid_spec_derives_grad_accumulation() -> None:
    s = TrainingSpec.model_validate(BASE)
    assert s.grad_accumulation == 2  # 32 / (8 * 2)
    assert s.parallelism.world_size == 2


def test_hash_is_independent_of_key_order_and_explicit_defaults() -> None:
    a = TrainingSpec.model_validate(BASE)
    reordered = dict(reversed(list(copy.deepcopy(BASE).items())))
    b = TrainingSpec.model_validate(reordered)
    explicit = spec(training__seed=0, priority=0)
    c = TrainingSpec.model_validate(explicit)
    assert a.spec_hash() == b.spec_hash() == c.spec_hash()
    assert a.spec_hash().startswith("sha256:") and len(a.spec_hash()) == 7 + 64


def test_hash_changes_with_any_field() -> None:
    a = TrainingSpec.model_validate(BASE).spec_hash()
    b = TrainingSpec.model_validate(spec(training__seed=7)).spec_hash()
    assert a != b
    assert spec_hash({"a": 1, "b": 2}) == spec_hash({"b": 2, "a": 1})


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"training__globalBatchSize": 30}, "globalBatchSize (30) must be a multiple of microBatchSize (8) x parallelism.data (2) = 16"),
        ({"resources__gpuCount": 4}, "must equal resources.gpuCount = 4"),
        ({"checkpointPolicy": {"keepLast": 2}}, "exactly one of everySteps or everyMinutes"),
        ({"checkpointPolicy": {"everySteps": 5, "everyMinutes": 3}}, "exactly one of everySteps or everyMinutes"),
        ({"specVersion": "v9"}, "specVersion"),
        ({"dataset": "no-version"}, "dataset"),
        ({"training__learningRate": -1}, "learningRate"),
        ({"modelConfig": {"vocabSize": 10, "nLayers": 1, "nHeads": 3, "dModel": 8, "maxSeqLen": 4}}, "divisible by nHeads"),
        ({"unexpected": 1}, "unexpected"),
    ],
)
def test_invalid_specs_name_the_problem(changes: dict, needle: str) -> None:
    data = copy.deepcopy(BASE)
    for k, v in changes.items():
        if "__" in k:
            data = spec(**{k: v})
        else:
            data[k] = v
    with pytest.raises(ValidationError) as info:
        TrainingSpec.model_validate(data)
    assert needle in str(info.value)


def test_inline_model_config_is_accepted() -> None:
    inline = {"vocabSize": 1024, "nLayers": 1, "nHeads": 2, "dModel": 16, "maxSeqLen": 64}
    s = TrainingSpec.model_validate({**BASE, "modelConfig": inline})
    assert not isinstance(s.model_config_ref, str)
    assert s.wire()["modelConfig"]["dModel"] == 16
