"""Spec problems → camelCase dotted field paths; reference checks against catalog and registry."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import pytest
from pydantic import ValidationError

from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_api.validation import (
    STREAM_ID_PATTERN,
    FieldProblem,
    check_references,
    decimal_at_most,
    field_errors,
    spec_field_paths,
)
from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_contract.spec import TrainingSpec


def spec_with(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(EXAMPLE_SPEC)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = spec
        for p in parents:
            node = node[p]
        if value is ...:
            del node[leaf]
        else:
            node[leaf] = value
    return spec


def problems_of(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ValidationError) as info:
        TrainingSpec.model_validate(data)
    return {p.field: p.message for p in field_errors(info.value.errors())}


INLINE = {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 64, "maxSeqLen": 128}


@pytest.mark.parametrize(("changes", "field", "says"), [
    ({"training.globalBatchSize": 33}, "training.globalBatchSize", "multiple of"),
    ({"resources.gpuCount": 3}, "parallelism", "resources.gpuCount"),
    ({"resources.gpuCount": 0}, "resources.gpuCount", "greater than 0"),
    ({"training.maxSteps": ...}, "training.maxSteps", "required"),
    ({"training.lr": 0.1}, "training.lr", "unknown field"),
    ({"checkpointPolicy.everyMinutes": 5}, "checkpointPolicy.everySteps", "exactly one"),
    ({"modelConfig": "not a ref"}, "modelConfig", "name@version"),
    ({"modelConfig": 7}, "modelConfig", "wrong type"),
    ({"modelConfig": {**INLINE, "nHeads": 3}}, "modelConfig.dModel", "divisible by nHeads"),
    ({"modelConfig": {**INLINE, "maxSeqLen": -1}}, "modelConfig.maxSeqLen", "greater than 0"),
    ({"specVersion": "v2"}, "specVersion", "v1"),
    ({"training.optimizer": {"name": "lion"}}, "training.optimizer.name", "adamw"),
])
def test_each_problem_names_its_camelcase_field(changes: dict, field: str, says: str) -> None:
    found = problems_of(spec_with(**changes))
    assert field in found, found
    assert says in found[field]


def test_every_problem_is_reported_at_once_and_union_noise_is_dropped() -> None:
    found = problems_of(spec_with(**{
        "resources.gpuCount": 0, "training.learningRate": "x", "modelConfig": {**INLINE, "bogus": 1},
    }))
    assert set(found) == {"resources.gpuCount", "training.learningRate", "modelConfig.bogus"}


def test_fastapi_locations_are_relative_to_the_body() -> None:
    errors = [
        {"type": "missing", "loc": ("body", "training", "maxSteps"), "msg": "Field required"},
        {"type": "greater_than", "loc": ("query", "limit"), "msg": "Input should be greater than 0"},
        {"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}},
        {"type": "value_error", "loc": ("body",), "msg": "Value error, something vague"},
    ]
    assert field_errors(errors) == [
        FieldProblem("training.maxSteps", "required field is missing"),
        FieldProblem("query.limit", "Input should be greater than 0"),
        FieldProblem("body", "the body is not valid JSON: Expecting value"),
        FieldProblem("spec", "something vague"),
    ]


def test_field_paths_cover_nested_and_inline_model_fields() -> None:
    paths = spec_field_paths()
    for p in ("training.globalBatchSize", "training.lrSchedule.warmupSteps", "modelConfig.maxSeqLen",
              "checkpointPolicy.everySteps", "resources.gpuCount"):
        assert p in paths


def spec(**changes: Any) -> TrainingSpec:
    return TrainingSpec.model_validate(spec_with(**changes))


def test_known_references_pass() -> None:
    assert check_references(spec(), catalog=MODEL_CATALOG, dataset_known=True) == []


def test_unknown_model_and_dataset_are_both_named() -> None:
    problems = check_references(spec(modelConfig="gpt-huge@v9", dataset="nope@v1"),
                                catalog=MODEL_CATALOG, dataset_known=False)
    by_field = {p.field: p.message for p in problems}
    assert "gpt-huge@v9" in by_field["modelConfig"] and "gpt-tiny@v1" in by_field["modelConfig"]
    assert "nope@v1" in by_field["dataset"] and "make data" in by_field["dataset"]


def test_sequence_length_must_fit_the_model() -> None:
    problems = check_references(spec(modelConfig={**INLINE, "maxSeqLen": 32}),
                                catalog=MODEL_CATALOG, dataset_known=True)
    assert [p.field for p in problems] == ["training.sequenceLength"]
    assert "maxSeqLen (32)" in problems[0].message


def test_tensor_parallelism_must_divide_heads() -> None:
    s = spec(**{"parallelism.data": 1, "parallelism.tensor": 3, "resources.gpuCount": 3,
                "training.globalBatchSize": 24})
    problems = check_references(s, catalog=MODEL_CATALOG, dataset_known=True)
    assert [p.field for p in problems] == ["parallelism.tensor"]


@pytest.mark.parametrize("axis", ["tensor", "pipeline"])
def test_llama_takes_tensor_and_pipeline_parallelism(axis: str) -> None:
    s = spec(**{"modelConfig": "llama-tiny@v1", "parallelism.data": 1, f"parallelism.{axis}": 2,
                "resources.gpuCount": 2, "training.globalBatchSize": 16})
    assert check_references(s, catalog=MODEL_CATALOG, dataset_known=True) == []


LLAMA_INLINE = {**INLINE, "architecture": "llama", "nHeads": 8, "nKvHeads": 2, "dFf": 176}


@pytest.mark.parametrize(("model", "tensor", "says"), [
    # 8 query heads split over 4 ranks, but 2 kv heads cannot: every rank needs its queries' kv heads
    (LLAMA_INLINE, 4, "must divide nKvHeads (2) of the inline model: each rank computes whole heads; choose a "
                      "parallelism.tensor that divides all of 8, 2, 176"),
    ({**LLAMA_INLINE, "dFf": 170}, 4, "must divide nKvHeads (2) and the FFN width (dFf) (170) of"),
    ("llama-tiny@v1", 4, "must divide nKvHeads (2) of llama-tiny@v1"),
    ({**INLINE, "nHeads": 8}, 3, "must divide nHeads (8) and the FFN width (4 x dModel) (256) of"),
])
def test_tensor_parallelism_must_divide_kv_heads_and_ffn_width(model: Any, tensor: int, says: str) -> None:
    s = spec(**{"modelConfig": model, "parallelism.data": 1, "parallelism.tensor": tensor,
                "resources.gpuCount": tensor, "training.globalBatchSize": 8 * tensor})
    problems = check_references(s, catalog=MODEL_CATALOG, dataset_known=True)
    assert [p.field for p in problems] == ["parallelism.tensor"]
    assert says in problems[0].message
    divides = spec(**{"modelConfig": model, "parallelism.data": 1, "parallelism.tensor": 2, "resources.gpuCount": 2,
                      "training.globalBatchSize": 16})
    assert check_references(divides, catalog=MODEL_CATALOG, dataset_known=True) == []


@pytest.mark.parametrize(("init", "known", "steps", "field"), [
    (None, False, [], None),
    ({"jobId": "job-a"}, True, [20, 40], None),
    ({"jobId": "job-a", "globalStep": 20}, True, [20, 40], None),
    ({"jobId": "job-x"}, False, [], "initFrom.jobId"),
    ({"jobId": "job-a"}, True, [], "initFrom.jobId"),
    ({"jobId": "job-a", "globalStep": 30}, True, [20, 40], "initFrom.globalStep"),
])
def test_init_from_names_a_job_of_the_tenant_with_a_ready_checkpoint(
    init: dict[str, Any] | None, known: bool, steps: list[int], field: str | None
) -> None:
    from trainyard_api.validation import check_init_from

    data = copy.deepcopy(EXAMPLE_SPEC)
    if init is not None:
        data["initFrom"] = init
    spec = TrainingSpec.model_validate(data)
    problems = check_init_from(spec, parent_known=known, ready_steps=steps)
    assert [p.field for p in problems] == ([field] if field else [])
    if field == "initFrom.globalStep":
        assert "READY steps: 20, 40" in problems[0].message


@pytest.mark.parametrize(("raw", "fields"), [
    (b'{"a": 1, "b": true, "c": 1.5}', []),
    (b'{"a": 1.0, "b": true, "c": 2}', []),  # JSON Schema: 1.0 is an integer, 2 a number
    (b'{"a": "1", "b": true, "c": 1}', ["a"]),
    (b'{"a": 1, "b": 0, "c": 1}', ["b"]),
    (b'{"a": 1, "b": "yes", "c": "1.5"}', ["b", "c"]),
    (b'{"a": 1, "b": true, "c": NaN}', ["body"]),
    (b'{"a": 1e999, "b": true, "c": 1}', ["body"]),
    (b"not json", []),  # FastAPI's own parsing reports it
])
def test_strict_bodies_have_the_types_of_their_schema(raw: bytes, fields: list[str]) -> None:
    from pydantic import BaseModel, TypeAdapter

    from trainyard_api.validation import strict_body_errors

    class Body(BaseModel):
        a: int
        b: bool
        c: float

    assert [p.field for p in field_errors(strict_body_errors(TypeAdapter(Body), raw))] == fields


def test_a_reference_that_is_not_name_at_version_says_so() -> None:
    from trainyard_api.bodies import SubmittedSpec

    with pytest.raises(ValidationError) as info:
        SubmittedSpec.model_validate(spec_with(modelConfig=""))
    assert [(p.field, "name@version" in p.message) for p in field_errors(info.value.errors())] == [
        ("modelConfig", True)]


@pytest.mark.parametrize(("model", "vocab", "field"), [
    ({**INLINE, "vocabSize": 1024}, 70_000, "modelConfig.vocabSize"),  # an inline model names its field
    ("gpt-tiny@v1", 50_257, "modelConfig"),                            # a catalog model: the reference
    ({**INLINE, "vocabSize": 70_000}, 70_000, None),                   # exactly the tokenizer's: fits
    ("gpt-tiny@v1", None, None),                                       # the registry does not know it
])
def test_a_model_smaller_than_the_datasets_vocabulary_is_refused(model: Any, vocab: int | None,
                                                                 field: str | None) -> None:
    problems = check_references(spec(modelConfig=model), catalog=MODEL_CATALOG, dataset_known=True,
                                dataset_vocab=vocab)
    assert [p.field for p in problems] == ([field] if field else [])
    assert field is None or f"vocabSize >= {vocab}" in problems[0].message


@pytest.mark.parametrize("limit", [0, 1, 7, 9, 10, 19, 99, 100, 305, 1000, 4096])
def test_a_decimal_pattern_admits_exactly_the_numbers_up_to_its_limit(limit: int) -> None:
    pattern = re.compile(rf"^{decimal_at_most(limit)}$")
    width = len(str(limit))
    for n in range(0, 2 * limit + 12):
        for text in {str(n), str(n).zfill(width)}:
            assert bool(pattern.match(text)) == (n <= limit and len(text) <= width), (limit, text)


def test_a_stream_id_is_two_unsigned_64_bit_numbers() -> None:
    top = 2**64 - 1
    pattern = re.compile(STREAM_ID_PATTERN)
    admitted = ["0-0", f"{top}-{top}", f"{top - 1}-0", f"0-{top}", "1733222400000-5", f"{10**19}-0", "0" * 20 + "-1"]
    refused = [f"{top + 1}-0", f"0-{top + 1}", f"{10**20}-0", "99999999999999999999-0", f"{top}0-0", "1-", "-1",
               "1-2-3", "a-1", f"{2**65}-0"]
    assert [t for t in admitted if not pattern.match(t)] == []
    assert [t for t in refused if pattern.match(t)] == []
    rng = random.Random(64)
    for _ in range(2000):
        a, b = rng.randrange(0, 2**65), rng.randrange(0, 2**65)
        assert bool(pattern.match(f"{a}-{b}")) == (a <= top and b <= top)
