"""A training spec's layout under each named assumption (what the spec leaves unsaid)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainyard_planner import FSDP, Layout, LayoutAssumption, Recompute, ZeroStage, spec_layout


def spec(data: int = 1, tensor: int = 1, pipeline: int = 1, micro: int = 2, accumulation: int = 3) -> SimpleNamespace:
    """What spec_layout reads of a TrainingSpec, and nothing else: it reads specs structurally."""
    return SimpleNamespace(parallelism=SimpleNamespace(data=data, tensor=tensor, pipeline=pipeline),
                           training=SimpleNamespace(micro_batch_size=micro), grad_accumulation=accumulation)


@pytest.mark.parametrize(("assume", "data", "zero_stage", "recompute"), [
    # the trainer's defaults: DDP, fused attention (selective recomputation's activations)
    (LayoutAssumption.TRAINER_DEFAULTS, 1, ZeroStage.NONE, Recompute.SELECTIVE),
    (LayoutAssumption.TRAINER_DEFAULTS, 4, ZeroStage.NONE, Recompute.SELECTIVE),
    # the floor: FSDP across several data-parallel ranks (nothing to shard over one), full recomputation
    (LayoutAssumption.MOST_FRUGAL, 1, ZeroStage.NONE, Recompute.FULL),
    (LayoutAssumption.MOST_FRUGAL, 4, FSDP, Recompute.FULL),
])
def test_the_assumption_fills_in_what_the_spec_does_not_say(assume: LayoutAssumption, data: int,
                                                            zero_stage: ZeroStage, recompute: Recompute) -> None:
    layout = spec_layout(spec(data=data, tensor=2, pipeline=3, micro=2, accumulation=5), assume=assume)
    assert layout == Layout(dp=data, tp=2, pp=3, zero_stage=zero_stage, micro_batch=2, microbatches=5,
                            recompute=recompute)


def test_the_frugal_layout_never_needs_more_memory_than_the_trainers() -> None:
    from trainyard_planner import Transformer, estimate_memory

    model = Transformer.from_parameters(7e9, seq_len=2048)
    for data in (1, 2, 8):
        s = spec(data=data, micro=4, accumulation=1)
        frugal = estimate_memory(model, spec_layout(s, assume=LayoutAssumption.MOST_FRUGAL))
        trainer = estimate_memory(model, spec_layout(s, assume=LayoutAssumption.TRAINER_DEFAULTS))
        assert frugal.used_bytes_per_device <= trainer.used_bytes_per_device
