"""Capacity planning over HTTP (``POST /v1/plan``) and the memory check at submission.

Both are thin, pure translations around :mod:`trainyard_planner`: a request (or a TrainingSpec)
becomes a Transformer, a Layout, a DeviceSpec and a Topology; the planner's answer goes back in
camelCase. A ValueError, KeyError or ArithmeticError the planner raises becomes a 422 naming the
request field.

What the submission check assumes. The spec has no ZeRO or recomputation field, so it uses what
the trainer runs by default (sharding and activation checkpointing are rank settings,
``TRAINYARD_SHARDING`` / ``TRAINYARD_ACTIVATION_CHECKPOINTING``, which the API cannot see):
:func:`trainyard_planner.spec_layout` with ``LayoutAssumption.TRAINER_DEFAULTS`` (the scheduler's
memory floor maps the same spec with ``MOST_FRUGAL``):

- DDP over ``parallelism.data``: ZeRO stage 0, every rank holds all model states (with
  ``parallelism.tensor > 1`` the trainer switches to FSDP, so there the check overestimates);
- fp32 weights and gradients plus AdamW's two fp32 moments, 16 B per parameter (SGD with
  momentum: 12 B). bf16 autocast on GPUs casts activations, not the stored weights;
- no activation checkpointing; attention goes through torch's fused
  ``scaled_dot_product_attention``, which keeps no sequence x sequence score matrix for the
  backward pass: in Korthikanti et al.'s accounting that is the activation memory of *selective*
  recomputation (the ``5as/h`` term vanishes), so the check uses ``Recompute.SELECTIVE``;
- 16-bit activations (bf16 autocast), the planner's default.

A spec whose layout needs more than the device's memory is a 422; one that fits only by eating
into the planner's headroom (15 % for workspace, communication buffers and fragmentation) is
accepted with a warning. ``cpu`` ranks share the host's memory, which the API does not know, so
they are not checked; a device type the planner does not know is accepted with a warning.

Calibration. ``plan`` takes the platform's fitted :class:`~trainyard_planner.Calibration` (see
:mod:`trainyard_telemetry.calibration`); when it holds the request's device type, the answer keeps the
raw estimates and adds ``calibrated``: the step time and checkpoint write time multiplied by the
measured/predicted factors, time to train at the corrected MFU, the checkpoint plan at the
effective write bandwidth (and at the measured MTBF when the request gave none), and which
calibration that was (sample counts, factors, when it was fitted). ``cpu`` is a device type here
too: :class:`Assumptions` describes it from a configured matmul peak, which calibration corrects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import SpecError
from trainyard_contract.spec import TrainingSpec
from trainyard_planner import (
    DEFAULT_EFFICIENCY,
    DEFAULT_HEADROOM,
    FP32_ADAM,
    MIXED_PRECISION_ADAM,
    BytesPerParameter,
    Calibration,
    CheckpointPlan,
    DeviceCalibration,
    DeviceSpec,
    FlopsCount,
    Layout,
    LinkTier,
    MemoryBreakdown,
    Recompute,
    RejectedLayout,
    StepEstimate,
    Topology,
    TrainingTime,
    Transformer,
    attention_flops_per_token,
    checkpoint_bytes,
    device_spec,
    estimate_memory,
    estimate_step,
    hardware_flops_per_token,
    job_mtbf,
    model_flops_per_token,
    plan_checkpoint,
    recommend,
    training_time,
    transformer_for,
)
# the platform's assumptions are the planner's (shared with the telemetry service's calibration)
from trainyard_planner.platform import (
    DEFAULT_DEVICE_MTBF_HOURS,
    DEFAULT_MFU,
    Assumptions,
    device_type_of,
    trainer_bytes_per_parameter,
    trainer_layout,
)

from trainyard_api.bodies import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_DEVICES,
    BoundedModelConfig,
    CatalogRef,
    PlanBytesPerParameter,
    PlanDevice,
    PlanLayout,
)
from trainyard_api.validation import FieldProblem, InvalidSpecError, field_errors

T = TypeVar("T")

PRECISIONS: Mapping[str, BytesPerParameter] = {"mixed": MIXED_PRECISION_ADAM, "fp32": FP32_ADAM}
_GB = 1e9
_MAX_SECONDS = 1e12  # ~31,700 years


# ----------------------------------------------------------------------------- wire models


class _In(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              protected_namespaces=())


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, protected_namespaces=())


class ParameterCount(_In):
    """A model known only by its size; a plausible GPT shape is derived for the activations."""

    parameters: float = Field(ge=1, le=1e15, examples=[70e9])
    seq_len: int = Field(default=2048, gt=0, le=1_048_576)
    vocab_size: int = Field(default=32_000, gt=0, le=1_000_000)


class PlanTopology(_In):
    """The links the devices talk over; each bandwidth defaults to the device's datasheet figure."""

    devices_per_node: int | None = Field(default=None, gt=0, le=MAX_DEVICES,
                                         description="default: the device's NVLink domain")
    nodes_per_rack: int = Field(default=4, gt=0, le=MAX_DEVICES)
    nvlink_bandwidth: float | None = Field(default=None, ge=1, le=MAX_BYTES,
                                           description="bytes/s per device, one direction")
    intra_rack_bandwidth: float | None = Field(default=None, ge=1, le=MAX_BYTES,
                                               description="bytes/s per device (its NIC)")
    cross_rack_bandwidth: float | None = Field(default=None, ge=1, le=MAX_BYTES,
                                               description="bytes/s per device; default: intraRackBandwidth")


