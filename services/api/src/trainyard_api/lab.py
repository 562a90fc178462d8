"""The Lab's API: ``POST /v1/lab/memory``, ``POST /v1/lab/scaling``, ``POST /v1/lab/checkpoint``.

Each is a thin shell over a sweep of :mod:`trainyard_planner.lab`, itself the planner's own
formulas (the ones ``trainyard plan`` and ``POST /v1/plan`` use): a request names a model the way
``POST /v1/plan`` does (catalog reference, inline model, or ``{parameters: N}``) and a device type,
and gets back the numbers and curves the dashboard's Lab draws. Pure functions here
(:func:`lab_memory`, :func:`lab_scaling`, :func:`lab_checkpoint`), routes installed by
:func:`install_lab_routes`; nothing is stored. A request the planner cannot answer is a 422 naming
its field, as ``POST /v1/plan``'s are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import SpecError
from trainyard_planner import (
    DEFAULT_HEADROOM,
    BytesPerParameter,
    CheckpointLab,
    DeviceSpec,
    MemoryLab,
    Recompute,
    ScalingLab,
    Sharding,
    Transformer,
    checkpoint_lab,
    memory_lab,
    node_counts,
    scaling_lab,
)
from trainyard_planner.lab import DEFAULT_MARGINAL_THRESHOLD, MAX_PARAMETERS, MIN_PARAMETERS

from trainyard_api.bodies import (
    MAX_BATCH,
    MAX_DEVICES,
    BoundedModelConfig,
    CatalogRef,
    PlanBytesPerParameter,
    PlanDevice,
)
from trainyard_api.planning import (
    PRECISIONS,
    Assumptions,
    ModelSummary,
    ParameterCount,
    _In,
    _in,
    resolve_device,
    resolve_transformer,
    summarize,
)

_GB = 1e9
MAX_NODES = 8192
_MAX_SECONDS = 1e9  # ~32 years

LabModel = CatalogRef | BoundedModelConfig | ParameterCount
_MODEL = Field(description="catalog reference name@version, an inline model (as in a spec), or {parameters: N}")
_SEQUENCE = Field(default=None, gt=0, le=1_048_576, description="default: the model's maxSeqLen / seqLen")
_DEVICE = Field(default="h100-80gb", description="a known device type, cpu, or an inline spec (as in POST /v1/plan)")
_PRECISION = Field(default="mixed", description='"mixed" (bf16 + fp32 Adam, 16 B), "fp32" (16 B), or bytes per kind')
DeviceField = Annotated[str, Field(min_length=1, max_length=64)] | PlanDevice


class _LabModelRequest(_In):
    """What every memory/scaling request names: the model, its sequence length, the device, the precision."""

    model: LabModel = _MODEL
    sequence_length: int | None = _SEQUENCE
    device: DeviceField = _DEVICE
    precision: Literal["mixed", "fp32"] | PlanBytesPerParameter = _PRECISION  # type: ignore[assignment]  # a Field
    headroom: float = Field(default=DEFAULT_HEADROOM, ge=0, lt=1,
                            description="share of the device's memory kept free (workspace, buffers, fragmentation)")

    def bytes_per_parameter(self) -> BytesPerParameter:
        return self.precision if isinstance(self.precision, BytesPerParameter) else PRECISIONS[self.precision]


class LabMemoryRequest(_LabModelRequest):
    """Experiment 1: model size against memory per device."""

    devices: int = Field(default=8, gt=0, le=MAX_DEVICES, description="data-parallel ranks the sharding divides by")
    sharding: Sharding = Field(default=Sharding.DDP, description="ddp, zero1 (optimizer), zero2 (+ gradients), "
                                                                 "fsdp (everything)")
    micro_batch: int = Field(default=1, gt=0, le=4096, description="sequences per micro-batch per rank")
    recompute: Recompute = Field(default=Recompute.NONE, description="activation recomputation")
    curve_from: float | None = Field(default=None, ge=MIN_PARAMETERS, le=MAX_PARAMETERS / 10,
                                     description="smallest parameter count on the curve; default the model's / 1000")
    curve_to: float | None = Field(default=None, ge=MIN_PARAMETERS * 10, le=MAX_PARAMETERS,
                                   description="largest parameter count on the curve; default the model's x 1000")


class MeasuredStep(_In):
    """A step time measured on some number of these nodes, e.g. a job's rankTiming."""

    nodes: int = Field(gt=0, le=MAX_NODES, description="nodes the step was measured on")
    step_seconds: float = Field(ge=1e-6, le=_MAX_SECONDS, description="seconds per optimizer step")


