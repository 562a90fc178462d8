"""The Lab's three experiments as sweeps over the planner's own formulas (pure, fast).

The dashboard's Lab (and ``POST /v1/lab/…``) changes one input and watches a curve; every number
comes from the functions ``trainyard plan`` and ``POST /v1/plan`` use, nothing is re-derived here:

1. :func:`memory_lab` — memory per device against parameter count for DDP, ZeRO-1, ZeRO-2 and FSDP
   (:func:`~trainyard_planner.memory.estimate_memory`): the 16 bytes per parameter of
   mixed-precision Adam, activations, the headroom kept free, and the parameter count above which
   plain data parallelism no longer fits, i.e. sharding is needed.
2. :func:`scaling_lab` — the same global batch over more nodes at an interconnect bandwidth
   (:func:`~trainyard_planner.step.estimate_step`): step time, compute, exposed communication,
   their ratio, tokens/s, and where adding devices stops helping.
3. :func:`checkpoint_lab` — expected redo against checkpoint overhead over the checkpoint interval
   (:func:`~trainyard_planner.checkpoint.wasted_fraction`), with Young's optimum ``sqrt(2 delta M)``
   at the minimum of the waste curve and Daly's higher-order optimum beside it.

Definitions the answers state too. *Fits*: ``used <= capacity x (1 - headroom)``, the planner's
rule (:meth:`MemoryBreakdown.fits`). *Scaling efficiency* of a point: its tokens/s per device over
the smallest configuration's. *Marginal efficiency* of a point: the tokens/s it adds per device it
adds, over the smallest configuration's tokens/s per device (1 = the added devices work as well as
the first ones). *Stops helping at*: the last device count before the first point whose marginal
efficiency falls below the threshold (default 0.5: the next devices would add less than half of
what a device is worth).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from enum import StrEnum

from pydantic import Field

from trainyard_planner._private import Model
from trainyard_planner.checkpoint import (
    daly_interval, daly_optimal_interval, daly_wasted_fraction, wasted_fraction, young_interval,
)
from trainyard_planner.comm import Bottleneck, Topology
from trainyard_planner.compute import DeviceSpec
from trainyard_planner.layout import Layout, Recompute, ZeroStage
from trainyard_planner.memory import (
    DEFAULT_HEADROOM, MIXED_PRECISION_ADAM, BytesPerParameter, MemoryBreakdown, activations_bytes_per_device,
    estimate_memory, model_states_per_device,
)
from trainyard_planner.model import Transformer
from trainyard_planner.step import StepEstimate, estimate_step

MIN_PARAMETERS = 1e6
MAX_PARAMETERS = 1e15
DEFAULT_MARGINAL_THRESHOLD = 0.5
_CURVE_DECADES_PER_POINT = 0.1  # ten points per decade of parameters


class Sharding(StrEnum):
    """What the data-parallel ranks shard: DDP none, ZeRO-1 optimizer state, ZeRO-2 + gradients,
    FSDP (ZeRO-3) everything."""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    FSDP = "fsdp"

    @property
    def zero_stage(self) -> ZeroStage:
        return {Sharding.DDP: ZeroStage.NONE, Sharding.ZERO1: ZeroStage.OPTIMIZER,
                Sharding.ZERO2: ZeroStage.GRADIENTS, Sharding.FSDP: ZeroStage.PARAMETERS}[self]


# ----------------------------------------------------------------------------- 1. memory


class PerDevice(Model):
    """One device's memory under the chosen sharding (bytes)."""

    parameters_bytes: float = Field(description="working weights (bf16: 2 B per parameter, sharded by FSDP)")
    gradients_bytes: float = Field(description="gradients (2 B per parameter; sharded by ZeRO-2 and FSDP)")
    optimizer_bytes: float = Field(description="fp32 master weights and Adam m, v (12 B; sharded from ZeRO-1)")
    activations_bytes: float = Field(description="activations kept for the backward pass (Korthikanti et al.)")
    total_bytes: float = Field(description="parameters + gradients + optimizer + activations: memory used")
    capacity_bytes: float = Field(description="the device's memory")
    headroom_bytes: float = Field(description="capacity x headroom: kept free for workspace, communication "
                                              "buffers and fragmentation")
    usable_bytes: float = Field(description="capacity - headroom: what totalBytes must stay within to fit")
    free_bytes: float = Field(description="usable - total (negative: does not fit)")
    fits: bool = Field(description="totalBytes <= usableBytes")