class PlanCheckpoint(_In):
    """Checkpoint inputs: the size comes from the model, the rest from here."""

    model_config = ConfigDict(json_schema_extra={  # what _one_mtbf checks, in the schema too
        "not": {"required": ["mtbfSeconds", "deviceMtbfHours"],
                "properties": {"mtbfSeconds": {"type": "number"}, "deviceMtbfHours": {"type": "number"}}}})

    write_bandwidth: float = Field(ge=1, le=MAX_BYTES, description="bytes/s the whole job writes at",
                                   examples=[10e9])
    mtbf_seconds: float | None = Field(default=None, ge=1, le=_MAX_SECONDS, description="the whole job's MTBF")
    device_mtbf_hours: float | None = Field(
        default=None, ge=0.001, le=_MAX_SECONDS / 3600,
        description=f"one device's MTBF (job MTBF = this / devices); default {DEFAULT_DEVICE_MTBF_HOURS:.0f} h "
                    "when mtbfSeconds is absent too")
    keep_last: int = Field(default=3, gt=0, le=1000)
    jobs: int = Field(default=1, gt=0, le=MAX_DEVICES, description="jobs of this size sharing the storage")
    interval_seconds: float | None = Field(default=None, ge=0.001, le=_MAX_SECONDS,
                                           description="evaluate this interval; default Daly's")
    restart_seconds: float = Field(default=0.0, ge=0, le=_MAX_SECONDS)
    size_bytes: float | None = Field(default=None, ge=1, le=MAX_BYTES,
                                     description="override the size derived from the model")

    @model_validator(mode="after")
    def _one_mtbf(self) -> PlanCheckpoint:
        if self.mtbf_seconds is not None and self.device_mtbf_hours is not None:
            raise ValueError("give mtbfSeconds or deviceMtbfHours, not both")
        return self