class LabScalingRequest(_LabModelRequest):
    """Experiment 2: the same global batch over more nodes at an interconnect bandwidth."""

    devices_per_node: int | None = Field(default=None, gt=0, le=64,
                                         description="default: the device's NVLink domain (8)")
    nodes: Annotated[list[Annotated[int, Field(gt=0, le=MAX_NODES)]], Field(min_length=1, max_length=64)] | Annotated[
        int, Field(gt=0, le=MAX_NODES)] = Field(
        default=16, description="node counts to evaluate, or the largest (1, 2, 4, … up to it)")
    interconnect_gbps: float | None = Field(
        default=None, alias="interconnectGBps", ge=0.001, le=1e6,
        description="GB/s per device across nodes, one direction (default: the device's NIC, 50 for H100)")
    intra_node_gbps: float | None = Field(
        default=None, alias="intraNodeGBps", ge=0.001, le=1e6,
        description="GB/s per device inside a node, one direction (default: the device's NVLink, 450 for H100)")
    nodes_per_rack: int = Field(default=4, gt=0, le=MAX_NODES)
    global_batch: int = Field(default=512, gt=0, le=MAX_BATCH, description="sequences per step, kept while every "
                                                                           "rank still gets a micro-batch")
    micro_batch: int = Field(default=1, gt=0, le=4096)
    tensor: int = Field(default=1, gt=0, le=64, description="tensor-parallel degree inside a node")
    sharding: Sharding = Sharding.DDP
    recompute: Recompute = Recompute.NONE
    efficiency: float | None = Field(default=None, ge=1e-4, le=1, description="the matmuls' share of peak (default: "
                                                                             "by their shape and the device)")
    dp_overlap: float | None = Field(default=None, ge=0, le=1, description="share of DP communication hidden by "
                                                                           "backward (default: as DDP and FSDP do)")
    marginal_threshold: float = Field(default=DEFAULT_MARGINAL_THRESHOLD, ge=0.01, le=0.99,
                                      description="stopsHelpingAt: where added devices add less than this share of "
                                                  "a device's worth")
    measured: MeasuredStep | None = Field(default=None, description="a job's measured step (\"Open in the Lab\"): "
                                                                    "fits the compute efficiency to it first")


class LabCheckpointRequest(_In):
    """Experiment 3: the checkpoint interval, redo against overhead."""

    mtbf_hours: float = Field(ge=0.001, le=1e8, examples=[3.1], description="the whole job's mean time between "
                                                                             "failures")
    write_seconds: float = Field(ge=0.001, le=_MAX_SECONDS, examples=[60], description="the stall of one "
                                                                                        "checkpoint write")
    restart_seconds: float = Field(default=0.0, ge=0, le=_MAX_SECONDS, description="time to restart after a "
                                                                                   "failure")
    step_seconds: float | None = Field(default=None, ge=0.001, le=_MAX_SECONDS,
                                       description="say the intervals in steps too")
    points: int = Field(default=61, ge=3, le=401, description="points on the curve (odd: the optimum in the middle)")
    span: float = Field(default=20.0, ge=1.5, le=1000, description="the curve runs from optimum / span to "
                                                                   "optimum x span")


class LabMemoryResponse(MemoryLab):
    model: ModelSummary
    device: DeviceSpec


class LabScalingResponse(ScalingLab):
    model: ModelSummary
    device: DeviceSpec
    devices_per_node: int


class LabCheckpointResponse(CheckpointLab):
    pass