class BytesPerParameterView(Model):
    """Bytes of training state per parameter by kind; mixed-precision Adam: 2 + 2 + 4 + 4 + 4 = 16."""

    weights: float
    gradients: float
    master_weights: float
    optimizer_states: float = Field(description="Adam's m and v")
    optimizer: float = Field(description="master weights + optimizer states (ZeRO's K, 12)")
    total: float


class MemoryPoint(Model):
    """Memory used per device (totalBytes) at one parameter count, per sharding."""

    parameters: float
    ddp: float
    zero1: float
    zero2: float
    fsdp: float


class FitsUpTo(Model):
    """The largest parameter count that fits each sharding on these devices (null: not even 1e6)."""

    ddp: float | None
    zero1: float | None
    zero2: float | None
    fsdp: float | None


class MemoryLab(Model):
    sharding: Sharding
    devices: int = Field(description="data-parallel degree the sharding divides by")
    headroom: float
    per_device: PerDevice
    bytes_per_parameter: BytesPerParameterView
    curve: list[MemoryPoint] = Field(description="ten points per decade of parameters; each a GPT shape derived "
                                                 "from the count (Transformer.from_parameters) at the request's "
                                                 "sequence length, micro-batch and recomputation")
    fits_up_to: FitsUpTo
    sharding_needed_above: float | None = Field(
        description="parameters above which DDP (every rank holding all model states) no longer fits: fitsUpTo.ddp")
    rule: str = Field(description="how fitting is decided")


def memory_lab(
    model: Transformer,
    device: DeviceSpec,
    *,
    devices: int,
    sharding: Sharding | str = Sharding.DDP,
    micro_batch: int = 1,
    recompute: Recompute | str = Recompute.NONE,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    headroom: float = DEFAULT_HEADROOM,
    curve_from: float | None = None,
    curve_to: float | None = None,
) -> MemoryLab:
    """Memory per device of ``model`` data-parallel over ``devices`` under ``sharding``, the curve of
    every sharding against parameter count, and where each stops fitting ``device``."""
    sharding, recompute = Sharding(sharding), Recompute(recompute)
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")

    layouts = {s: Layout(dp=devices, zero_stage=s.zero_stage if devices > 1 else ZeroStage.NONE,
                         micro_batch=micro_batch, recompute=recompute) for s in Sharding}
    shapes: dict[float, tuple[Transformer, float]] = {}

    def shape_of(parameters: float) -> tuple[Transformer, float]:
        """A derived GPT shape of that size and its activations (the same under every sharding)."""
        if parameters not in shapes:
            shape = Transformer.from_parameters(parameters, seq_len=model.seq_len, vocab_size=model.vocab_size)
            shapes[parameters] = shape, activations_bytes_per_device(shape, layouts[Sharding.DDP])
        return shapes[parameters]

    def used(s: Sharding, parameters: float) -> float:
        shape, activations = shape_of(parameters)
        return sum(model_states_per_device(shape, layouts[s], bytes_per_parameter)) + activations

    memory = estimate_memory(model, layouts[sharding], bytes_per_parameter=bytes_per_parameter, headroom=headroom)
    usable = device.memory_bytes * (1 - headroom)
    low = curve_from or max(MIN_PARAMETERS, model.parameters / 1000)
    high = curve_to or min(MAX_PARAMETERS, model.parameters * 1000)
    if not MIN_PARAMETERS <= low < high <= MAX_PARAMETERS:
        raise ValueError(f"the curve must span parameters within [{MIN_PARAMETERS:g}, {MAX_PARAMETERS:g}], "
                         f"from below to above, got {low:g} to {high:g}")
    counts = _log_space(low, high, _CURVE_DECADES_PER_POINT)
    curve = [MemoryPoint(parameters=p, **{s.value: used(s, p) for s in Sharding}) for p in counts]
    def fits_with(s: Sharding) -> Callable[[float], bool]:
        return lambda p: used(s, p) <= usable

    limits = {s.value: _largest_fitting(fits_with(s), counts) for s in Sharding}
    return MemoryLab(
        sharding=sharding, devices=devices, headroom=headroom,
        per_device=_per_device(memory, device, headroom),
        bytes_per_parameter=BytesPerParameterView(
            weights=bytes_per_parameter.weights, gradients=bytes_per_parameter.gradients,
            master_weights=bytes_per_parameter.master_weights,
            optimizer_states=bytes_per_parameter.optimizer_states,
            optimizer=bytes_per_parameter.optimizer_total, total=bytes_per_parameter.total),
        curve=curve, fits_up_to=FitsUpTo(**limits), sharding_needed_above=limits["ddp"],
        rule=f"fits when memory used per device <= capacity x (1 - headroom {headroom:g})",
    )


