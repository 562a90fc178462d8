"""Pipeline parallelism with ``torch.distributed.pipelining`` (runs on gloo and NCCL).

A rank of stage ``s`` keeps layers ``split_layers(n_layers, pp)[s]`` of the model; the other
blocks are replaced by parameterless placeholders, so every kept parameter keeps its plain FQN
and a pipeline checkpoint reshards into any other layout by name. The first stage also keeps the
input embedding, the last the final norm and the output head:

- ``gpt2`` (:class:`GPTStage`): token and position embeddings first; the output head is tied to
  the token embedding, so both stages hold a copy of ``wte`` (initialised identically from the
  seed) and :meth:`ParallelModel.finish_gradients` sums its gradient over the two before the
  optimizer step, so the copies stay identical (Megatron's tied-embedding rule). DCP writes the
  shared entry once.
- ``llama`` (:class:`LlamaStage`): ``embed_tokens`` first, ``norm`` and the untied ``lm_head``
  last, nothing shared. Rotary positions have no parameters: every stage computes the same
  ``cos``/``sin`` tables for the sequence it receives, as the whole model does once.

The step: this rank's ``grad_accumulation`` micro batches, concatenated, are the schedule's
micro batches (1F1B when there are at least as many micro batches as stages, else GPipe); the
schedule scales gradients by ``1 / micro batches``, as the non-pipelined step does. With data
parallelism as well, gradients are averaged over the dp group by one flat all-reduce after the
schedule (DDP cannot wrap a stage: 1F1B runs several forwards before their backwards, which DDP's
reducer refuses). Runs on gloo (CPU) and NCCL alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainyard_trainer.model import GPT, Llama, rotary_tables
from trainyard_trainer.parallel import ParallelPlan


def split_layers(n_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges per stage, as even as possible (earlier stages get the extra layers)."""
    base, extra = divmod(n_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class StageModule(nn.Module, ABC):
    """The part of a model one pipeline stage runs: tokens or hidden states in, hidden states or
    logits out. One subclass per architecture says how (:meth:`run`) and what a stage drops
    (:meth:`drop_unused`)."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.model = model
        self.layers = layers
        self.first = first
        self.last = last
        self.pre_forward: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_forward is not None and not x.is_meta:
            self.pre_forward()
        return self.run(x)

    @abstractmethod
    def run(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's layers (and the embedding / head when it is the first / last)."""

    @staticmethod
    @abstractmethod
    def drop_unused(model: Any, *, first: bool, last: bool) -> None:
        """Remove the modules this stage never runs, so they hold no memory and no optimizer state."""


class GPTStage(StageModule):
    def run(self, x: torch.Tensor) -> torch.Tensor:
        m: Any = self.model  # a GPT whose unused parts may be None (torch types them Tensor | Module)
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = m.drop(m.wte(x) + m.wpe(positions))
        for index in self.layers:
            x = m.blocks[index](x)
        if self.last:
            x = F.linear(m.ln_f(x), m.wte.weight)
        return x

    @staticmethod
    def drop_unused(model: Any, *, first: bool, last: bool) -> None:
        if not first:
            model.wpe = None
        if not (first or last):
            model.wte = None  # the last stage keeps it: the output head is tied to it
        if not last:
            model.ln_f = None


class LlamaStage(StageModule):
    def run(self, x: torch.Tensor) -> torch.Tensor:
        m: Any = self.model  # a Llama whose unused parts may be None
        if self.first:
            x = m.drop(m.embed_tokens(x))
        # Hidden states arrive in the embedding's dtype, so these are the tables Llama.forward builds.
        cos, sin = rotary_tables(x.shape[1], m.config.head_dim, device=x.device, dtype=x.dtype)
        for index in self.layers:
            x = m.blocks[index](x, cos, sin)
        if self.last:
            x = m.lm_head(m.norm(x))
        return x

    @staticmethod
    def drop_unused(model: Any, *, first: bool, last: bool) -> None:
        if not first:
            model.embed_tokens = None
        if not last:
            model.norm = None
            model.lm_head = None


_STAGES: dict[type[nn.Module], type[StageModule]] = {GPT: GPTStage, Llama: LlamaStage}


def ties_embedding(model: nn.Module) -> bool:
    """Whether the output head is the token embedding (first and last stage then share it)."""
    return isinstance(model, GPT)


def keep_stage(model: nn.Module, stage: int, stages: int) -> StageModule:
    """Drop from ``model`` (in place) what stage ``stage`` of ``stages`` does not run."""
    blocks: Any = model.blocks  # an nn.ModuleList (torch types a Module's attributes as Tensor | Module)
    layers = split_layers(len(blocks), stages)[stage]
    first, last = stage == 0, stage == stages - 1
    for index in range(len(blocks)):
        if index not in layers:
            blocks[index] = nn.Identity()
    stage_class = _STAGES[type(model)]
    stage_class.drop_unused(model, first=first, last=last)
    return stage_class(model, layers, first=first, last=last)


def tied_embedding_group(plan: ParallelPlan, rank: int) -> dist.ProcessGroup | None:
    """The group {first stage, last stage} of this rank's (dp, tp) column, for the tied ``wte``.

    Every rank takes part in creating every group (``new_group`` is collective).
    """
    mine = None
    for dp in range(plan.dp):
        for tp in range(plan.tp):
            ranks = sorted({plan.rank_of(0, dp, tp), plan.rank_of(plan.pp - 1, dp, tp)})
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                mine = group
    return mine


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The models' loss: mean token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class PipelineRunner:
    """One pipeline stage and its schedule; :meth:`step` runs forward and backward of one optimizer step."""

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        stages: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        loss_fn: Callable[..., torch.Tensor] | None,
        micro_batches: int,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.stage_index, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        inner: Any = module.module if hasattr(module, "module") else module  # the StageModule, DDP's or not
        self.stage_module: StageModule = inner
        self._seeds: list[int] = []
        inner.pre_forward = self._seed_next
        self.stage = PipelineStage(module, stage, stages, device, group=group)
        schedule = Schedule1F1B if micro_batches >= stages else ScheduleGPipe
        self.schedule = schedule(self.stage, n_microbatches=micro_batches, loss_fn=loss_fn or lm_loss)

    def _seed_next(self) -> None:
        if self._seeds:
            torch.manual_seed(self._seeds.pop(0))

    def step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], *, seeds: list[int] | None, autocast: Any
    ) -> torch.Tensor | None:
        """Forward/backward of this rank's micro batches; the mean micro-batch loss on the last stage."""
        # The stage salt keeps stages' dropout streams apart; forward order per stage is the micro-batch order.
        self._seeds = [s + 7919 * self.stage_index for s in seeds] if seeds else []
        inputs = torch.cat([x for x, _ in batches])
        targets = torch.cat([y for _, y in batches])
        losses: list[torch.Tensor] = []
        with autocast:
            if self.first:
                self.schedule.step(inputs, **({"target": targets, "losses": losses} if self.last else {}))  # type: ignore[arg-type]  # step's own keywords
            elif self.last:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
        if not self.last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()
