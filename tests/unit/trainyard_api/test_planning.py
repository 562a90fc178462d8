"""``POST /v1/plan`` and the submission-time memory check, as pure functions (no Redis, no HTTP)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from trainyard_api.planning import (
    PLAN_EXAMPLES,
    PlanRequest,
    check_spec_memory,
    plan,
    trainer_bytes_per_parameter,
    trainer_layout,
)
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_api.validation import InvalidSpecError
from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import SpecError
from trainyard_contract.spec import TrainingSpec
from trainyard_planner import Recompute, ZeroStage

# 4.0B parameters: 71.9 GB used on one device (inside 80 GB, but not with 15 % headroom)
SNUG = {"vocabSize": 50304, "nLayers": 34, "nHeads": 24, "dModel": 3072, "maxSeqLen": 2048}
# 39B parameters: 625 GB of fp32 AdamW states alone
BIG = {"vocabSize": 50304, "nLayers": 48, "nHeads": 64, "dModel": 8192, "maxSeqLen": 2048}


def planned(body: dict[str, Any]) -> dict[str, Any]:
    return plan(PlanRequest.model_validate(body)).model_dump(mode="json", by_alias=True, exclude_none=True)


def spec_for(model: str | dict, *, gpu: str = "h100-80gb", gpus: int = 1, micro: int = 1, seq: int = 2048,
             optimizer: str = "adamw") -> TrainingSpec:
    data = copy.deepcopy(EXAMPLE_SPEC)
    data["modelConfig"] = model
    data["resources"] = {"gpuType": gpu, "gpuCount": gpus}
    data["parallelism"] = {"data": gpus}
    data["training"].update(microBatchSize=micro, globalBatchSize=micro * gpus, sequenceLength=seq,
                            optimizer={"name": optimizer})
    return TrainingSpec.model_validate(data)


def config_of(model: str | dict) -> ModelConfig:
    return MODEL_CATALOG[model] if isinstance(model, str) else ModelConfig.model_validate(model)


# ----------------------------------------------------------------------------- POST /v1/plan


def test_a_parameter_count_gives_the_seeds_model_states() -> None:
    body = planned({"model": {"parameters": 70e9}, "layout": {"dp": 1, "zeroStage": 0}})
    assert body["memory"]["modelStatesBytesPerDevice"] == pytest.approx(1.12e12, rel=1e-12)
    assert body["step"]["memory"] == body["memory"] and body["step"]["fits"] is False
    assert body["model"]["source"] == "parameters" and body["devices"] == 1
    assert body["step"]["bottleneck"] == "memory" and "recommendation" not in body
    assert set(body) == {"model", "device", "devices", "topology", "memory", "step", "compute"}


def test_zero_3_shards_model_states_over_data_parallel_ranks() -> None:
    body = planned({"model": {"parameters": 70e9}, "devices": 64, "layout": {"dp": 64, "zeroStage": 3}})
    assert body["memory"]["modelStatesBytesPerDevice"] == pytest.approx(1.12e12 / 64)
    assert body["step"]["comm"]["dpBytes"] > 0 and body["step"]["comm"]["dpTier"] == "cross_rack"


def test_a_catalog_model_with_time_to_train_and_a_checkpoint_plan() -> None:
    body = planned(PLAN_EXAMPLES["layout"]["value"])
    config = MODEL_CATALOG["gpt-1b@v1"]
    assert body["model"]["parameters"] == config.num_parameters and body["model"]["source"] == "gpt-1b@v1"
    assert body["step"]["tokensPerStep"] == 4 * 8 * 2 * 2048 == body["compute"]["tokensPerStep"]
    time = body["compute"]["trainingTime"]
    # model FLOPs, what MFU divides: 6N + 12·L·H·Q·T per token
    assert body["compute"]["trainingFlops"] == pytest.approx(body["compute"]["modelFlopsPerToken"] * 26e9)
    assert time["mfu"] == pytest.approx(body["step"]["mfu"]) and time["devices"] == 8
    checkpoint = body["checkpoint"]
    assert checkpoint["sizeBytes"] == pytest.approx(14 * config.num_parameters)  # no gradients in a checkpoint
    assert checkpoint["writeSeconds"] == pytest.approx(checkpoint["sizeBytes"] / 2e9)
    assert checkpoint["mtbfSeconds"] == pytest.approx(50_000 * 3600 / 8)
    assert checkpoint["intervalSteps"] == round(checkpoint["intervalSeconds"] / body["step"]["stepSeconds"])


def test_the_seeds_time_to_train_on_a_custom_device() -> None:
    device = {"name": "seed-gpu", "peakFlops": 300e12, "memoryBytes": 80e9, "nvlinkBandwidth": 300e9,
              "networkBandwidth": 25e9}
    body = planned({"model": {"parameters": 70e9}, "device": device, "devices": 256, "tokens": 1e12, "mfu": 1.0,
                    "layout": {"dp": 256, "zeroStage": 3}})
    # the seed's 6·N·D is 4.2e23; with attention's 12·L·H·Q·T (what MFU divides) 4 % more
    assert body["compute"]["trainingFlops"] == pytest.approx(4.375e23, rel=0.001)
    assert body["compute"]["trainingTime"]["days"] == pytest.approx(65.9, abs=0.05)


def test_recommend_ranks_and_explains() -> None:
    body = planned({**PLAN_EXAMPLES["recommend"]["value"], "limit": 3})
    rec = body["recommendation"]
    assert rec["acceptedCount"] > 3 and len(rec["accepted"]) == len(rec["rejected"]) == 3
    assert rec["best"] == rec["accepted"][0] and body["memory"] == rec["best"]["memory"]
    assert [a["stepSeconds"] for a in rec["accepted"]] == sorted(a["stepSeconds"] for a in rec["accepted"])
    assert rec["rejected"][0]["reasons"] == ["needs 1376.4 GB per device, 80 GB available"]
    assert "step" not in body


def test_lowering_the_network_moves_the_bottleneck_to_the_interconnect() -> None:
    base = {"model": "gpt-1b@v1", "devices": 64, "layout": {"dp": 64, "zeroStage": 3, "microBatch": 4}}
    fast = planned({**base, "topology": {"intraRackBandwidth": 400e9}})
    slow = planned({**base, "topology": {"intraRackBandwidth": 1e9}})
    assert fast["step"]["bottleneck"] == "compute" and slow["step"]["bottleneck"] == "interconnect"
    assert slow["topology"]["crossRack"]["bandwidth"] == 1e9  # follows the NIC unless given


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"model": "gpt-huge@v9"}, "model", "gpt-tiny@v1"),
    ({"model": "gpt-tiny@v1", "sequenceLength": 4096}, "sequenceLength", "maxSeqLen (128)"),
    ({"model": "gpt-tiny@v1", "device": "tpu-v9"}, "device", "h100-80gb"),
    ({"model": "gpt-tiny@v1", "devices": 8, "layout": {"dp": 2}}, "layout", "must equal devices (8)"),
    ({"model": "gpt-tiny@v1", "layout": "recommend"}, "globalBatch", "required"),
    ({"model": "gpt-tiny@v1", "globalBatch": 8, "layout": {"dp": 1}}, "globalBatch", "= 1"),
    ({"model": "gpt-tiny@v1", "checkpoint": {"writeBandwidth": 1e9, "mtbfSeconds": 60, "restartSeconds": 1e6}},
     "checkpoint", "out of the range"),  # Daly's exp(restart / MTBF) overflowed: a 500, once
])
def test_planner_errors_are_422s_naming_the_field(body: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        planned(body)
    problems = caught.value.problems if isinstance(caught.value, InvalidSpecError) else None
    fields = [p.field for p in problems] if problems else [caught.value.field]
    assert any(f == field or f.startswith(f"{field}.") for f in fields), fields
    assert words in caught.value.message


def test_the_request_is_strict_camel_case() -> None:
    with pytest.raises(ValidationError):
        PlanRequest.model_validate({"model": "gpt-tiny@v1", "globalbatch": 8})
    with pytest.raises(ValidationError):
        PlanRequest.model_validate({"model": {"parameters": 0.5}})  # the planner needs a whole parameter
    with pytest.raises(ValidationError):
        PlanRequest.model_validate({"model": "gpt-tiny@v1", "microBatches": [4, 0]})
    with pytest.raises(ValidationError):
        PlanRequest.model_validate({"model": "gpt-tiny@v1", "checkpoint": {
            "writeBandwidth": 1e9, "mtbfSeconds": 10, "deviceMtbfHours": 1}})


# ----------------------------------------------------------------------------- submission check


def test_the_spec_is_checked_as_the_trainer_runs_it() -> None:
    spec = spec_for("gpt-1b@v1", gpus=4, micro=2)
    layout = trainer_layout(spec)
    assert (layout.dp, layout.zero_stage, layout.micro_batch, layout.microbatches) == (4, ZeroStage.NONE, 2, 1)
    assert layout.recompute is Recompute.SELECTIVE  # fused SDPA stores no s x s scores
    assert trainer_bytes_per_parameter(spec).total == 16
    assert trainer_bytes_per_parameter(spec_for("gpt-1b@v1", optimizer="sgd")).total == 12


def test_a_model_that_cannot_fit_is_rejected_naming_model_and_device() -> None:
    check = check_spec_memory(spec_for(BIG), config_of(BIG))
    fields = {p.field: p.message for p in check.problems}
    assert set(fields) == {"modelConfig", "resources.gpuType"} and not check.warnings
    assert "needs 653.3 GB per device, 80 GB available" in fields["modelConfig"]
    assert "ZeRO 0" in fields["modelConfig"] and "h100-80gb has 80 GB" in fields["resources.gpuType"]


def test_a_model_inside_the_headroom_is_accepted_with_a_warning() -> None:
    check = check_spec_memory(spec_for(SNUG), config_of(SNUG))
    assert not check.problems and len(check.warnings) == 1
    assert "71.9 GB of the 80 GB" in check.warnings[0] and "15% headroom" in check.warnings[0]
    assert not check_spec_memory(spec_for(SNUG, gpu="h200"), config_of(SNUG)).warnings


@pytest.mark.parametrize("gpu", ["cpu", "CPU"])
def test_cpu_ranks_are_not_checked(gpu: str) -> None:
    check = check_spec_memory(spec_for(BIG, gpu=gpu), config_of(BIG))  # host memory is not the API's to know
    assert (check.problems, check.warnings, check.memory) == ([], [], None)


def test_an_unknown_device_type_is_accepted_with_a_warning() -> None:
    check = check_spec_memory(spec_for("gpt-tiny@v1", gpu="sim-gpu", seq=64), config_of("gpt-tiny@v1"))
    assert not check.problems and "memory not checked" in check.warnings[0] and "h100-80gb" in check.warnings[0]


def test_the_example_job_fits_silently() -> None:
    spec = TrainingSpec.model_validate({**EXAMPLE_SPEC, "resources": {"gpuType": "a100-40gb", "gpuCount": 2}})
    check = check_spec_memory(spec, config_of("gpt-tiny@v1"))
    assert not check.problems and not check.warnings and check.memory is not None


def test_time_to_train_divides_the_flops_the_rate_counts() -> None:
    """Narayanan et al. 2021 §5.1: 140 TFLOP/s per A100 counting full recomputation trains GPT-3 175B
    on 300B tokens with 1024 GPUs in ~34 days; the same rate read as model FLOPs (attention included) says 26.1."""
    body = {"model": {"parameters": 175e9}, "devices": 1024, "tokens": 300e9, "mfu": 1,
            "layout": {"dp": 1024, "recompute": "full"},
            "device": {"name": "a100-140", "peakFlops": 140e12, "memoryBytes": 80e9,
                       "nvlinkBandwidth": 300e9, "networkBandwidth": 25e9}}
    model = planned(body)["compute"]
    assert model["flopsCounted"] == "model" and model["trainingTime"]["days"] == pytest.approx(26.1, abs=0.05)
    hardware = planned({**body, "flops": "hardware"})["compute"]
    assert hardware["recompute"] == "full" and hardware["trainingTime"]["counts"] == "hardware"
    assert hardware["trainingTime"]["days"] == pytest.approx(34, rel=0.03)
    assert hardware["hardwareFlops"] == pytest.approx(hardware["hardwareFlopsPerToken"] * 300e9)
    # without a given mfu each count runs at the estimate's own utilisation of it (hardware: MFU x hardware /
    # model FLOPs per token): one MFU definition, so both give the same time to train
    estimated = planned({**body, "mfu": None, "flops": "hardware"})["compute"]["trainingTime"]
    as_model = planned({**body, "mfu": None})["compute"]["trainingTime"]
    assert estimated["days"] == pytest.approx(as_model["days"], rel=1e-9) and as_model["days"] > 0