LAB_EXAMPLES: dict[str, dict[str, Any]] = {
    "memory": {"memory": {"summary": "a 7B model data-parallel over 8 H100s with FSDP",
                          "value": {"model": {"parameters": 7e9}, "devices": 8, "sharding": "fsdp",
                                    "device": "h100-80gb"}}},
    "scaling": {"scaling": {"summary": "gpt-1b over 1 to 32 nodes of 8 H100s at 5 GB/s across nodes",
                            "value": {"model": "gpt-1b@v1", "nodes": 32, "devicesPerNode": 8,
                                      "interconnectGBps": 5, "globalBatch": 512}}},
    "checkpoint": {"checkpoint": {"summary": "Llama 3's ~3.1 h job MTBF and a 60 s write",
                                  "value": {"mtbfHours": 3.1, "writeSeconds": 60, "restartSeconds": 600,
                                            "stepSeconds": 5}}},
}


# ----------------------------------------------------------------------------- the three, pure


def _model_and_device(request: _LabModelRequest, catalog: Mapping[str, ModelConfig],
                      assumptions: Assumptions | None, devices: int) -> tuple[Transformer, str, DeviceSpec]:
    model, source = resolve_transformer(request, catalog)  # type: ignore[arg-type]  # model + sequenceLength
    return model, source, resolve_device(request.device, assumptions, devices)


def lab_memory(request: LabMemoryRequest, catalog: Mapping[str, ModelConfig] = MODEL_CATALOG, *,
               assumptions: Assumptions | None = None) -> LabMemoryResponse:
    """Memory per device under the request's sharding, and every sharding's curve over parameter counts."""
    if request.curve_from is not None and request.curve_to is not None and request.curve_to <= request.curve_from:
        raise SpecError("curveTo", f"curveTo ({request.curve_to:g}) must be above curveFrom ({request.curve_from:g})")
    model, source, device = _model_and_device(request, catalog, assumptions, request.devices)
    low, high = curve_range(model.parameters, request.curve_from, request.curve_to)
    result = _in("model", lambda: memory_lab(
        model, device, devices=request.devices, sharding=request.sharding, micro_batch=request.micro_batch,
        recompute=request.recompute, bytes_per_parameter=request.bytes_per_parameter(), headroom=request.headroom,
        curve_from=low, curve_to=high))
    return LabMemoryResponse(**dict(result), model=summarize(model, source), device=device)


def curve_range(parameters: float, curve_from: float | None, curve_to: float | None) -> tuple[float, float]:
    """Three decades either side of the model (kept inside 1e6..1e15), or from / to the given ends."""
    centre = min(max(float(parameters), 1e9), 1e12)
    if curve_from is not None and curve_to is not None:
        return curve_from, curve_to
    if curve_from is not None:
        return curve_from, min(MAX_PARAMETERS, max(centre * 1000, curve_from * 1000))
    if curve_to is not None:
        return max(MIN_PARAMETERS, min(centre / 1000, curve_to / 1000)), curve_to
    return centre / 1000, centre * 1000


def lab_scaling(request: LabScalingRequest, catalog: Mapping[str, ModelConfig] = MODEL_CATALOG, *,
                assumptions: Assumptions | None = None) -> LabScalingResponse:
    """Step time, communication and tokens/s over node counts, and where more devices stop helping."""
    nodes = node_counts(request.nodes) if isinstance(request.nodes, int) else sorted(set(request.nodes))
    model, source, device = _model_and_device(request, catalog, assumptions, request.devices_per_node or 8)
    per_node = request.devices_per_node or device.nvlink_domain
    _check_tensor(request.tensor, per_node, model)
    result = _in("model", lambda: scaling_lab(
        model, device, nodes=nodes, devices_per_node=per_node, global_batch=request.global_batch,
        interconnect_bandwidth=_bandwidth(request.interconnect_gbps),
        intra_node_bandwidth=_bandwidth(request.intra_node_gbps), nodes_per_rack=request.nodes_per_rack,
        micro_batch=request.micro_batch, tensor=request.tensor, sharding=request.sharding,
        recompute=request.recompute, efficiency=request.efficiency, dp_overlap=request.dp_overlap,
        bytes_per_parameter=request.bytes_per_parameter(), headroom=request.headroom,
        marginal_threshold=request.marginal_threshold,
        measured_nodes=request.measured.nodes if request.measured else None,
        measured_step_seconds=request.measured.step_seconds if request.measured else None))
    return LabScalingResponse(**dict(result), model=summarize(model, source), device=device,
                              devices_per_node=per_node)


