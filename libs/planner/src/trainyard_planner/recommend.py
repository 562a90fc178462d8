"""Enumerate parallel layouts for a model on a set of devices, rank the feasible ones, and say in
words why each of the others fails.

Candidates: every ``tp x pp x dp = devices`` with ``tp`` and ``pp`` dividing the device count,
every ZeRO stage (stages above 0 only when ``dp > 1``, where they shard something), every
micro-batch size offered and every recomputation mode. A candidate that cannot be built is
rejected with its reason: ``tp`` must divide the attention heads, the key/value heads (fewer under
grouped-query attention: each rank computes whole kv heads, those its query heads share) and the
FFN width, as the trainer's tensor parallelism needs. Sequence parallelism is on whenever
``tp > 1`` (same communication volume, less memory). Feasible layouts are ranked by estimated step
time, then by memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from trainyard_planner._private import Model, divisors
from trainyard_planner.comm import Topology
from trainyard_planner.compute import DeviceSpec
from trainyard_planner.layout import Layout, Recompute, Schedule, ZeroStage
from trainyard_planner.memory import DEFAULT_HEADROOM, MIXED_PRECISION_ADAM, BytesPerParameter, estimate_memory
from trainyard_planner.model import Transformer
from trainyard_planner.step import StepEstimate, estimate_step

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)


class Candidate(Model):
    """One point of the search space, before it is known to be valid."""

    dp: int
    tp: int
    pp: int
    zero_stage: ZeroStage
    micro_batch: int
    recompute: Recompute

    def describe(self) -> str:
        return (f"dp {self.dp} tp {self.tp} pp {self.pp} zero {int(self.zero_stage)} "
                f"micro {self.micro_batch} recompute {self.recompute.value}")


class RejectedLayout(Model):
    candidate: Candidate
    reasons: list[str]


class Recommendation(Model):
    """Feasible layouts best first, and every rejected candidate with its reasons."""

    accepted: list[StepEstimate]
    rejected: list[RejectedLayout]

    @property
    def best(self) -> StepEstimate | None:
        return self.accepted[0] if self.accepted else None


def candidates(
    devices: int,
    *,
    micro_batches: Iterable[int] = DEFAULT_MICRO_BATCHES,
    zero_stages: Iterable[ZeroStage | int] = tuple(ZeroStage),
    recomputes: Iterable[Recompute | str] = tuple(Recompute),
) -> Iterator[Candidate]:
    """Every ``(dp, tp, pp, zero, micro, recompute)`` with ``dp x tp x pp = devices``."""
    stages = [ZeroStage(z) for z in zero_stages]
    modes = [Recompute(r) for r in recomputes]
    micros = list(micro_batches)
    for tp in divisors(devices):
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            for zero in stages:
                if zero > ZeroStage.NONE and dp == 1:
                    continue
                for micro in micros:
                    for mode in modes:
                        yield Candidate(dp=dp, tp=tp, pp=pp, zero_stage=zero, micro_batch=micro, recompute=mode)


def shape_reasons(candidate: Candidate, model: Transformer, topology: Topology, global_batch: int) -> list[str]:
    """Why a candidate cannot be built at all, before any memory or time is estimated."""
    c, reasons = candidate, []
    if c.tp > topology.domain:
        reasons.append(f"tensor {c.tp} exceeds the {topology.domain}-device NVLink domain")
    if model.n_heads % c.tp:
        reasons.append(f"tensor {c.tp} does not divide {model.n_heads} attention heads")
    if model.kv_heads != model.n_heads and model.kv_heads % c.tp:
        # each rank computes whole key/value heads, the ones its query heads share (the trainer's rule)
        reasons.append(f"tensor {c.tp} does not divide {model.kv_heads} key/value heads (grouped-query attention)")
    if model.ffn_width % c.tp:
        reasons.append(f"tensor {c.tp} does not divide the FFN width {model.ffn_width}")
    if c.pp > model.n_layers:
        reasons.append(f"pipeline {c.pp} exceeds {model.n_layers} layers")
    elif model.n_layers % c.pp:
        reasons.append(f"{model.n_layers} layers not divisible by pipeline {c.pp}")
    if global_batch % (c.micro_batch * c.dp):
        reasons.append(f"global batch {global_batch} not divisible by micro {c.micro_batch} × dp {c.dp}")
    return reasons


def to_layout(candidate: Candidate, global_batch: int) -> Layout:
    """The layout of a candidate whose shape is valid (1F1B, sequence parallel with TP)."""
    c = candidate
    return Layout(
        dp=c.dp, tp=c.tp, pp=c.pp, zero_stage=c.zero_stage, micro_batch=c.micro_batch,
        microbatches=global_batch // (c.micro_batch * c.dp), sequence_parallel=c.tp > 1,
        recompute=c.recompute, schedule=Schedule.ONE_F_ONE_B,
    )


def recommend(
    model: Transformer,
    device: DeviceSpec,
    devices: int,
    global_batch: int,
    *,
    topology: Topology | None = None,
    micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
    zero_stages: Iterable[ZeroStage | int] = tuple(ZeroStage),
    recomputes: Iterable[Recompute | str] = tuple(Recompute),
    efficiency: float | None = None,
    dp_overlap: float | None = None,
    bandwidth_factor: float = 1.0,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    headroom: float = DEFAULT_HEADROOM,
) -> Recommendation:
    """Rank every feasible layout of ``model`` on ``devices`` x ``device`` for ``global_batch``
    sequences per step; explain each rejection ("needs 93.1 GB per device, 80 GB available")."""
    if devices < 1 or global_batch < 1:
        raise ValueError(f"devices ({devices}) and global batch ({global_batch}) must be positive")
    topology = topology or Topology.for_device(device)
    accepted: list[StepEstimate] = []
    rejected: list[RejectedLayout] = []
    for candidate in candidates(devices, micro_batches=micro_batches, zero_stages=zero_stages,
                                recomputes=recomputes):
        reasons = shape_reasons(candidate, model, topology, global_batch)
        if reasons:
            rejected.append(RejectedLayout(candidate=candidate, reasons=reasons))
            continue
        estimate = estimate_step(
            model, to_layout(candidate, global_batch), device, topology,
            efficiency=efficiency, dp_overlap=dp_overlap, bandwidth_factor=bandwidth_factor,
            bytes_per_parameter=bytes_per_parameter, headroom=headroom,
        )
        shortfall = estimate.memory.shortfall(device.memory_bytes)
        if shortfall:
            rejected.append(RejectedLayout(candidate=candidate, reasons=[shortfall]))
        else:
            accepted.append(estimate)
    accepted.sort(key=lambda e: (e.step_seconds, e.memory.required_bytes_per_device))
    return Recommendation(accepted=accepted, rejected=rejected)


def check_fits(
    model: Transformer,
    layout: Layout,
    device: DeviceSpec,
    *,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    headroom: float = DEFAULT_HEADROOM,
) -> str | None:
    """For submission-time validation and the scheduler: ``None`` when the layout fits the
    device's memory, else the reason in the same words as :func:`recommend`."""
    memory = estimate_memory(model, layout, bytes_per_parameter=bytes_per_parameter, headroom=headroom)
    return memory.shortfall(device.memory_bytes)
