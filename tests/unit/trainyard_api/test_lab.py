"""The Lab's API as pure functions: the requests' shapes, and answers that are the planner's own numbers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainyard_api.lab import (
    LabCheckpointRequest,
    LabMemoryRequest,
    LabScalingRequest,
    curve_range,
    lab_checkpoint,
    lab_memory,
    lab_scaling,
)
from trainyard_api.planning import PlanRequest, plan
from trainyard_contract.errors import SpecError
from trainyard_planner import device_spec, young_interval


def test_memory_answers_the_contracts_shape_with_plans_numbers() -> None:
    body = {"model": "gpt-1b@v1", "devices": 8, "sharding": "zero2", "microBatch": 2, "device": "h100"}
    wire = lab_memory(LabMemoryRequest.model_validate(body)).wire()
    assert {"perDevice", "bytesPerParameter", "curve", "shardingNeededAbove", "fitsUpTo", "model",
            "device"} <= set(wire)
    assert set(wire["curve"][0]) == {"parameters", "ddp", "zero1", "zero2", "fsdp"}
    assert wire["bytesPerParameter"]["total"] == 16
    # POST /v1/plan for the same model and layout says the same memory
    planned = plan(PlanRequest.model_validate({"model": "gpt-1b@v1", "device": "h100", "devices": 8,
                                               "layout": {"dp": 8, "zeroStage": 2, "microBatch": 2}}))
    assert planned.memory is not None
    per_device = wire["perDevice"]
    assert per_device["totalBytes"] == planned.memory.used_bytes_per_device
    assert per_device["optimizerBytes"] == planned.memory.optimizer_bytes_per_device
    assert per_device["capacityBytes"] == 80e9 and per_device["fits"] is planned.memory.fits(80e9)
    assert wire["model"]["source"] == "gpt-1b@v1" and wire["device"]["name"] == "h100-80gb"


def test_memory_curve_range_stays_inside_the_bounds() -> None:
    assert curve_range(7e9, None, None) == (7e6, 7e12)
    assert curve_range(1, None, None) == (1e6, 1e12)
    assert curve_range(1e15, None, None) == (1e9, 1e15)
    assert curve_range(7e9, 1e14, None) == (1e14, 1e15)
    assert curve_range(7e9, None, 1e7) == (1e6, 1e7)
    with pytest.raises(SpecError, match=r"curveTo \(1e\+08\) must be above curveFrom \(1e\+09\)") as info:
        lab_memory(LabMemoryRequest.model_validate({"model": {"parameters": 1e9}, "curveFrom": 1e9, "curveTo": 1e8}))
    assert info.value.field == "curveTo"


def test_scaling_takes_bandwidth_in_gbps_and_answers_per_node_count() -> None:
    body = {"model": {"parameters": 7e9}, "nodes": 8, "devicesPerNode": 8, "interconnectGBps": 5,
            "intraNodeGBps": 300, "globalBatch": 256, "sharding": "fsdp"}
    result = lab_scaling(LabScalingRequest.model_validate(body))
    assert [p.nodes for p in result.points] == [1, 2, 4, 8]
    assert result.interconnect_bandwidth == 5e9 and result.intra_node_bandwidth == 300e9
    wire = result.wire()
    assert {"devices", "stepSeconds", "computeSeconds", "communicationSeconds", "commToCompute",
            "tokensPerSecond", "efficiency"} <= set(wire["points"][0])
    assert "stopsHelpingAt" in wire and "below 0.5 x" in wire["rule"]
    listed = lab_scaling(LabScalingRequest.model_validate({**body, "nodes": [4, 1, 4]}))
    assert [p.nodes for p in listed.points] == [1, 4]


def test_scaling_refuses_a_tensor_degree_naming_the_field() -> None:
    body = {"model": "gpt-1b@v1", "nodes": 2, "devicesPerNode": 8}
    with pytest.raises(SpecError) as info:
        lab_scaling(LabScalingRequest.model_validate({**body, "tensor": 3}))
    assert info.value.field == "tensor" and "must divide devicesPerNode" in info.value.message


def test_checkpoint_optimum_is_youngs() -> None:
    result = lab_checkpoint(LabCheckpointRequest.model_validate(
        {"mtbfHours": 3.1, "writeSeconds": 60, "restartSeconds": 600, "stepSeconds": 5}))
    assert result.optimum_seconds == young_interval(60, 3.1 * 3600)
    assert result.optimum_steps == round(result.optimum_seconds / 5)
    assert len(result.curve) == 61 and result.curve[30].interval_seconds == result.optimum_seconds
    assert min(p.waste_fraction for p in result.curve) == result.optimum_waste_fraction


def test_checkpoint_far_outside_dalys_range_still_answers() -> None:
    """A write or restart thousands of times the MTBF overflows Daly's exponentials: the answer says
    all the time is wasted rather than failing."""
    result = lab_checkpoint(LabCheckpointRequest.model_validate(
        {"mtbfHours": 0.001, "writeSeconds": 1e9, "restartSeconds": 1e9}))
    assert all(p.daly_waste_fraction == 1.0 for p in result.curve)
    assert result.daly_optimum_seconds == pytest.approx(3.6)


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "gpt-1b@v1", "sharding": "zero9"}, "sharding"),
    ({"model": "gpt-1b@v1", "devices": 0}, "devices"),
    ({"model": "gpt-1b@v1", "recompute": "sometimes"}, "recompute"),
])
def test_bad_memory_input_names_the_field(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LabMemoryRequest.model_validate(body)
    assert info.value.errors()[0]["loc"][0] == field


def test_unknown_model_and_device_are_spec_errors() -> None:
    with pytest.raises(SpecError) as info:
        lab_memory(LabMemoryRequest.model_validate({"model": "nope@v1"}))
    assert info.value.field == "model"
    with pytest.raises(SpecError) as info:
        lab_memory(LabMemoryRequest.model_validate({"model": "gpt-1b@v1", "device": "tpu-v9"}))
    assert info.value.field == "device"
    assert device_spec("h100").memory_bytes == 80e9


def test_scaling_opened_from_a_job_passes_through_its_measured_step() -> None:
    body = {"model": "gpt-1b@v1", "nodes": [1, 2, 4], "devicesPerNode": 8, "globalBatch": 64,
            "measured": {"nodes": 2, "stepSeconds": 0.9}}
    result = lab_scaling(LabScalingRequest.model_validate(body))
    assert result.points[1].step_seconds == pytest.approx(0.9)
    assert result.wire()["fitted"].startswith("efficiency ")