class PlanRequest(_In):
    """``POST /v1/plan``: the same inputs as ``trainyard plan …``."""

    model: CatalogRef | BoundedModelConfig | ParameterCount = Field(
        description="catalog reference name@version, an inline model (as in a spec), or {parameters: N}")
    sequence_length: int | None = Field(default=None, gt=0, le=1_048_576,
                                        description="default: the model's maxSeqLen / seqLen")
    layout: PlanLayout | Literal["recommend"] | None = Field(
        default=None, description='a layout {dp, tp, pp, zeroStage, microBatch, microbatches, …}, or "recommend"; '
                                  "default: plain data parallelism over every device")
    device: Annotated[str, Field(min_length=1, max_length=64)] | PlanDevice = Field(
        default="h100-80gb", description="a known device type, cpu (a rank of the platform's CPU hosts, at the "
                                         "configured peak), or an inline spec")
    devices: int | None = Field(default=None, gt=0, le=MAX_DEVICES, description="default: the layout's world size")
    topology: PlanTopology = PlanTopology()
    global_batch: int | None = Field(default=None, gt=0, le=MAX_BATCH,
                                     description="sequences per step (needed to recommend)")
    micro_batches: list[Annotated[int, Field(gt=0, le=MAX_BATCH)]] = Field(
        default=[1, 2, 4, 8], min_length=1, max_length=8, description="micro-batch sizes to try")
    precision: Literal["mixed", "fp32"] | PlanBytesPerParameter = Field(
        default="mixed", description='"mixed" (bf16 + fp32 Adam, 16 B), "fp32" (16 B), or bytes per kind')
    headroom: float = Field(default=DEFAULT_HEADROOM, ge=0, lt=1)
    efficiency: float | None = Field(default=None, ge=1e-4, le=1,
                                     description="the matmuls' share of peak (default: by their shape and the "
                                                 "device, the planner's kernel model)")
    dp_overlap: float | None = Field(default=None, ge=0, le=1,
                                     description="share of DP communication hidden by backward (default: as DDP "
                                                 "and FSDP hide it)")
    tokens: float | None = Field(default=None, ge=1, le=1e18, description="training tokens, for time to train")
    mfu: float | None = Field(default=None, ge=1e-4, le=1,
                              description="share of the peak sustained, counting the FLOPs `flops` names; default: "
                                          "the estimated layout's (its MFU, or its hardware utilisation)")
    flops: FlopsCount = Field(
        default=FlopsCount.MODEL,
        description='what peak x mfu counts for time to train: "model" FLOPs (6N + 12LHQT per token, what MFU '
                    'divides) or '
                    '"hardware" FLOPs (the layout\'s recomputation included: full is ~8ND; Megatron-LM\'s '
                    "published TFLOP/s count these)")
    checkpoint: PlanCheckpoint | None = None
    limit: int = Field(default=10, gt=0, le=1000, description="layouts listed per kind when recommending")
    calibrate: bool = Field(default=True, description="add estimates corrected by what the platform measured on "
                                                      "this device type, when it has measured any")


class ModelSummary(_Out):
    source: str = Field(description="catalog reference, 'inline' or 'parameters'")
    parameters: float
    exact_parameters: int = Field(description="the parameter count of the shape used for activations")
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int


class ComputeSummary(_Out):
    model_flops_per_token: float = Field(description="6N + 12 L H Q T (PaLM appendix B)")
    attention_flops_per_token: float
    hardware_flops_per_token: float = Field(description="model FLOPs per token plus what the layout's "
                                                        "recomputation runs again")
    recompute: Recompute = Field(description="the recomputation the hardware FLOPs include (the layout's)")
    tokens_per_step: int | None
    training_flops: float | None = Field(description="model FLOPs (6N + 12 L H Q T per token) x D, with `tokens`")
    hardware_flops: float | None = Field(default=None, description="hardware FLOPs per token x D, with `tokens`")
    flops_counted: FlopsCount = Field(default=FlopsCount.MODEL,
                                      description="which of the two trainingTime divides (the request's `flops`)")
    training_time: TrainingTime | None


class RecommendationView(_Out):
    accepted_count: int
    rejected_count: int
    best: StepEstimate | None
    accepted: list[StepEstimate] = Field(description="fastest first, at most `limit`")
    rejected: list[RejectedLayout] = Field(description="in enumeration order (simplest first), at most `limit`")


class AppliedCalibration(_Out):
    """Which calibration corrected the estimates: the device type's fitted factors and sample counts."""

    device_type: str
    fitted_at: datetime | None = Field(default=None, description="when the platform last fitted it")
    factors: DeviceCalibration = Field(description="measured/predicted factors, MTBF and the samples behind each")