def lab_checkpoint(request: LabCheckpointRequest) -> LabCheckpointResponse:
    """Redo, overhead and waste over the checkpoint interval, with Young's and Daly's optima."""
    result = _in("mtbfHours", lambda: checkpoint_lab(
        mtbf_seconds=request.mtbf_hours * 3600, write_seconds=request.write_seconds,
        restart_seconds=request.restart_seconds, step_seconds=request.step_seconds, points=request.points,
        span=request.span))
    return LabCheckpointResponse(**dict(result))


def _bandwidth(gbps: float | None) -> float | None:
    return gbps * _GB if gbps is not None else None


def _check_tensor(tensor: int, per_node: int, model: Transformer) -> None:
    """Whole heads per tensor-parallel rank inside one node, as the trainer (and recommend) require."""
    if per_node % tensor:
        raise SpecError("tensor", f"tensor ({tensor}) must divide devicesPerNode ({per_node})")
    for what, count in (("attention heads", model.n_heads), ("key/value heads", model.kv_heads),
                        ("the FFN width", model.ffn_width)):
        if count % tensor:
            raise SpecError("tensor", f"tensor ({tensor}) must divide {what} ({count})")


# ----------------------------------------------------------------------------- routes


def install_lab_routes(app: FastAPI, *, read: Any, strict_body: Callable[[type], Any],
                       responses: dict[int | str, dict[str, Any]],
                       assumptions: Callable[[Request], Assumptions]) -> None:
    """The three routes, for any token with the read right (viewer or above): ``read`` is that
    dependency, ``strict_body`` app.py's JSON-body check, ``responses`` the documented errors."""

    def route(path: str, model: type[_In], response: type, summary: str) -> Callable[[Callable], Callable]:
        return app.post(path, response_model=response, tags=["lab"], summary=summary, responses=responses,
                        dependencies=[read, strict_body(model)])

    @route("/v1/lab/memory", LabMemoryRequest, LabMemoryResponse, "The Lab: model size against memory per device")
    async def lab_memory_route(
        http: Request, body: Annotated[LabMemoryRequest, Body(openapi_examples=LAB_EXAMPLES["memory"])],
    ) -> LabMemoryResponse:
        """Memory per device (weights, gradients, optimizer state, activations, headroom, against the
        device's capacity) under the request's sharding; the curve of memory used per device against
        parameter count for ddp / zero1 / zero2 / fsdp; the largest model each fits, and
        `shardingNeededAbove`, the parameter count above which plain DDP no longer fits. The planner's
        own arithmetic (`trainyard plan memory`). Nothing is stored."""
        return await run_in_threadpool(lab_memory, body, assumptions=assumptions(http))

    @route("/v1/lab/scaling", LabScalingRequest, LabScalingResponse,
           "The Lab: devices across nodes against an interconnect bandwidth")
    async def lab_scaling_route(
        http: Request, body: Annotated[LabScalingRequest, Body(openapi_examples=LAB_EXAMPLES["scaling"])],
    ) -> LabScalingResponse:
        """For each node count: step time, compute and exposed communication, their ratio, tokens/s,
        MFU, scaling efficiency and marginal efficiency; `stopsHelpingAt` is the device count after
        which the next devices add less than `marginalThreshold` of a device's worth (`rule` says it
        in words). The planner's step estimate (`trainyard plan comm`). Nothing is stored."""
        return await run_in_threadpool(lab_scaling, body, assumptions=assumptions(http))

    @route("/v1/lab/checkpoint", LabCheckpointRequest, LabCheckpointResponse,
           "The Lab: the checkpoint interval, expected redo against overhead")
    async def lab_checkpoint_route(
        body: Annotated[LabCheckpointRequest, Body(openapi_examples=LAB_EXAMPLES["checkpoint"])],
    ) -> LabCheckpointResponse:
        """Over intervals from optimum / span to optimum x span: the expected redo (interval / 2 MTBF),
        the checkpoint overhead (write / interval), restarts, their sum (Young's first order) and
        Daly's exact waste; `optimumSeconds` is Young's sqrt(2 write MTBF), the minimum of the
        waste curve, `dalyOptimumSeconds` Daly's. The planner's checkpoint module
        (`trainyard plan checkpoint`). Nothing is stored."""
        return await run_in_threadpool(lab_checkpoint, body)
