"""Enumerate parallel layouts for a model on a set of devices, rank the feasible ones, and say in
words why each of the others fails.

Candidates: every ``tp x cp x pp x dp = devices`` with ``tp``, ``cp`` and ``pp`` dividing the device count,
every ZeRO stage (stages above 0 only when ``dp > 1``, where they shard something), every micro-batch size
offered, every recomputation mode, sequence parallelism on and off (with ``tp > 1``), and the 1F1B and
interleaved schedules (2, 4 or 8 chunks per device, where the stages' layers split into them and the
micro-batches are a multiple of the stages, as Megatron-LM's interleaved schedule needs). Context parallelism
is offered from 32K-token sequences (it only pays where the sequence is long). Pipeline stages may be uneven
(:meth:`Layout.stage_layers`: 126 layers on 16 stages put one fewer at each end). A candidate that cannot be
built is rejected with its reason: ``tp`` must divide the attention heads, the key/value heads (fewer under
grouped-query attention: each rank computes whole kv heads, those its query heads share) and the FFN width, as
the trainer's tensor parallelism needs; ``cp`` must divide the sequence. Feasible layouts are ranked by
estimated step time, then by memory.
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


DEFAULT_CHUNKS = (1, 2, 4, 8)
LONG_SEQUENCE = 32_768  # from here on, context parallelism is among the candidates


class Candidate(Model):
    """One point of the search space, before it is known to be valid."""

    dp: int
    tp: int
    pp: int
    zero_stage: ZeroStage
    micro_batch: int
    recompute: Recompute
    cp: int = 1
    sequence_parallel: bool = True
    virtual_stages: int = 1  # 1: 1F1B; more: the interleaved schedule

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel and self.tp > 1 else ""
        cp = f" cp {self.cp}" if self.cp > 1 else ""
        schedule = f" interleaved×{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"dp {self.dp} tp {self.tp}{sp}{cp} pp {self.pp}{schedule} zero {int(self.zero_stage)} "
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
    context: Iterable[int] = (1,),
    chunks: Iterable[int] = DEFAULT_CHUNKS,
    sequence_parallel: Iterable[bool] = (True, False),
) -> Iterator[Candidate]:
    """Every ``(dp, tp, cp, pp, zero, micro, recompute, sp, chunks)`` with ``dp x tp x cp x pp = devices``."""
    stages = [ZeroStage(z) for z in zero_stages]
    modes = [Recompute(r) for r in recomputes]
    micros, contexts, chunk_counts, sps = list(micro_batches), list(context), list(chunks), list(sequence_parallel)
    for tp in divisors(devices):
        for cp in (c for c in contexts if (devices // tp) % c == 0):
            for pp in divisors(devices // (tp * cp)):
                dp = devices // (tp * cp * pp)
                for zero in stages:
                    if zero > ZeroStage.NONE and dp == 1:
                        continue
                    for v in (c for c in chunk_counts if c == 1 or pp > 1):
                        for sp in sps if tp > 1 else [False]:
                            for micro in micros:
                                for mode in modes:
                                    yield Candidate(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero, micro_batch=micro,
                                                    recompute=mode, sequence_parallel=sp, virtual_stages=v)


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
    if model.seq_len % c.cp:
        reasons.append(f"context {c.cp} does not divide the sequence of {model.seq_len} tokens")
    if global_batch % (c.micro_batch * c.dp):
        reasons.append(f"global batch {global_batch} not divisible by micro {c.micro_batch} × dp {c.dp}")
    elif c.virtual_stages > 1 and (global_batch // (c.micro_batch * c.dp)) % c.pp:
        reasons.append(f"the interleaved schedule needs micro-batches ({global_batch // (c.micro_batch * c.dp)}) "
                       f"to be a multiple of the {c.pp} stages")
    return reasons


def to_layout(candidate: Candidate, global_batch: int) -> Layout:
    """The layout of a candidate whose shape is valid."""
    c = candidate
    return Layout(
        dp=c.dp, tp=c.tp, pp=c.pp, cp=c.cp, zero_stage=c.zero_stage, micro_batch=c.micro_batch,
        microbatches=global_batch // (c.micro_batch * c.dp), sequence_parallel=c.sequence_parallel and c.tp > 1,
        recompute=c.recompute, virtual_stages=c.virtual_stages,
        schedule=Schedule.INTERLEAVED if c.virtual_stages > 1 else Schedule.ONE_F_ONE_B,
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
    context: Iterable[int] | None = None,
    chunks: Iterable[int] = DEFAULT_CHUNKS,
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
    if context is None:
        context = (1, 2, 4, 8, 16) if model.seq_len >= LONG_SEQUENCE else (1,)
    for candidate in candidates(devices, micro_batches=micro_batches, zero_stages=zero_stages,
                                recomputes=recomputes, context=context, chunks=chunks):
        reasons = shape_reasons(candidate, model, topology, global_batch)
        if reasons:
            rejected.append(RejectedLayout(candidate=candidate, reasons=reasons))
            continue
        try:
            layout = to_layout(candidate, global_batch)
            layout.check_layers(model.n_layers)
        except ValueError as exc:  # the interleaved chunks cannot be filled
            rejected.append(RejectedLayout(candidate=candidate, reasons=[str(exc)]))
            continue
        estimate = estimate_step(
            model, layout, device, topology,
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