class CalibratedPlan(_Out):
    """The raw estimates next to the same estimates corrected by what the platform measured."""

    calibration: AppliedCalibration
    raw_step_seconds: float | None = Field(default=None, description="the planner's step time (of the best "
                                                                     "layout when recommending)")
    calibrated_step_seconds: float | None = Field(default=None, description="raw x stepTimeFactor")
    calibrated_tokens_per_second: float | None = None
    calibrated_mfu: float | None = None
    effective_efficiency: float | None = Field(
        default=None, description="the share of the device's peak that reproduces the measured step times "
                                  "(above 1: its peak figure is too low)")
    training_time: TrainingTime | None = Field(default=None, description="at the calibrated MFU, with `tokens`")
    raw_checkpoint_write_seconds: float | None = None
    calibrated_checkpoint_write_seconds: float | None = Field(default=None,
                                                              description="raw x checkpointWriteFactor")
    checkpoint: CheckpointPlan | None = Field(
        default=None, description="at the effective write bandwidth, and at the measured MTBF unless the request "
                                  "gave one")
    notes: list[str] = Field(default=[], description="what was corrected, by how much, from how many samples")


def _absent(value: object) -> bool:
    return value is None


class PlanResponse(_Out):
    model: ModelSummary
    device: DeviceSpec
    devices: int
    topology: Topology
    memory: MemoryBreakdown | None = Field(
        default=None, exclude_if=_absent, description="of the layout, or of the best recommended one (absent when "
                                                      "no layout fits)")
    step: StepEstimate | None = Field(default=None, exclude_if=_absent,
                                      description="the given layout's step (absent when recommending)")
    recommendation: RecommendationView | None = Field(default=None, exclude_if=_absent,
                                                      description='present when the layout is "recommend"')
    compute: ComputeSummary
    checkpoint: CheckpointPlan | None = Field(default=None, exclude_if=_absent,
                                              description="present when the request has `checkpoint`")
    calibrated: CalibratedPlan | None = Field(
        default=None, exclude_if=_absent, description="the estimates corrected by the platform's measurements on "
                                                      "this device type; absent when it has none (see GET "
                                                      "/v1/plan/calibration) or `calibrate` is false")


PLAN_EXAMPLES = {
    "memory": {"summary": "the seed's 70B on one device (dp 1, ZeRO 0): 1.12 TB of model states",
               "value": {"model": {"parameters": 70e9}, "layout": {"dp": 1, "zeroStage": 0}}},
    "layout": {"summary": "gpt-1b on 8 H100s with ZeRO-3 and a checkpoint plan",
               "value": {"model": "gpt-1b@v1", "device": "h100-80gb", "devices": 8,
                         "layout": {"dp": 8, "zeroStage": 3, "microBatch": 4, "microbatches": 2},
                         "tokens": 26e9, "checkpoint": {"writeBandwidth": 2e9}}},
    "recommend": {"summary": "rank the layouts of a 70B model on 256 H100s for 1024 sequences per step",
                  "value": {"model": {"parameters": 70e9}, "layout": "recommend", "device": "h100-80gb",
                            "devices": 256, "globalBatch": 1024, "limit": 5}},
}


# ----------------------------------------------------------------------------- errors


