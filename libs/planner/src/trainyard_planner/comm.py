"""Communication per training step and where the bottleneck sits.

Ring collectives over ``n`` ranks (Patarasuk & Yuan 2009; the model NCCL's ring follows): an
all-reduce of ``S`` bytes sends ``2 (n-1)/n S`` bytes per rank in ``2 (n-1)`` steps; a
reduce-scatter or an all-gather sends ``(n-1)/n S`` in ``n-1`` steps. Time is
``steps x latency + bytes / bandwidth`` on the slowest link the ring crosses (for a pipeline,
the slowest link between adjacent stages).

Per step, per device (``Psi`` parameters on the device, ``m`` micro-batches, ``L'`` layers on it):

- data parallel, ZeRO 0/1: one all-reduce of the bf16 gradients, ``2 Psi`` bytes (ZeRO-1's
  reduce-scatter + all-gather of the updated weights moves the same volume);
- ZeRO 2: a gradient reduce-scatter per micro-batch and one all-gather of the weights;
- ZeRO 3 / FSDP: per micro-batch an all-gather of the weights for the forward, another for the
  backward, and a gradient reduce-scatter; with ``m = 1`` that is ``3 Psi`` against DDP's ``2 Psi``,
  the 1.5x of the ZeRO paper (§7.2.2);
- tensor parallel (Megatron-LM): 2 all-reduces of the ``b s h`` activations per layer forward and 2
  backward (2 more with full recomputation), on the fullest stage's layers; sequence parallelism turns
  each into a reduce-scatter + all-gather of the same volume. The volume is a layer's output, whatever
  the heads: grouped-query attention narrows K and V inside each rank, not what the ranks exchange;
- context parallel (Llama 3's all-gather variant): per layer the forward all-gathers the K and V of the
  whole sequence (this rank's kv heads) and the backward reduce-scatters their gradients;
- pipeline parallel: each micro-batch's activation forward and its gradient backward across each stage
  boundary, ``v`` times with ``v`` interleaved chunks, ``b s h / t`` 16-bit values per rank: each tensor
  rank sends its ``1/t`` and the next stage all-gathers it over NVLink (Megatron-LM's scatter/gather, on by
  default; sequence parallelism splits the activation the same way).

Bandwidths are a link's; a collective sustains ``collective_efficiency`` of it (NCCL's bus bandwidth on an
A100 NVSwitch is about 0.8 of the link). Tensor, context and pipeline traffic sits on the critical path; what
data-parallel traffic the backward pass hides is :func:`trainyard_planner.step.dp_exposed`'s to say.
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import Field

from trainyard_planner._private import GB, Model
from trainyard_planner.compute import DeviceSpec
from trainyard_planner.layout import Layout, Recompute, ZeroStage
from trainyard_planner.model import Transformer


class LinkTier(Model):
    """One tier of the network as one device sees it."""

    bandwidth: float = Field(gt=0, description="bytes/s per device, one direction")
    latency: float = Field(ge=0, description="seconds per ring step")


class Tier(StrEnum):
    NVLINK = "nvlink"
    INTRA_RACK = "intra_rack"
    CROSS_RACK = "cross_rack"


class Topology(Model):
    """Devices per node, the NVLink domain, nodes per rack, and the three link tiers."""

    devices_per_node: int = Field(default=8, gt=0)
    nvlink_domain: int | None = Field(default=None, gt=0, description="devices sharing NVLink; a node when omitted")
    nodes_per_rack: int = Field(default=4, gt=0)
    nvlink: LinkTier = LinkTier(bandwidth=450 * GB, latency=3e-6)
    intra_rack: LinkTier = LinkTier(bandwidth=50 * GB, latency=8e-6)
    cross_rack: LinkTier = LinkTier(bandwidth=50 * GB, latency=15e-6)

    @property
    def domain(self) -> int:
        return self.nvlink_domain or self.devices_per_node

    @property
    def devices_per_rack(self) -> int:
        return max(self.devices_per_node * self.nodes_per_rack, self.domain)

    def tier_for(self, span: int) -> Tier:
        """The slowest tier a group of ranks crosses when it covers ``span`` consecutive ranks."""
        if span <= self.domain:
            return Tier.NVLINK
        if span <= self.devices_per_rack:
            return Tier.INTRA_RACK
        return Tier.CROSS_RACK

    def link(self, tier: Tier) -> LinkTier:
        return {Tier.NVLINK: self.nvlink, Tier.INTRA_RACK: self.intra_rack, Tier.CROSS_RACK: self.cross_rack}[tier]

    @classmethod
    def for_device(
        cls,
        device: DeviceSpec,
        *,
        devices_per_node: int | None = None,
        nodes_per_rack: int = 4,
        cross_rack_bandwidth: float | None = None,
    ) -> Topology:
        """A topology using the device's NVLink and NIC bandwidths (cross-rack defaults to the NIC:
        a non-blocking fabric)."""
        per_node = devices_per_node or device.nvlink_domain
        return cls(
            devices_per_node=per_node,
            nvlink_domain=min(device.nvlink_domain, per_node),
            nodes_per_rack=nodes_per_rack,
            nvlink=LinkTier(bandwidth=device.nvlink_bandwidth, latency=3e-6),
            intra_rack=LinkTier(bandwidth=device.network_bandwidth, latency=8e-6),
            cross_rack=LinkTier(bandwidth=cross_rack_bandwidth or device.network_bandwidth, latency=15e-6),
        )


def allreduce_bytes(size: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``size`` bytes: ``2 (n-1)/n x size``."""
    return 2 * (ranks - 1) / ranks * size


