"""A parallel layout: how one training step is split over devices.

``world = dp x tp x pp`` and ``global batch = micro_batch x dp x microbatches`` (the seed's
``micro_batch_per_gpu x data_parallel_size x gradient_accumulation_steps``). Ranks are ordered
tensor-fastest, then data, then pipeline (Megatron-LM's order), which decides what link each
group's collectives cross.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Protocol

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

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.dp * self.microbatches

    @property
    def interleaving(self) -> int:
        """Model chunks per device that the schedule actually uses (1 unless interleaved)."""
        return self.virtual_stages if self.schedule is Schedule.INTERLEAVED else 1

    def describe(self) -> str:
        """A short human label, e.g. ``dp 8 tp 1 pp 1 zero 3 micro 2 recompute none``."""
        return (f"dp {self.dp} tp {self.tp} pp {self.pp} zero {int(self.zero_stage)} "
                f"micro {self.micro_batch} recompute {self.recompute.value}")


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
