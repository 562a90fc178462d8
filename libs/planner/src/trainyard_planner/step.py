"""One training step under a layout: memory, compute, bubble, communication, time and MFU.

    step = m x T_stage x (1 + bubble ratio) + exposed communication

``T_stage`` is one micro-batch through the slowest pipeline stage (:func:`trainyard_planner.kernels.stage_time`:
its matmuls at the share of peak their shape sustains, the memory-bound kernels at the device's memory
bandwidth, the output layer on the last stage), ``m`` the micro-batches per step and the bubble ratio
``(p-1)/(v m)``. Tensor, context and pipeline traffic is on the critical path; data-parallel traffic is hidden
by the backward pass as far as it can be (:func:`dp_exposed`).

``efficiency`` (optional) fixes the matmuls' share of peak instead of the shape model: what calibration fits
per device type from measured steps (:mod:`trainyard_planner.calibrate`). MFU is model FLOPs (PaLM's ``6N +
12 L H Q T`` per token, :func:`~trainyard_planner.compute.model_flops_per_token`) x tokens/s / (devices x peak),
the one definition the planner uses everywhere; hardware FLOPs (with recomputation) only give
``hardware_flops_per_second``.
"""

from __future__ import annotations

from pydantic import Field

from trainyard_planner._private import Model
from trainyard_planner.bubble import layout_bubble_ratio
from trainyard_planner.comm import (
    Bottleneck, CommEstimate, Topology, bottleneck, comm_to_compute_ratio, estimate_comm,
)
from trainyard_planner.compute import DeviceSpec, hardware_flops_per_token, model_flops_per_token
from trainyard_planner.kernels import KERNELS, KernelModel, StageTime, stage_time
from trainyard_planner.layout import Layout, ZeroStage
from trainyard_planner.memory import (
    DEFAULT_HEADROOM, MIXED_PRECISION_ADAM, BytesPerParameter, MemoryBreakdown, estimate_memory,
)
from trainyard_planner.model import Transformer

DEFAULT_EFFICIENCY = 0.5
"""What a caller that states no share of peak used to get; the shape model (:mod:`.kernels`) replaces it."""


class StepEstimate(Model):
    layout: Layout
    device: str
    memory: MemoryBreakdown
    device_memory_bytes: float
    fits: bool
    tokens_per_step: int
    compute_seconds: float
    bubble_ratio: float
    bubble_seconds: float
    comm: CommEstimate
    exposed_comm_seconds: float
    step_seconds: float
    tokens_per_second: float
    mfu: float
    comm_to_compute_ratio: float
    bottleneck: Bottleneck
    stage: StageTime | None = Field(default=None, description="one micro-batch through the slowest stage")
    hardware_flops_per_second: float = Field(default=0.0, description="per device, recomputation included "
                                                                      "(what Megatron-LM's TFLOP/s count)")


def dp_exposed(layout: Layout, comm: CommEstimate, stage: StageTime, overlap: float | None) -> float:
    """Data-parallel seconds the backward pass does not hide.

    ``overlap`` given: that share of the traffic is hidden. Otherwise as Megatron-LM and FSDP overlap it: ZeRO
    0/1 reduce the gradients in buckets during the last micro-batch's backward (hidden up to that backward's
    length); ZeRO 2 reduce-scatters each micro-batch's gradients during its own backward and all-gathers the
    updated weights once (exposed); ZeRO 3 also all-gathers the weights ahead of each forward and backward, over
    the whole step's compute.
    """
    if overlap is not None:
        return (1 - overlap) * comm.dp_seconds
    m = layout.microbatches
    backward = 2 / 3 * stage.seconds  # of one micro-batch on the slowest stage (the backward is 2 of 3 passes)
    if layout.zero_stage <= ZeroStage.OPTIMIZER:
        return max(0.0, comm.dp_seconds - backward)
    if layout.zero_stage == ZeroStage.GRADIENTS:
        all_gather = comm.dp_seconds / (1 + m) if m else 0.0  # the volume of one reduce-scatter
        reduce_scatters = comm.dp_seconds - all_gather
        return all_gather + max(0.0, reduce_scatters - m * backward)
    return max(0.0, comm.dp_seconds - m * stage.seconds)


def estimate_step(
    model: Transformer,
    layout: Layout,
    device: DeviceSpec,
    topology: Topology,
    *,
    efficiency: float | None = None,
    dp_overlap: float | None = None,
    bandwidth_factor: float = 1.0,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    headroom: float = DEFAULT_HEADROOM,
    kernels: KernelModel = KERNELS,
) -> StepEstimate:
    """Estimate one optimizer step of ``model`` under ``layout`` on ``device`` x world size."""
    if efficiency is not None and not 0 < efficiency <= 1 or dp_overlap is not None and not 0 <= dp_overlap <= 1:
        raise ValueError("efficiency must be in (0, 1] and dp_overlap in [0, 1]")
    layout.check_layers(model.n_layers)
    world = layout.world_size
    memory = estimate_memory(model, layout, bytes_per_parameter=bytes_per_parameter, headroom=headroom)
    tokens = layout.global_batch * model.seq_len
    stage = stage_time(model, layout, device, efficiency=efficiency, kernels=kernels)
    compute = layout.microbatches * stage.seconds
    ratio = layout_bubble_ratio(layout)
    comm = estimate_comm(
        model, layout, topology,
        gradient_bytes=bytes_per_parameter.gradients, weight_bytes=bytes_per_parameter.weights,
        bandwidth_factor=bandwidth_factor, collective_efficiency=kernels.collective_efficiency,
    )
    exposed = comm.tp_seconds + comm.cp_seconds + comm.pp_seconds + dp_exposed(layout, comm, stage, dp_overlap)
    step = compute * (1 + ratio) + exposed
    fits = memory.fits(device.memory_bytes)
    return StepEstimate(
        layout=layout, device=device.name, memory=memory, device_memory_bytes=device.memory_bytes,
        fits=fits, tokens_per_step=tokens, compute_seconds=compute, bubble_ratio=ratio,
        bubble_seconds=compute * ratio, comm=comm, exposed_comm_seconds=exposed, step_seconds=step,
        tokens_per_second=tokens / step,
        mfu=model_flops_per_token(model) * tokens / step / (world * device.peak_flops),
        comm_to_compute_ratio=comm_to_compute_ratio(exposed, compute),
        bottleneck=bottleneck(fits=fits, compute_seconds=compute, comm_seconds=exposed),
        stage=stage,
        hardware_flops_per_second=hardware_flops_per_token(model, layout.recompute) * tokens / step / world,
    )