def reduce_scatter_bytes(size: float, ranks: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of ``size`` bytes: ``(n-1)/n x size``."""
    return (ranks - 1) / ranks * size


all_gather_bytes = reduce_scatter_bytes


def allreduce_seconds(size: float, ranks: int, link: LinkTier) -> float:
    return 2 * (ranks - 1) * link.latency + allreduce_bytes(size, ranks) / link.bandwidth


def reduce_scatter_seconds(size: float, ranks: int, link: LinkTier) -> float:
    return (ranks - 1) * link.latency + reduce_scatter_bytes(size, ranks) / link.bandwidth


all_gather_seconds = reduce_scatter_seconds


def send_seconds(size: float, link: LinkTier) -> float:
    return link.latency + size / link.bandwidth


class CommEstimate(Model):
    """Bytes sent and seconds spent per device per step, by kind of parallelism."""

    dp_bytes: float
    dp_seconds: float
    dp_tier: Tier | None
    tp_bytes: float
    tp_seconds: float
    tp_tier: Tier | None
    cp_bytes: float = 0.0
    cp_seconds: float = 0.0
    cp_tier: Tier | None = None
    pp_bytes: float
    pp_seconds: float
    pp_tier: Tier | None
    total_seconds: float


_NONE: tuple[float, float, Tier | None] = (0.0, 0.0, None)


def estimate_comm(
    model: Transformer,
    layout: Layout,
    topology: Topology,
    *,
    gradient_bytes: float = 2,
    weight_bytes: float = 2,
    activation_bytes: float = 2,
    bandwidth_factor: float = 1.0,
    collective_efficiency: float = 0.8,
) -> CommEstimate:
    """Per-step communication of one device under ``layout`` (see the module docstring).

    ``bandwidth_factor`` scales every link's bandwidth (a calibration, or the Lab's slider); a collective
    sustains ``collective_efficiency`` of a link.
    """
    factor = bandwidth_factor * collective_efficiency
    if factor != 1.0:
        topology = topology.model_copy(update={
            name: LinkTier(bandwidth=link.bandwidth * factor, latency=link.latency)
            for name, link in (("nvlink", topology.nvlink), ("intra_rack", topology.intra_rack),
                               ("cross_rack", topology.cross_rack))
        })
    activation = activation_bytes * layout.micro_batch * model.seq_len // layout.cp * model.d_model
    dp_bytes, dp_seconds, dp_tier = _data_parallel(model, layout, topology, gradient_bytes, weight_bytes)
    tp_bytes, tp_seconds, tp_tier = _tensor_parallel(model, layout, topology, activation)
    cp_bytes, cp_seconds, cp_tier = _context_parallel(model, layout, topology, activation_bytes)
    pp_bytes, pp_seconds, pp_tier = _pipeline_parallel(layout, topology, activation)
    return CommEstimate(
        dp_bytes=dp_bytes, dp_seconds=dp_seconds, dp_tier=dp_tier,
        tp_bytes=tp_bytes, tp_seconds=tp_seconds, tp_tier=tp_tier,
        cp_bytes=cp_bytes, cp_seconds=cp_seconds, cp_tier=cp_tier,
        pp_bytes=pp_bytes, pp_seconds=pp_seconds, pp_tier=pp_tier,
        total_seconds=dp_seconds + tp_seconds + cp_seconds + pp_seconds,
    )


def _data_parallel(model: Transformer, layout: Layout, topology: Topology, gradient_bytes: float,
                   weight_bytes: float) -> tuple[float, float, Tier | None]:
    dp, m = layout.dp, layout.microbatches
    if dp == 1:
        return _NONE
    tier = topology.tier_for(layout.tp * layout.cp * (dp - 1) + 1)
    link = topology.link(tier)
    params = model.stage_parameters(layout.pp, layout.stage_layers(model.n_layers)) / layout.tp
    grads, weights = gradient_bytes * params, weight_bytes * params
    if layout.zero_stage <= ZeroStage.OPTIMIZER:
        return allreduce_bytes(grads, dp), allreduce_seconds(grads, dp, link), tier
    if layout.zero_stage == ZeroStage.GRADIENTS:
        sent = m * reduce_scatter_bytes(grads, dp) + all_gather_bytes(weights, dp)
        seconds = m * reduce_scatter_seconds(grads, dp, link) + all_gather_seconds(weights, dp, link)
        return sent, seconds, tier
    sent = m * (reduce_scatter_bytes(grads, dp) + 2 * all_gather_bytes(weights, dp))
    seconds = m * (reduce_scatter_seconds(grads, dp, link) + 2 * all_gather_seconds(weights, dp, link))
    return sent, seconds, tier


def _tensor_parallel(model: Transformer, layout: Layout, topology: Topology,
                     activation: float) -> tuple[float, float, Tier | None]:
    tp = layout.tp
    if tp == 1:
        return _NONE
    tier = topology.tier_for(tp)
    per_layer = 6 if layout.recompute is Recompute.FULL else 4
    count = per_layer * max(layout.stage_layers(model.n_layers)) * layout.microbatches
    return (count * allreduce_bytes(activation, tp),
            count * allreduce_seconds(activation, tp, topology.link(tier)), tier)


def _context_parallel(model: Transformer, layout: Layout, topology: Topology,
                      activation_bytes: float) -> tuple[float, float, Tier | None]:
    cp = layout.cp
    if cp == 1:
        return _NONE
    tier = topology.tier_for(layout.tp * (cp - 1) + 1)
    kv = 2 * activation_bytes * layout.micro_batch * model.seq_len * model.kv_width / layout.tp  # K and V
    passes = 3 if layout.recompute is Recompute.FULL else 2  # forward all-gather, backward reduce-scatter
    count = passes * max(layout.stage_layers(model.n_layers)) * layout.microbatches
    return (count * all_gather_bytes(kv, cp), count * all_gather_seconds(kv, cp, topology.link(tier)), tier)


def _pipeline_parallel(layout: Layout, topology: Topology, activation: float) -> tuple[float, float, Tier | None]:
    if layout.pp == 1:
        return _NONE
    # The slowest boundary between adjacent stages sets the pace of the whole pipeline.
    tier = topology.tier_for(layout.tp * layout.cp * layout.dp * (layout.pp - 1) + 1)
    message = activation / layout.tp  # scatter/gather: each tensor rank sends its share
    sends = 2 * layout.microbatches * layout.interleaving
    return sends * message, sends * send_seconds(message, topology.link(tier)), tier


class Bottleneck(StrEnum):
    MEMORY = "memory"
    COMPUTE = "compute"
    INTERCONNECT = "interconnect"


def comm_to_compute_ratio(comm_seconds: float, compute_seconds: float) -> float:
    """Exposed communication time over compute time; above 1 the interconnect dominates."""
    return math.inf if compute_seconds <= 0 else comm_seconds / compute_seconds


def bottleneck(*, fits: bool, compute_seconds: float, comm_seconds: float) -> Bottleneck:
    """Memory when the layout does not fit; else interconnect when communication outweighs
    compute; else compute."""
    if not fits:
        return Bottleneck.MEMORY
    if comm_to_compute_ratio(comm_seconds, compute_seconds) > 1:
        return Bottleneck.INTERCONNECT
    return Bottleneck.COMPUTE
