"""One training step under a layout: memory, compute, bubble, communication, time and MFU.

    step = compute x (1 + bubble ratio) + TP + PP communication + (1 - overlap) x DP communication
    compute = hardware FLOPs of the step / (devices x peak x efficiency)

``efficiency`` is the share of peak the matmuls reach while they run (default 0.5); it is the
number calibration corrects per device type (see :mod:`trainyard_planner.calibrate`). MFU falls out
of the estimate: model FLOPs per token x tokens/s / (devices x peak).
"""

from __future__ import annotations

from trainyard_planner._private import Model
from trainyard_planner.bubble import layout_bubble_ratio
from trainyard_planner.comm import (
    Bottleneck, CommEstimate, Topology, bottleneck, comm_to_compute_ratio, estimate_comm,
)
from trainyard_planner.compute import DeviceSpec, hardware_flops_per_token, model_flops_per_token
from trainyard_planner.layout import Layout
from trainyard_planner.memory import (
    DEFAULT_HEADROOM, MIXED_PRECISION_ADAM, BytesPerParameter, MemoryBreakdown, estimate_memory,
)
from trainyard_planner.model import Transformer

DEFAULT_EFFICIENCY = 0.5


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


def estimate_step(
    model: Transformer,
    layout: Layout,
    device: DeviceSpec,
    topology: Topology,
    *,
    efficiency: float = DEFAULT_EFFICIENCY,
    dp_overlap: float = 0.0,
    bandwidth_factor: float = 1.0,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    headroom: float = DEFAULT_HEADROOM,
) -> StepEstimate:
    """Estimate one optimizer step of ``model`` under ``layout`` on ``device`` x world size."""
    if not 0 < efficiency <= 1 or not 0 <= dp_overlap <= 1:
        raise ValueError("efficiency must be in (0, 1] and dp_overlap in [0, 1]")
    world = layout.world_size
    memory = estimate_memory(model, layout, bytes_per_parameter=bytes_per_parameter, headroom=headroom)
    tokens = layout.global_batch * model.seq_len
    compute = hardware_flops_per_token(model, layout.recompute) * tokens / (world * device.peak_flops * efficiency)
    ratio = layout_bubble_ratio(layout)
    comm = estimate_comm(
        model, layout, topology,
        gradient_bytes=bytes_per_parameter.gradients, weight_bytes=bytes_per_parameter.weights,
        bandwidth_factor=bandwidth_factor,
    )
    exposed = comm.tp_seconds + comm.pp_seconds + (1 - dp_overlap) * comm.dp_seconds
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
    )