@contextmanager
def field_of(name: str) -> Iterator[None]:
    """Planner errors inside the block become a 422 naming ``name`` (or its subfields)."""
    try:
        yield
    except ValidationError as exc:
        problems = [FieldProblem(f"{name}.{p.field}" if p.field != "spec" else name, p.message)
                    for p in field_errors(exc.errors())]
        raise InvalidSpecError(problems) from exc
    except (ValueError, KeyError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        raise SpecError(name, str(message)) from exc
    except ArithmeticError as exc:  # math.exp of restart / MTBF, say: inputs valid alone, absurd together
        raise SpecError(name, f"out of the range of the planner's arithmetic ({exc}): these inputs are too far "
                              "apart, e.g. a restart or a checkpoint write thousands of times the MTBF") from exc


def _in(name: str, build: Callable[[], T]) -> T:
    with field_of(name):
        return build()


# ----------------------------------------------------------------------------- translation


def resolve_transformer(request: PlanRequest, catalog: Mapping[str, ModelConfig]) -> tuple[Transformer, str]:
    ref, seq_len = request.model, request.sequence_length
    if isinstance(ref, ParameterCount):
        return _in("model", lambda: Transformer.from_parameters(
            ref.parameters, seq_len=seq_len or ref.seq_len, vocab_size=ref.vocab_size)), "parameters"
    if isinstance(ref, str):
        config = catalog.get(ref)
        if config is None:
            raise SpecError("model", f"unknown model {ref!r}: the catalog has {', '.join(sorted(catalog))}; "
                                     "or give the model inline, or as {\"parameters\": N}")
        source = ref
    else:
        config, source = ref, "inline"
    if seq_len is not None and seq_len > config.max_seq_len:
        raise SpecError("sequenceLength", f"sequenceLength ({seq_len}) exceeds maxSeqLen ({config.max_seq_len}) "
                                          f"of {source}")
    return _in("model", lambda: transformer_for(config, seq_len)), source


def resolve_device(device: str | DeviceSpec, assumptions: Assumptions | None = None, devices: int = 1) -> DeviceSpec:
    """:func:`trainyard_planner.resolve_device` with the platform's ``cpu``; an unknown type is a 422 on ``device``."""
    try:
        return (assumptions or Assumptions()).device(device, devices=devices)
    except KeyError as exc:
        raise SpecError("device", f"{exc.args[0]}, cpu; or give the device inline: "
                                  "{name, peakFlops, memoryBytes, nvlinkBandwidth, networkBandwidth}") from None


def resolve_topology(topology: PlanTopology, device: DeviceSpec) -> Topology:
    base = _in("topology", lambda: Topology.for_device(
        device, devices_per_node=topology.devices_per_node, nodes_per_rack=topology.nodes_per_rack,
        cross_rack_bandwidth=topology.cross_rack_bandwidth or topology.intra_rack_bandwidth))
    overrides = {
        name: LinkTier(bandwidth=bandwidth, latency=getattr(base, name).latency)
        for name, bandwidth in (("nvlink", topology.nvlink_bandwidth), ("intra_rack", topology.intra_rack_bandwidth))
        if bandwidth is not None
    }
    return base.model_copy(update=overrides)


def summarize(model: Transformer, source: str) -> ModelSummary:
    return ModelSummary(
        source=source, parameters=model.parameters, exact_parameters=model.exact_parameters,
        n_layers=model.n_layers, d_model=model.d_model, n_heads=model.n_heads, d_ff=model.ffn_width,
        vocab_size=model.vocab_size, seq_len=model.seq_len,
    )


# ----------------------------------------------------------------------------- POST /v1/plan


def plan(
    request: PlanRequest,
    catalog: Mapping[str, ModelConfig] = MODEL_CATALOG,
    *,
    assumptions: Assumptions | None = None,
    calibration: Calibration | None = None,
    fitted_at: datetime | None = None,
) -> PlanResponse:
    """Everything the planner says about a request: memory, step, or ranked layouts; compute;
    checkpoint; and, with the platform's ``calibration`` for the device type, the same corrected.
    Pure; raises SpecError / InvalidSpecError naming the request field."""
    # 1. model, device, precision, topology
    model, source = resolve_transformer(request, catalog)
    device = resolve_device(request.device, assumptions, _world_size(request))
    bpp = request.precision if isinstance(request.precision, BytesPerParameter) else PRECISIONS[request.precision]
    topology = resolve_topology(request.topology, device)
    common = {"efficiency": request.efficiency, "dp_overlap": request.dp_overlap,
              "bytes_per_parameter": bpp, "headroom": request.headroom}

    # 2. one layout's step, or every layout ranked
    step: StepEstimate | None = None
    view: RecommendationView | None = None
    if request.layout == "recommend":
        view, chosen, devices = _recommend_layout(request, model, device, topology, common)
    else:
        step, devices = _estimate_layout(request, model, device, topology, common)
        chosen = step

    # 3. compute and time to train
    compute = _plan_compute(request, model, device, devices, chosen)

    # 4. checkpoint
    checkpoint = None
    if request.checkpoint is not None:
        checkpoint = _plan_checkpoint(request.checkpoint, model, bpp, devices, chosen)

    # 5. the same, corrected by what the platform measured on this device type
    calibrated = None
    measured = calibration.devices.get(device_type_of(device.name)) if calibration and request.calibrate else None
    if measured is not None:
        calibrated = calibrate_plan(request, measured, fitted_at=fitted_at, model=model, bpp=bpp, device=device,
                                    devices=devices, chosen=chosen, checkpoint=checkpoint)

    return PlanResponse(
        model=summarize(model, source), device=device, devices=devices, topology=topology,
        memory=chosen.memory if chosen else None, step=step, recommendation=view, compute=compute,
        checkpoint=checkpoint, calibrated=calibrated,
    )


def _recommend_layout(request: PlanRequest, model: Transformer, device: DeviceSpec, topology: Topology,
                      common: dict[str, Any]) -> tuple[RecommendationView, StepEstimate | None, int]:
    """Every layout of ``request.devices`` ranked: the view (first ``limit`` of each), the best, the devices."""
    devices, global_batch = request.devices or 1, request.global_batch
    if global_batch is None:
        raise SpecError("globalBatch", "required to recommend a layout (sequences per step)")
    found = _in("layout", lambda: recommend(
        model, device, devices, global_batch, topology=topology, micro_batches=request.micro_batches, **common))
    view = RecommendationView(
        accepted_count=len(found.accepted), rejected_count=len(found.rejected), best=found.best,
        accepted=found.accepted[: request.limit], rejected=found.rejected[: request.limit],
    )
    return view, found.best, devices


def _estimate_layout(request: PlanRequest, model: Transformer, device: DeviceSpec, topology: Topology,
                     common: dict[str, Any]) -> tuple[StepEstimate, int]:
    """The step of the request's layout (plain data parallelism over ``devices`` when none), and its devices."""
    layout: Layout = request.layout or Layout(dp=request.devices or 1)  # type: ignore[assignment]  # not "recommend": the caller
    devices = _check_layout(layout, request)
    return _in("layout", lambda: estimate_step(model, layout, device, topology, **common)), devices


def _plan_compute(request: PlanRequest, model: Transformer, device: DeviceSpec, devices: int,
                  chosen: StepEstimate | None) -> ComputeSummary:
    """FLOPs per token and, given ``request.tokens``, the training's FLOPs and time, dividing model or hardware
    FLOPs by a rate that counts the same."""
    tokens_per_step = chosen.tokens_per_step if chosen else None
    recompute = chosen.layout.recompute if chosen else Recompute.NONE
    per_token, hardware_per_token = model_flops_per_token(model), hardware_flops_per_token(model, recompute)
    time_to_train = None
    total_flops = hardware_flops = None
    if request.tokens is not None:
        total_flops = per_token * request.tokens
        hardware_flops = hardware_per_token * request.tokens
        hardware = request.flops is FlopsCount.HARDWARE
        estimated = chosen.mfu * (hardware_per_token / per_token if hardware else 1.0) if chosen else DEFAULT_MFU
        mfu = request.mfu or estimated
        time_to_train = _in("mfu", lambda: training_time(
            hardware_flops if hardware else total_flops, devices=devices, peak_flops_per_device=device.peak_flops,
            mfu=min(1.0, mfu), counts=request.flops))
    return ComputeSummary(
        model_flops_per_token=per_token, attention_flops_per_token=attention_flops_per_token(model),
        hardware_flops_per_token=hardware_per_token, recompute=recompute,
        tokens_per_step=tokens_per_step, training_flops=total_flops, hardware_flops=hardware_flops,
        flops_counted=request.flops, training_time=time_to_train,
    )


def _world_size(request: PlanRequest) -> int:
    if request.devices:
        return request.devices
    return request.layout.world_size if isinstance(request.layout, Layout) else 1


def calibrate_plan(
    request: PlanRequest,
    measured: DeviceCalibration,
    *,
    fitted_at: datetime | None,
    model: Transformer,
    bpp: BytesPerParameter,
    device: DeviceSpec,
    devices: int,
    chosen: StepEstimate | None,
    checkpoint: CheckpointPlan | None,
) -> CalibratedPlan:
    """The plan's estimates multiplied by the device type's measured/predicted factors."""
    notes: list[str] = []
    fields: dict[str, Any] = {}
    # step time, and time to train at the MFU it implies
    if chosen is not None:
        factor = measured.step_time_factor
        used = request.efficiency or (chosen.stage.matmul_efficiency if chosen.stage else DEFAULT_EFFICIENCY)
        fields.update(
            raw_step_seconds=chosen.step_seconds, calibrated_step_seconds=chosen.step_seconds * factor,
            calibrated_tokens_per_second=chosen.tokens_per_second / factor, calibrated_mfu=chosen.mfu / factor,
            effective_efficiency=used / factor,
        )
        notes.append(_factor_note("step time", factor, measured.step_time_samples, measured.device_type))
        if used / factor > 1:
            notes.append(f"the measured steps imply {used / factor:.2f} x the peak assumed for "
                         f"{device.name}: that figure is too low (for cpu: TRAINYARD_CPU_PEAK_FLOPS)")
        if request.tokens is not None and request.mfu is None:
            flops = model_flops_per_token(model) * request.tokens
            raw = _in("mfu", lambda: training_time(
                flops, devices=devices, peak_flops_per_device=device.peak_flops, mfu=min(1.0, chosen.mfu)))
            fields["training_time"] = raw.model_copy(update={
                "mfu": raw.mfu / factor, "seconds": raw.seconds * factor, "days": raw.days * factor})
        elif request.tokens is not None:
            notes.append("time to train: the request's mfu is kept (calibration corrects the planner's estimate, "
                         "not a given figure)")
    # checkpoint write time at the effective bandwidth, the interval at the measured MTBF
    inputs = request.checkpoint
    if inputs is not None and checkpoint is not None:
        factor = measured.checkpoint_write_factor
        fields.update(raw_checkpoint_write_seconds=checkpoint.write_seconds,
                      calibrated_checkpoint_write_seconds=checkpoint.write_seconds * factor)
        notes.append(_factor_note("checkpoint write", factor, measured.checkpoint_write_samples,
                                  measured.device_type))
        update: dict[str, Any] = {"write_bandwidth": measured.effective_bandwidth(inputs.write_bandwidth)}
        if inputs.mtbf_seconds is None and inputs.device_mtbf_hours is None and measured.mtbf_seconds is not None:
            update["device_mtbf_hours"] = measured.mtbf_seconds / 3600
            notes.append(f"MTBF: measured {measured.mtbf_seconds / 3600:.3g} device-hours between failures over "
                         f"{measured.failure_samples} failed attempts, "
                         f"{job_mtbf(measured.mtbf_seconds, devices) / 3600:.3g} h for {devices} devices")
        elif measured.mtbf_seconds is not None:
            notes.append("MTBF: the request's is kept")
        calibrated_step = _step_copy(chosen, fields.get("calibrated_step_seconds"))
        fields["checkpoint"] = _plan_checkpoint(inputs.model_copy(update=update), model, bpp, devices,
                                                calibrated_step)
    applied = AppliedCalibration(device_type=measured.device_type, fitted_at=fitted_at, factors=measured)
    return CalibratedPlan(calibration=applied, notes=notes, **fields)


def _step_copy(step: StepEstimate | None, seconds: float | None) -> StepEstimate | None:
    if step is None or seconds is None:
        return step
    return step.model_copy(update={"step_seconds": seconds})


def _factor_note(what: str, factor: float, samples: int, device_type: str) -> str:
    if samples == 0:
        return f"{what}: not measured on {device_type} yet, left as predicted"
    return f"{what} x {factor:.3g} (measured / predicted, {samples} samples on {device_type})"


def _check_layout(layout: Layout, request: PlanRequest) -> int:
    devices = request.devices or layout.world_size
    if layout.world_size != devices:
        raise SpecError("layout", f"dp x tp x pp = {layout.dp} x {layout.tp} x {layout.pp} = {layout.world_size} "
                                  f"must equal devices ({devices})")
    if request.global_batch is not None and request.global_batch != layout.global_batch:
        raise SpecError("globalBatch", f"globalBatch ({request.global_batch}) differs from the layout's "
                                       f"microBatch x dp x microbatches = {layout.micro_batch} x {layout.dp} x "
                                       f"{layout.microbatches} = {layout.global_batch}")
    return devices


def _plan_checkpoint(inputs: PlanCheckpoint, model: Transformer, bpp: BytesPerParameter, devices: int,
                     chosen: StepEstimate | None) -> CheckpointPlan:
    size = inputs.size_bytes or checkpoint_bytes(model.parameters, bpp)
    mtbf = inputs.mtbf_seconds or job_mtbf((inputs.device_mtbf_hours or DEFAULT_DEVICE_MTBF_HOURS) * 3600, devices)
    return _in("checkpoint", lambda: plan_checkpoint(
        size, write_bandwidth=inputs.write_bandwidth, mtbf_seconds=mtbf, keep_last=inputs.keep_last,
        jobs=inputs.jobs, interval_seconds=inputs.interval_seconds, restart_seconds=inputs.restart_seconds,
        step_seconds=chosen.step_seconds if chosen else None))


# ----------------------------------------------------------------------------- submission check


@dataclass(frozen=True)
class MemoryCheck:
    """What the planner says about a spec: problems (422) or warnings (202), and the estimate."""

    problems: list[FieldProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    memory: MemoryBreakdown | None = None


def check_spec_memory(spec: TrainingSpec, config: ModelConfig, *, headroom: float = DEFAULT_HEADROOM) -> MemoryCheck:
    """Reject a spec that cannot fit its device type's memory; warn when it eats the headroom."""
    gpu_type = spec.resources.gpu_type
    if gpu_type.strip().lower() == "cpu":
        return MemoryCheck()
    try:
        device = device_spec(gpu_type)
    except KeyError as exc:
        return MemoryCheck(warnings=[f"memory not checked: {exc.args[0]}"])
    with field_of("modelConfig"):
        model = transformer_for(config, spec.training.sequence_length)
        memory = estimate_memory(model, trainer_layout(spec), bytes_per_parameter=trainer_bytes_per_parameter(spec),
                                 headroom=headroom)
    available = device.memory_bytes
    label = spec.model_config_ref if isinstance(spec.model_config_ref, str) else "the inline model"
    if memory.used_bytes_per_device > available:
        needs = _gb(memory.used_bytes_per_device)
        return MemoryCheck(memory=memory, problems=[
            FieldProblem("modelConfig", f"{label} does not fit one {device.name}: needs {needs} GB per device, "
                                        f"{_gb(available)} GB available ({_parts(memory, spec)})"),
            FieldProblem("resources.gpuType", f"{device.name} has {_gb(available)} GB per device and this job needs "
                                              f"{needs} GB: choose a device type with more memory, a smaller model "
                                              "or a smaller training.microBatchSize"),
        ])
    if not memory.fits(available):
        return MemoryCheck(memory=memory, warnings=[
            f"{label} needs {_gb(memory.used_bytes_per_device)} GB of the {_gb(available)} GB of one {device.name}, "
            f"leaving less than the {headroom:.0%} headroom the planner keeps for workspace and fragmentation: "
            f"it may run out of memory ({_parts(memory, spec)})"
        ])
    return MemoryCheck(memory=memory)


def _parts(memory: MemoryBreakdown, spec: TrainingSpec) -> str:
    t = spec.training
    per_parameter = memory.model_states_bytes_per_device / memory.parameters_per_device
    return (f"model states {_gb(memory.model_states_bytes_per_device)} GB: "
            f"{memory.parameters_per_device / 1e9:.2f}B parameters x {per_parameter:.0f} B (fp32, "
            f"{t.optimizer.name}) on every rank, as the trainer's DDP (ZeRO 0) keeps them; activations "
            f"{_gb(memory.activations_bytes_per_device)} GB at microBatchSize {t.micro_batch_size} x "
            f"sequenceLength {t.sequence_length}")


def _gb(n_bytes: float) -> str:
    value = round(n_bytes / _GB, 1)
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"
