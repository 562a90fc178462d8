"""TrainingSpec validation and hashing."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from trainyard_contract.spec import TrainingSpec, spec_hash

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
        ({"training__globalBatchSize": 30},
         "globalBatchSize (30) must be a multiple of microBatchSize (8) x parallelism.data (2) = 16"),
        ({"resources__gpuCount": 4}, "must equal resources.gpuCount = 4"),
        ({"checkpointPolicy": {"keepLast": 2}}, "exactly one of everySteps or everyMinutes"),
        ({"checkpointPolicy": {"everySteps": 5, "everyMinutes": 3}}, "exactly one of everySteps or everyMinutes"),
        ({"specVersion": "v9"}, "specVersion"),
        ({"dataset": "no-version"}, "dataset"),
        ({"training__learningRate": -1}, "learningRate"),
        ({"modelConfig": {"vocabSize": 10, "nLayers": 1, "nHeads": 3, "dModel": 8, "maxSeqLen": 4}},
         "divisible by nHeads"),
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


INLINE = {"vocabSize": 1024, "nLayers": 1, "nHeads": 2, "dModel": 16, "maxSeqLen": 64}
# The hash of {**BASE, "modelConfig": INLINE}, computed before ModelConfig had `architecture`
# and `nKvHeads`: a spec that does not set them keeps the hash it always had.
INLINE_HASH_BEFORE_ARCHITECTURE = "sha256:168a264ee70fc1c7fa6150dcb00e16e58e027134e3fa1d28d2d90d3124b2f01e"


def test_inline_model_without_architecture_keeps_its_earlier_hash() -> None:
    plain = TrainingSpec.model_validate({**BASE, "modelConfig": INLINE})
    explicit = TrainingSpec.model_validate({**BASE, "modelConfig": {**INLINE, "architecture": "gpt2"}})
    assert plain.spec_hash() == explicit.spec_hash() == INLINE_HASH_BEFORE_ARCHITECTURE
    assert "architecture" not in plain.wire()["modelConfig"] and "nKvHeads" not in plain.wire()["modelConfig"]


def test_llama_inline_model_is_part_of_the_hash() -> None:
    llama = {**INLINE, "architecture": "llama"}
    a = TrainingSpec.model_validate({**BASE, "modelConfig": llama})
    b = TrainingSpec.model_validate({**BASE, "modelConfig": {**llama, "nKvHeads": 1}})
    assert a.wire()["modelConfig"]["architecture"] == "llama" and b.wire()["modelConfig"]["nKvHeads"] == 1
    assert len({a.spec_hash(), b.spec_hash(), INLINE_HASH_BEFORE_ARCHITECTURE}) == 3


@pytest.mark.parametrize(("changes", "needle"), [
    ({"architecture": "llama", "nKvHeads": 3, "nHeads": 4}, "divisible by nKvHeads"),
    ({"nKvHeads": 1}, "only to architecture 'llama'"),
    ({"architecture": "mamba"}, "architecture"),
    ({"architecture": "llama", "nHeads": 16}, "must be even for architecture 'llama'"),
])
def test_invalid_architecture_fields_name_the_problem(changes: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        TrainingSpec.model_validate({**BASE, "modelConfig": {**INLINE, **changes}})
    assert needle in str(info.value)


# Hashes computed with the spec code before `export` and `initFrom.huggingFace` existed (commit 7a3e030):
# a spec that uses neither keeps the hash it always had.
HASHES_BEFORE_EXPORT = {
    "plain": "sha256:0d272fd60effd9f51fbafedf8eff3a9c96f7db83f815b52df9990d8e187978a4",
    "initFrom step": "sha256:a68d7340a0f90a4e697522dcacffc45003984f2eed445f5943883f7fd5feaf14",
    "initFrom latest": "sha256:a9244c920371d888977693de974c210fa2f7ddb878b29e3c12d581c96e075032",
}


def test_specs_without_export_or_a_hugging_face_start_keep_their_earlier_hashes() -> None:
    assert TrainingSpec.model_validate(BASE).spec_hash() == HASHES_BEFORE_EXPORT["plain"]
    assert TrainingSpec.model_validate(spec(initFrom={"jobId": "job-1", "globalStep": 20})).spec_hash() == (
        HASHES_BEFORE_EXPORT["initFrom step"])
    assert TrainingSpec.model_validate(spec(initFrom={"jobId": "job-1"})).spec_hash() == (
        HASHES_BEFORE_EXPORT["initFrom latest"])


def test_export_and_a_hugging_face_start_are_part_of_the_hash() -> None:
    exported = TrainingSpec.model_validate(spec(export={"format": "hf"}))
    started = TrainingSpec.model_validate(spec(initFrom={"huggingFace": "models/my-llama"}))
    assert exported.wire()["export"] == {"format": "hf"}
    assert len({exported.spec_hash(), started.spec_hash(), HASHES_BEFORE_EXPORT["plain"]}) == 3


@pytest.mark.parametrize(("init_from", "message"), [
    ({}, "exactly one of jobId"),
    ({"jobId": "job-1", "huggingFace": "models/x"}, "exactly one of jobId"),
    ({"huggingFace": "models/x", "globalStep": 3}, "globalStep goes with jobId"),
    ({"huggingFace": "models/../../other"}, "inside your tenant's prefix"),
    ({"huggingFace": "/etc"}, "huggingFace"),
])
def test_init_from_names_one_source_inside_the_tenant(init_from: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainingSpec.model_validate(spec(initFrom=init_from))


def test_an_unknown_export_format_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="export.format"):
        TrainingSpec.model_validate(spec(export={"format": "gguf"}))