def _per_device(memory: MemoryBreakdown, device: DeviceSpec, headroom: float) -> PerDevice:
    usable = device.memory_bytes * (1 - headroom)
    total = memory.used_bytes_per_device
    return PerDevice(
        parameters_bytes=memory.weights_bytes_per_device, gradients_bytes=memory.gradients_bytes_per_device,
        optimizer_bytes=memory.optimizer_bytes_per_device, activations_bytes=memory.activations_bytes_per_device,
        total_bytes=total, capacity_bytes=device.memory_bytes, headroom_bytes=device.memory_bytes * headroom,
        usable_bytes=usable, free_bytes=usable - total, fits=memory.fits(device.memory_bytes),
    )


def _log_space(low: float, high: float, step_decades: float) -> list[float]:
    """``low`` to ``high`` in equal steps of log10 (``high`` included)."""
    count = max(1, math.ceil(math.log10(high / low) / step_decades))
    return [low * (high / low) ** (i / count) for i in range(count + 1)]


def _largest_fitting(fits: Callable[[float], bool], grid: Sequence[float] = ()) -> float | None:
    """The largest parameter count in [1e6, 1e15] that fits, to 0.05 %, by bisection on log
    parameters (memory grows with the count) between the grid points that bracket it (the
    curve's, already evaluated), else over the whole range; ``None`` when not even 1e6 fits."""
    points = [MIN_PARAMETERS, *grid, MAX_PARAMETERS]
    if not fits(points[0]):
        return None
    if fits(points[-1]):
        return points[-1]
    first_failing = next(i for i, p in enumerate(points) if not fits(p))
    low, high = points[first_failing - 1], points[first_failing]
    while high / low > 1.0005:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# ----------------------------------------------------------------------------- 2. scaling


class ScalingPoint(Model):
    nodes: int
    devices: int
    global_batch: int = Field(description="sequences per step: the requested one, or more where every rank "
                                          "needs at least one micro-batch")
    microbatches: int = Field(description="micro-batches per rank per step (gradient accumulation)")
    step_seconds: float
    compute_seconds: float
    communication_seconds: float = Field(description="communication on the critical path (not hidden by "
                                                     "dpOverlap)")
    comm_to_compute: float = Field(description="communicationSeconds / computeSeconds; above 1 the "
                                               "interconnect dominates")
    tokens_per_second: float
    tokens_per_second_per_device: float
    mfu: float
    efficiency: float = Field(description="tokens/s per device over the first point's")
    marginal_efficiency: float | None = Field(description="tokens/s added per device added, over the first "
                                                          "point's tokens/s per device (null at the first point)")
    fits: bool
    memory_bytes_per_device: float = Field(description="memory used per device")
    bottleneck: Bottleneck
    matmul_efficiency: float = Field(default=0.0, description="the share of peak its matmuls sustain")


class ScalingLab(Model):
    points: list[ScalingPoint]
    stops_helping_at: int | None = Field(
        description="devices of the last point before the first whose marginal efficiency is below the "
                    "threshold; null when every added node still helps")
    marginal_threshold: float
    rule: str = Field(description="the definition of stopsHelpingAt")
    interconnect_bandwidth: float = Field(description="bytes/s per device across nodes, one direction")
    intra_node_bandwidth: float = Field(description="bytes/s per device inside a node (NVLink), one direction")
    compute_efficiency: float = Field(description="share of peak the matmuls reach while computing: the given "
                                                  "one, or the one fitted to a measured step")
    fitted: str | None = Field(default=None, description="how computeEfficiency was fitted to a measured step "
                                                         "time (null when it was given)")


def node_counts(max_nodes: int) -> list[int]:
    """1, 2, 4, … up to ``max_nodes`` (which is included)."""
    if max_nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {max_nodes}")
    counts = [2 ** i for i in range(max_nodes.bit_length()) if 2 ** i <= max_nodes]
    return counts if counts[-1] == max_nodes else [*counts, max_nodes]


