"""A parallel layout: how one training step is split over devices.

``world = dp x tp x cp x pp`` and ``global batch = micro_batch x dp x microbatches`` (the seed's
``micro_batch_per_gpu x data_parallel_size x gradient_accumulation_steps``). Ranks are ordered
tensor-fastest, then context, then data, then pipeline (Megatron-LM's order), which decides what link each
group's collectives cross.

Context parallelism (``cp``) splits each sequence over ``cp`` ranks (Llama 3's 131K run: CP 16); pipeline
stages may hold uneven numbers of layers (:meth:`Layout.stage_layers`: 126 layers on 16 stages put one fewer on
the first and the last, where the embedding and the output layer sit, as Llama 3 does).
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Annotated, Protocol

from pydantic import Field

from trainyard_planner._private import Model


class ZeroStage(IntEnum):
    """What the data-parallel ranks shard (Rajbhandari et al. 2019). FSDP FULL_SHARD is stage 3,
    SHARD_GRAD_OP stage 2."""

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


FSDP = ZeroStage.PARAMETERS


class Recompute(StrEnum):
    """Activation recomputation (Korthikanti et al. 2022): none, selective (attention core) or full."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Schedule(StrEnum):
    """Pipeline schedule (Narayanan et al. 2021)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class Layout(Model):
    dp: int = Field(default=1, gt=0, description="data-parallel degree")
    tp: int = Field(default=1, gt=0, description="tensor-parallel degree")
    pp: int = Field(default=1, gt=0, description="pipeline stages")
    zero_stage: ZeroStage = ZeroStage.NONE
    micro_batch: int = Field(default=1, gt=0, description="sequences per micro-batch per rank")
    microbatches: int = Field(default=1, gt=0, description="micro-batches per step (gradient accumulation)")
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = Field(default=1, gt=0, description="model chunks per device (interleaved schedule)")
    cp: int = Field(default=1, gt=0, description="context-parallel degree: ranks sharing each sequence")
    fused_attention: bool = Field(default=True, description="a fused (flash) attention kernel: no score matrix in "
                                                            "memory; False for the materialised softmax of 2021")
    layers_per_stage: tuple[Annotated[int, Field(ge=0)], ...] | None = Field(
        default=None, min_length=1, description="transformer layers of each pipeline stage (one per stage); "
                                                "default: even, or one fewer on the end stages")

    def check_layers(self, n_layers: int) -> None:
        """ValueError when the layout cannot run ``n_layers``: the interleaved schedule with micro-batches that are
        not a multiple of the stages (Megatron-LM's rule), ``layersPerStage`` of another length or sum, more stages
        than layers, or too few layers for the interleaved chunks (each stage's chunks hold a layer each at least;
        the end stages may give one chunk to the embedding or the output layer)."""
        if self.interleaving > 1 and self.microbatches % self.pp:
            raise ValueError(f"the interleaved schedule needs micro-batches ({self.microbatches}) to be a multiple "
                             f"of the pipeline stages ({self.pp}), as Megatron-LM's does")
        if self.layers_per_stage is not None and len(self.layers_per_stage) != self.pp:
            raise ValueError(f"layersPerStage names {len(self.layers_per_stage)} stages; the pipeline has {self.pp}")
        if self.pp > n_layers:
            raise ValueError(f"pipeline {self.pp} exceeds {n_layers} layers")
        if self.layers_per_stage is not None and sum(self.layers_per_stage) != n_layers:
            raise ValueError(f"layersPerStage holds {sum(self.layers_per_stage)} layers; the model has {n_layers}")
        if self.interleaving > 1 and min(self.stage_layers(n_layers)) < self.interleaving - 1:
            raise ValueError(f"{n_layers} layers cannot fill {self.interleaving} chunks on each of {self.pp} stages")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def stage_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers per pipeline stage: as given, else even when ``pp`` divides them, else one fewer on the first
        and last stages when that makes the rest even (they hold the embedding and the output layer), else the
        remainder spread over the middle stages."""
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        p = self.pp
        if n_layers % p == 0:
            return (n_layers // p,) * p
        if p > 2 and (n_layers + 2) % p == 0:
            inner = (n_layers + 2) // p
            return (inner - 1, *(inner,) * (p - 2), inner - 1)
        base, extra = divmod(n_layers, p)
        middle = list(range(1, p - 1)) + [0, p - 1]
        counts = [base] * p
        for i in middle[:extra]:
            counts[i] += 1
        return tuple(counts)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.dp * self.microbatches

    @property
    def interleaving(self) -> int:
        """Model chunks per device that the schedule actually uses (1 unless interleaved)."""
        return self.virtual_stages if self.schedule is Schedule.INTERLEAVED else 1

    def describe(self) -> str:
        """A short human label: ``dp 8 tp 8 sp pp 16 1f1b×2 zero 1 micro 1×32 recompute full``."""
        parts = [f"dp {self.dp}", f"tp {self.tp}" + (" sp" if self.sequence_parallel and self.tp > 1 else "")]
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        pp = f"pp {self.pp}"
        if self.pp > 1:
            pp += f" {self.schedule.value}" + (f"×{self.virtual_stages}" if self.interleaving > 1 else "")
        parts += [pp, f"zero {int(self.zero_stage)}", f"micro {self.micro_batch}×{self.microbatches}",
                  f"recompute {self.recompute.value}"]
        return " ".join(parts)


# ----------------------------------------------------------------------------- a spec's layout


class _Parallelism(Protocol):
    @property
    def data(self) -> int: ...
    @property
    def tensor(self) -> int: ...
    @property
    def pipeline(self) -> int: ...


class _Training(Protocol):
    @property
    def micro_batch_size(self) -> int: ...


class SpecLike(Protocol):
    """What :func:`spec_layout` reads (``trainyard_contract.spec.TrainingSpec``)."""

    @property
    def parallelism(self) -> _Parallelism: ...
    @property
    def training(self) -> _Training: ...
    @property
    def grad_accumulation(self) -> int: ...


class LayoutAssumption(StrEnum):
    """What a spec's layout is taken to be where the spec is silent: it names dp x tp x pp, the
    micro-batch and the accumulation, but no ZeRO stage and no recomputation (those are rank settings,
    ``TRAINYARD_SHARDING`` / ``TRAINYARD_ACTIVATION_CHECKPOINTING``)."""

    TRAINER_DEFAULTS = "trainer-defaults"
    """What the trainer runs when nothing else is set: DDP (ZeRO 0) and torch's fused attention, which
    keeps no score matrix, i.e. selective recomputation's activations. The layout to *estimate* a job
    with (the API's submission check and calibration)."""

    MOST_FRUGAL = "most-frugal"
    """The least memory the trainer could run the spec in: ZeRO-3 / FSDP across the data-parallel
    ranks (when there are several) and full recomputation. A *floor*: the scheduler refuses a
    device type only when the gang cannot fit it however it is run."""


def spec_layout(spec: SpecLike, *, assume: LayoutAssumption) -> Layout:
    """The layout of a training spec: its dp x tp x pp, micro-batch and accumulation, with the ZeRO
    stage and recomputation ``assume`` says (see :class:`LayoutAssumption`)."""
    p = spec.parallelism
    if assume is LayoutAssumption.MOST_FRUGAL:
        zero_stage, recompute = (FSDP if p.data > 1 else ZeroStage.NONE), Recompute.FULL
    else:
        zero_stage, recompute = ZeroStage.NONE, Recompute.SELECTIVE
    return Layout(dp=p.data, tp=p.tensor, pp=p.pipeline, zero_stage=zero_stage,
                  micro_batch=spec.training.micro_batch_size, microbatches=spec.grad_accumulation,
                  recompute=recompute)