def scaling_lab(
    model: Transformer,
    device: DeviceSpec,
    *,
    nodes: Sequence[int],
    devices_per_node: int,
    global_batch: int,
    interconnect_bandwidth: float | None = None,
    intra_node_bandwidth: float | None = None,
    nodes_per_rack: int = 4,
    micro_batch: int = 1,
    tensor: int = 1,
    sharding: Sharding | str = Sharding.DDP,
    recompute: Recompute | str = Recompute.NONE,
    efficiency: float | None = None,
    dp_overlap: float | None = None,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    headroom: float = DEFAULT_HEADROOM,
    marginal_threshold: float = DEFAULT_MARGINAL_THRESHOLD,
    measured_nodes: int | None = None,
    measured_step_seconds: float | None = None,
) -> ScalingLab:
    """``global_batch`` sequences per step over each node count (strong scaling while every rank
    still gets a micro-batch), tensor parallel ``tensor`` inside a node and data parallel across.

    ``efficiency``: the matmuls' share of peak (default: by their shape, :mod:`.kernels`). With a step time
    measured on ``measured_nodes`` (a job opened in the Lab), that share is first fitted so that the planner's
    step there equals the measurement: the communication and the memory-bound kernels are the model's, the
    matmuls take the rest."""
    sharding, recompute = Sharding(sharding), Recompute(recompute)
    counts = sorted(set(nodes))
    if not counts or counts[0] < 1:
        raise ValueError("nodes must list node counts of at least 1")
    if devices_per_node % tensor:
        raise ValueError(f"tensor ({tensor}) must divide devicesPerNode ({devices_per_node})")
    if not 0 < marginal_threshold < 1:
        raise ValueError(f"the marginal threshold must be in (0, 1), got {marginal_threshold}")
    topology = lab_topology(device, devices_per_node=devices_per_node, nodes_per_rack=nodes_per_rack,
                            interconnect_bandwidth=interconnect_bandwidth, intra_node_bandwidth=intra_node_bandwidth)

    def layout_for(n: int) -> Layout:
        return scaling_layout(n * devices_per_node, global_batch=global_batch, micro_batch=micro_batch,
                              tensor=tensor, sharding=sharding, recompute=recompute)

    fitted = None
    if measured_step_seconds is not None and measured_nodes is not None:
        efficiency, fitted = fit_to_measurement(
            lambda e: estimate_step(model, layout_for(measured_nodes), device, topology, efficiency=e,
                                    dp_overlap=dp_overlap, bytes_per_parameter=bytes_per_parameter,
                                    headroom=headroom),
            measured_step_seconds, efficiency)
        fitted = f"{fitted} (measured {measured_step_seconds:g} s per step on {measured_nodes} nodes)"
    points: list[ScalingPoint] = []
    for n in counts:
        step = estimate_step(model, layout_for(n), device, topology, efficiency=efficiency, dp_overlap=dp_overlap,
                             bytes_per_parameter=bytes_per_parameter, headroom=headroom)
        points.append(scaling_point(n, n * devices_per_node, step, points))
    stops = next((points[i - 1].devices for i in range(1, len(points))
                  if (points[i].marginal_efficiency or 0.0) < marginal_threshold), None)
    return ScalingLab(
        points=points, stops_helping_at=stops, marginal_threshold=marginal_threshold,
        rule=f"adding devices stops helping once the tokens/s they add per device falls below "
             f"{marginal_threshold:g} x the first point's tokens/s per device",
        interconnect_bandwidth=topology.intra_rack.bandwidth, intra_node_bandwidth=topology.nvlink.bandwidth,
        compute_efficiency=efficiency if efficiency is not None else points[0].matmul_efficiency, fitted=fitted,
    )


def scaling_layout(devices: int, *, global_batch: int, micro_batch: int, tensor: int, sharding: Sharding,
                   recompute: Recompute) -> Layout:
    """The Lab's layout on ``devices``: tensor parallel ``tensor`` inside a node, data parallel across, the global
    batch in as many micro-batches as it takes (at least one per data-parallel rank)."""
    dp = devices // tensor
    microbatches = max(1, math.ceil(global_batch / (micro_batch * dp)))
    return Layout(dp=dp, tp=tensor, zero_stage=sharding.zero_stage if dp > 1 else ZeroStage.NONE,
                  micro_batch=micro_batch, microbatches=microbatches, sequence_parallel=tensor > 1,
                  recompute=recompute)


def scaling_point(nodes: int, devices: int, step: StepEstimate, earlier: Sequence[ScalingPoint]) -> ScalingPoint:
    """One node count's point: its efficiency against the first point's tokens/s per device, its marginal
    efficiency (what the devices it adds bring, per device) against the point before it."""
    layout = step.layout
    per_device = step.tokens_per_second / devices
    base = earlier[0].tokens_per_second_per_device if earlier else per_device
    marginal = None
    if earlier:
        previous = earlier[-1]
        marginal = (step.tokens_per_second - previous.tokens_per_second) / (devices - previous.devices) / base
    return ScalingPoint(
        nodes=nodes, devices=devices, global_batch=layout.global_batch, microbatches=layout.microbatches,
        step_seconds=step.step_seconds, compute_seconds=step.compute_seconds,
        communication_seconds=step.exposed_comm_seconds, comm_to_compute=step.comm_to_compute_ratio,
        tokens_per_second=step.tokens_per_second, tokens_per_second_per_device=per_device, mfu=step.mfu,
        efficiency=per_device / base, marginal_efficiency=marginal, fits=step.fits,
        memory_bytes_per_device=step.memory.used_bytes_per_device, bottleneck=step.bottleneck,
        matmul_efficiency=step.stage.matmul_efficiency if step.stage else 0.0,
    )


def fit_to_measurement(estimate: Callable[[float | None], StepEstimate], measured_seconds: float,
                       efficiency: float | None, rounds: int = 6) -> tuple[float, str]:
    """The matmul share of peak at which ``estimate`` gives the measured step: the matmuls scale with it, the
    memory-bound kernels and the communication do not (what the backward hides of the data-parallel traffic
    moves with it a little, so the fit is repeated until it settles)."""
    said = ""
    for _ in range(rounds):
        step = estimate(efficiency)
        assert step.stage is not None
        share = step.stage.matmul_seconds / step.stage.seconds if step.stage.seconds else 1.0
        busy = step.compute_seconds * (1 + step.bubble_ratio)
        fitted, said = fit_efficiency(busy * share, step.exposed_comm_seconds + busy * (1 - share),
                                      measured_seconds, step.stage.matmul_efficiency)
        if efficiency is not None and abs(fitted - efficiency) <= 1e-9 * efficiency:
            break
        efficiency = fitted
    assert efficiency is not None
    return efficiency, said


def fit_efficiency(compute_seconds: float, comm_seconds: float, measured_seconds: float,
                   efficiency: float) -> tuple[float, str]:
    """The efficiency at which ``compute x efficiency / fitted + comm = measured`` (compute time is
    inversely proportional to it), kept in [1e-4, 1], and a sentence saying what was done."""
    if measured_seconds <= 0:
        raise ValueError(f"a measured step time must be positive, got {measured_seconds}")
    room = measured_seconds - comm_seconds
    if room <= 0:
        return 1.0, ("the measured step is shorter than the modelled communication alone, so the links are "
                     "faster than modelled (raise the bandwidths): efficiency set to 1")
    fitted = efficiency * compute_seconds / room
    if fitted > 1:
        return 1.0, "the measured step is faster than the device's peak allows: efficiency capped at 1"
    return max(1e-4, fitted), f"efficiency {fitted:.3g} reproduces the measured step"


def lab_topology(
    device: DeviceSpec,
    *,
    devices_per_node: int,
    nodes_per_rack: int = 4,
    interconnect_bandwidth: float | None = None,
    intra_node_bandwidth: float | None = None,
) -> Topology:
    """The device's links with the Lab's two controls: the bandwidth across nodes (in a rack and
    across racks alike, a non-blocking fabric) and inside a node."""
    base = Topology.for_device(device, devices_per_node=devices_per_node, nodes_per_rack=nodes_per_rack,
                               cross_rack_bandwidth=interconnect_bandwidth)
    update = {}
    if interconnect_bandwidth is not None:
        update["intra_rack"] = base.intra_rack.model_copy(update={"bandwidth": interconnect_bandwidth})
    if intra_node_bandwidth is not None:
        update["nvlink"] = base.nvlink.model_copy(update={"bandwidth": intra_node_bandwidth})
    return base.model_copy(update=update)


# ----------------------------------------------------------------------------- 3. checkpoint


class CheckpointPoint(Model):
    interval_seconds: float
    interval_steps: int | None = Field(default=None, description="the interval in whole steps, given stepSeconds")
    redo_fraction: float = Field(description="expected work redone after failures: interval / (2 MTBF)")
    overhead_fraction: float = Field(description="checkpoint writes: writeSeconds / interval")
    restart_fraction: float = Field(description="restarts: restartSeconds / MTBF (the same at every interval)")
    waste_fraction: float = Field(description="redo + overhead + restart (Young's first order)")
    daly_waste_fraction: float = Field(description="the same under Daly's exact exponential-failure model")


class CheckpointLab(Model):
    optimum_seconds: float = Field(description="Young's optimum sqrt(2 writeSeconds MTBF): the minimum of "
                                               "wasteFraction")
    optimum_steps: int | None = Field(default=None, description="optimumSeconds in whole steps, given stepSeconds")
    optimum_waste_fraction: float
    daly_optimum_seconds: float = Field(description="the exact minimiser of Daly's model (close to Young's while "
                                                    "writeSeconds << MTBF)")
    mtbf_seconds: float
    write_seconds: float
    restart_seconds: float
    curve: list[CheckpointPoint] = Field(description="from optimum / span to optimum x span, log-spaced, the "
                                                     "optimum itself the middle point")


def checkpoint_lab(
    *,
    mtbf_seconds: float,
    write_seconds: float,
    restart_seconds: float = 0.0,
    step_seconds: float | None = None,
    points: int = 61,
    span: float = 20.0,
) -> CheckpointLab:
    """Redo, overhead and waste over the checkpoint interval, and the interval that wastes least."""
    if write_seconds <= 0 or mtbf_seconds <= 0 or restart_seconds < 0:
        raise ValueError("writeSeconds and the MTBF must be positive, restartSeconds at least 0")
    if points < 3 or span <= 1:
        raise ValueError("the curve needs at least 3 points over a span above 1")
    optimum = young_interval(write_seconds, mtbf_seconds)
    half = points // 2  # the middle point is the optimum itself (span ** 0 == 1)
    intervals = [optimum * span ** ((i - half) / half) for i in range(2 * half + 1)]

    def point(tau: float) -> CheckpointPoint:
        redo, overhead, restart = tau / (2 * mtbf_seconds), write_seconds / tau, restart_seconds / mtbf_seconds
        waste = wasted_fraction(tau, write_seconds, mtbf_seconds, restart_time=restart_seconds)
        return CheckpointPoint(
            interval_seconds=tau, interval_steps=_steps(tau, step_seconds), redo_fraction=redo,
            overhead_fraction=overhead, restart_fraction=restart, waste_fraction=waste,
            daly_waste_fraction=_daly_waste(tau, write_seconds, mtbf_seconds, restart_seconds),
        )

    return CheckpointLab(
        optimum_seconds=optimum, optimum_steps=_steps(optimum, step_seconds),
        optimum_waste_fraction=point(optimum).waste_fraction,
        daly_optimum_seconds=_daly_optimum(write_seconds, mtbf_seconds),
        mtbf_seconds=mtbf_seconds, write_seconds=write_seconds, restart_seconds=restart_seconds,
        curve=[point(tau) for tau in intervals],
    )


def _daly_waste(interval: float, write_seconds: float, mtbf_seconds: float, restart_seconds: float) -> float:
    """Daly's exact waste; all of the time once his exponentials overflow (a write or restart
    hundreds of MTBFs long: nothing finishes)."""
    try:
        return daly_wasted_fraction(interval, write_seconds, mtbf_seconds, restart_time=restart_seconds)
    except OverflowError:
        return 1.0


def _daly_optimum(write_seconds: float, mtbf_seconds: float) -> float:
    """Daly's exact optimum; past his exponentials' range his estimate, the MTBF itself (δ >= 2M)."""
    try:
        return daly_optimal_interval(write_seconds, mtbf_seconds)
    except OverflowError:
        return daly_interval(write_seconds, mtbf_seconds)


def _steps(seconds: float, step_seconds: float | None) -> int | None:
    return max(1, round(seconds / step_seconds)) if step_seconds else None
