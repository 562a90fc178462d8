"""Parallelism applied to a model from outside (torchtitan style); a network never knows how it is split.

A run's layout is a :class:`ParallelPlan` (pure, checked once): ``world = pp x dp x tp``, laid out
on a device mesh ``(pp, dp, tp)`` with ``tp`` innermost so that a tensor-parallel group is a run
of consecutive ranks, i.e. inside one node. Then :func:`parallelize` applies, in this order:

1. pipeline split (``pp > 1``): this rank keeps only its stage's layers (:mod:`.pipeline`);
2. tensor parallelism (``tp > 1``): attention and MLP of every block through DTensor
   ``parallelize_module`` (QKV and MLP-in column-wise, the two output projections row-wise);
3. activation checkpointing: every block recomputes its activations in the backward pass;
4. data parallelism over the ``dp`` mesh dimension, by ``sharding``:

   ========  =======================================================  ==========================
   sharding  what is sharded across dp ranks                          how
   ========  =======================================================  ==========================
   ddp       nothing (ZeRO-0): gradients all-reduced                   ``DistributedDataParallel`` (with
                                                                     pipeline stages: one flat all-reduce
                                                                     after the schedule)
   zero1     optimizer state                                           DDP + ``ZeroRedundancyOptimizer``
   zero2     optimizer state + gradients (params gathered once/step)   FSDP2 ``reshard_after_forward=False``
   fsdp      optimizer state + gradients + parameters (ZeRO-3)         FSDP2 ``fully_shard`` per block
   ========  =======================================================  ==========================

:class:`ParallelModel` carries the result and the few operations the loop needs that depend on it
(no-sync micro steps, the global gradient norm, the global loss).
"""

# No ``from __future__ import annotations`` here: DDP checks the comm hook's annotations
# against the real classes (``dist.GradBucket``), not their string forms.
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import ConfigError

Sharding = Literal["ddp", "zero1", "zero2", "fsdp"]
ZERO_STAGE: dict[str, int] = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}


# ----------------------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class ParallelPlan:
    """How one attempt splits the model and the batch over its ``world = pp * dp * tp`` ranks."""

    dp: int
    tp: int = 1
    pp: int = 1
    sharding: str = "ddp"
    activation_checkpointing: bool = False
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def zero_stage(self) -> int:
        return ZERO_STAGE[self.sharding]

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` coordinates of ``rank`` on the mesh (tp innermost)."""
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return pp, dp, tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def describe(self) -> str:
        parts = [f"dp {self.dp} ({self.sharding}, ZeRO-{self.zero_stage})", f"tp {self.tp}", f"pp {self.pp}"]
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        return ", ".join(parts)


def resolve_plan(
    *,
    world_size: int,
    local_world_size: int,
    tensor: int,
    pipeline: int,
    sharding: str,
    activation_checkpointing: bool,
    config: ModelConfig,
) -> ParallelPlan:
    """The plan for a world of ``world_size`` ranks; ConfigError naming the numbers when impossible.

    ``dp = world_size / (tensor * pipeline)``: the data-parallel size follows the world this
    attempt was given, which may differ from the spec's ``parallelism.data`` (elastic resume).
    """
    if sharding not in ZERO_STAGE:
        raise ConfigError(f"TRAINYARD_SHARDING={sharding!r}; expected one of {', '.join(ZERO_STAGE)}")
    model_parallel = tensor * pipeline
    if world_size % model_parallel:
        raise ConfigError(
            f"WORLD_SIZE {world_size} is not a multiple of parallelism.tensor {tensor} x parallelism.pipeline "
            f"{pipeline} = {model_parallel}"
        )
    dp = world_size // model_parallel
    notes: list[str] = []
    if pipeline > 1:
        if pipeline > config.n_layers:
            raise ConfigError(f"parallelism.pipeline {pipeline} exceeds the model's {config.n_layers} layers")
        if tensor > 1 and dp > 1:
            raise ConfigError("pipeline with both tensor and data parallelism (3-D) is not supported by this trainer")
        if sharding != "ddp":
            raise ConfigError(
                f"parallelism.pipeline {pipeline} runs with sharding ddp only (asked: {sharding}); pipeline stages "
                "with ZeRO/FSDP sharding are not wired in this trainer"
            )
    if tensor > 1:
        if config.n_heads % tensor or config.kv_heads % tensor or config.ffn_width % tensor:
            kv = f", nKvHeads ({config.kv_heads})" if config.kv_heads != config.n_heads else ""
            raise ConfigError(
                f"parallelism.tensor {tensor} must divide the model's nHeads ({config.n_heads}){kv} and FFN "
                f"width ({config.ffn_width}): each rank computes whole query and key/value heads"
            )
        if tensor > local_world_size or local_world_size % tensor:
            raise ConfigError(
                f"parallelism.tensor {tensor} must divide the {local_world_size} ranks of a node: tensor-parallel "
                "groups stay inside one node (their all-reduces are on the critical path of every layer)"
            )
        if dp > 1 and ZERO_STAGE[sharding] < 2:
            notes.append(
                f"sharding {sharding} -> fsdp: with tensor parallelism the parameters are DTensors, which DDP "
                "cannot all-reduce, so the dp dimension is sharded with FSDP2"
            )
            sharding = "fsdp"
    return ParallelPlan(dp=dp, tp=tensor, pp=pipeline, sharding=sharding,
                        activation_checkpointing=activation_checkpointing, notes=tuple(notes))


def build_mesh(plan: ParallelPlan, device_type: str) -> Any:
    """The ``(pp, dp, tp)`` device mesh over the initialised world (one sub-group per dimension)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (plan.pp, plan.dp, plan.tp), mesh_dim_names=("pp", "dp", "tp"))


# ----------------------------------------------------------------------------- collective timing


class CollectiveTimer:
    """Measures how long a backward pass waits on the gradient all-reduce.

    DDP overlaps bucket all-reduces with the backward computation; the bucket holding the
    first layers is launched last, when their gradients are ready, i.e. when the local
    computation is over. ``exposed_seconds(backward_end)`` is the time from that last
    launch until ``backward()`` returned: communication the computation did not hide.

    The launch is marked by a hook on each parameter's gradient accumulation (:meth:`watch`):
    DDP launches a bucket's all-reduce as its last gradient is accumulated, in the backward's
    own thread. A DDP communication hook would see the launch directly, but a Python one costs
    every step (its future's callback takes the GIL on gloo's thread while the backward runs);
    this keeps DDP's built-in C++ all-reduce. On CUDA the launch is marked with an event on the
    compute stream (host time would run ahead of the device), and :meth:`exposed_seconds`
    measures from it to an event recorded when the backward pass, all-reduces included, is over.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.last_launch: float | None = None
        self.last_event: Any = None
        self._launch_event: Any = None

    def reset(self) -> None:
        self.last_launch = None
        self.last_event = None

    def mark_launch(self, device: torch.device | None = None) -> None:
        self.last_launch = time.perf_counter()
        if device is not None and device.type == "cuda":
            if self._launch_event is None:
                self._launch_event = torch.cuda.Event(enable_timing=True)
            self._launch_event.record()  # re-recorded: the latest launch is the one that counts
            self.last_event = self._launch_event

    def exposed_seconds(self, backward_end: float) -> float:
        if self.last_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return max(0.0, self.last_event.elapsed_time(end) / 1000.0)
        return 0.0 if self.last_launch is None else max(0.0, backward_end - self.last_launch)

    def watch(self, parameters: Iterable[torch.Tensor]) -> None:
        """Mark a launch whenever one of ``parameters`` has its gradient accumulated."""
        for param in parameters:
            if param.requires_grad:
                device = param.device
                param.register_post_accumulate_grad_hook(lambda _p, device=device: self.mark_launch(device))


# ----------------------------------------------------------------------------- the wrappers


def apply_ddp(
    model: torch.nn.Module,
    *,
    device: torch.device,
    timer: CollectiveTimer | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over ``process_group`` (default: the world); parameters are
    broadcast from rank 0 and gradients averaged across ranks in each synchronising backward."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
    )
    if timer is not None:
        timer.process_group = process_group
        timer.watch(model.parameters())
    return ddp


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks this rank holds (a pipeline stage replaces the others by parameterless placeholders)."""
    blocks: Any = model.blocks  # an nn.ModuleList (torch types a Module's attributes as Tensor | Module)
    return [b for b in blocks if any(True for _ in b.parameters())]


def apply_fsdp(model: nn.Module, dp_mesh: Any, *, reshard_after_forward: bool) -> nn.Module:
    """FSDP2 over ``dp_mesh``: each block its own unit (all-gathered just in time), the rest in the root.

    ``reshard_after_forward=True`` frees a block's gathered parameters after its forward and
    gathers them again for the backward (ZeRO-3); ``False`` keeps them until the backward has
    used them (ZeRO-2: one gather per step, gradients and optimizer state still sharded).
    """
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # The root holds the tied embedding / output head, the positions and the final norm.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


# Per architecture, a block's projections split by output columns and by input rows.
_TP_COLUMNS = {
    "gpt2": ("attn.qkv", "mlp.fc"),
    "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
}
_TP_ROWS = {
    "gpt2": ("attn.out", "mlp.proj"),
    "llama": ("self_attn.o_proj", "mlp.down_proj"),
}


def tp_block_plan(architecture: str) -> dict[str, Any]:
    """The ``parallelize_module`` plan of one block of ``architecture``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{name: ColwiseParallel() for name in _TP_COLUMNS[architecture]},
            **{name: RowwiseParallel() for name in _TP_ROWS[architecture]}}


def apply_tp(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Megatron-style tensor parallelism of attention and MLP in every block (inside one node).

    The projections into attention and into the MLP are split by output columns, the attention
    output and MLP output projections by input rows; each block therefore does one all-reduce
    after attention and one after the MLP, forward and backward. Column splits hand each rank
    whole heads: GPT's fused head-major QKV (see ``CausalSelfAttention``); llama's q, k and v
    separately, ``nHeads / tp`` query heads and ``nKvHeads / tp`` key/value heads, which are the
    very kv heads its query heads share (``resolve_plan`` makes ``tp`` divide both). Attention
    reads its local head counts from the widths it holds; SwiGLU's gate and up split alike, so
    their product is elementwise per rank. Embeddings, norms and the output head (tied or not)
    stay replicated.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    config: Any = model.config  # the catalog's ModelConfig (torch types a Module's attributes as Tensor | Module)
    plan = tp_block_plan(config.architecture)
    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, plan)
    return model


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Wrap every block so its activations are recomputed in the backward pass (non-reentrant).

    The wrapper's ``_checkpoint_wrapped_module`` prefix is stripped by DCP's state-dict helpers,
    so checkpoints keep the model's plain FQNs. Dropout masks are replayed exactly (the RNG
    state is saved with the recomputed segment).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    blocks: Any = model.blocks  # an nn.ModuleList
    for index, block in enumerate(blocks):
        if any(True for _ in block.parameters()):
            blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


# ----------------------------------------------------------------------------- gradient norm


def _by_layout(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped so that each group's gradients are all plain tensors or all DTensors of one mesh."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        key = id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    group: dist.ProcessGroup | None = None,
    exclude_from_norm: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """The global L2 norm of the gradients, clipped to ``max_norm`` (None: measure only).

    Works across every layout: DTensor gradients (FSDP shards, TP shards, both on a 2-D mesh)
    are reduced over their own mesh by ``full_tensor``, one mesh at a time; plain gradients are
    whole on every rank; with pipeline stages each stage's sum of squares is added up over
    ``group``. ``exclude_from_norm`` names a gradient another stage already counts (the tied
    embedding on the last stage).
    """
    params = [p for p in parameters if p.grad is not None]
    excluded = {id(p) for p in exclude_from_norm}
    squares: torch.Tensor | None = None
    for layout in _by_layout([p for p in params if id(p) not in excluded]):
        norm = torch.nn.utils.get_total_norm([p.grad for p in layout if p.grad is not None], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = norm.float() ** 2 if squares is None else squares + norm.float() ** 2
    if squares is None:
        device = params[0].device if params else torch.device("cpu")
        squares = torch.zeros((), device=device)
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if max_norm is not None:
        for layout in _by_layout(params):
            torch.nn.utils.clip_grads_with_norm_(layout, max_norm, total)
    return total


def all_reduce_gradients(parameters: Iterable[torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
    """Average plain gradients over ``group`` in one flat all-reduce per dtype (DDP's arithmetic:
    divide by the group size, then sum), for layouts DDP cannot wrap (pipeline stages)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        flat.div_(size)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)


# ----------------------------------------------------------------------------- the result


@dataclass
class ParallelModel:
    """A network (GPT or Llama) with parallelism applied, and what the training step needs to know of it.

    ``model`` is the bare network (its FQNs name the checkpoint's entries); ``module`` is what the
    forward pass is called on (the DDP wrapper, the FSDP/TP-transformed network itself, …).
    """

    model: nn.Module
    module: nn.Module
    plan: ParallelPlan
    rank: int = 0
    timer: CollectiveTimer = field(default_factory=CollectiveTimer)
    pipeline: Any = None  # a pipeline.PipelineRunner when pp > 1
    pp_group: dist.ProcessGroup | None = None
    tied_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None  # set when gradients are averaged by hand (pipeline stages)
    device: torch.device = torch.device("cpu")

    @property
    def pp_rank(self) -> int:
        return self.plan.coordinates(self.rank)[0]

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.plan.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager[Any]:
        """DDP skips the all-reduce on all but the last micro step; FSDP reduce-scatters every one
        (the gradients stay sharded between micro steps, which is the point of ZeRO-2/3)."""
        if not last_micro_step and isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return contextlib.nullcontext()

    def finish_gradients(self) -> None:
        """Pipeline stages: average gradients over the dp group (DDP cannot wrap a stage that runs
        several forwards before its backwards), then sum the tied embedding's gradient over the
        first and last stage (Megatron-style)."""
        if self.dp_group is not None:
            all_reduce_gradients(self.model.parameters(), self.dp_group, self.plan.dp)
        wte: Any = getattr(self.model, "wte", None)  # GPT's tied embedding; None on a middle stage
        if self.tied_group is not None and wte is not None:
            grad = wte.weight.grad
            if grad is not None:
                dist.all_reduce(grad, group=self.tied_group)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        exclude: list[torch.Tensor] = []
        if self.tied_group is not None and self.is_last_stage and not self.is_first_stage:
            wte: Any = getattr(self.model, "wte")  # noqa: B009 - GPT's tied embedding, on a last stage
            exclude = [wte.weight]  # counted on the first stage
        return clip_grad_norm(self.model.parameters(), max_norm, group=self.pp_group, exclude_from_norm=exclude)

    def global_mean_loss(self, local_mean: torch.Tensor | None) -> "PendingLoss":
        """The mean loss over the global batch, reduced in the background (``.wait()`` for it): dp
        ranks' means averaged; with pipeline stages only the last stage has a loss; tensor-parallel
        peers hold the same value (counted once). Started before the optimizer update, it is
        there when the update is done, so reporting the global loss holds no step up."""
        _, _, tp_rank = self.plan.coordinates(self.rank)
        contributes = local_mean is not None and self.is_last_stage and tp_rank == 0
        value = (local_mean.detach().float() / self.plan.dp if contributes and local_mean is not None
                 else torch.zeros((), device=self.device))
        value = value.to(self.device).reshape(())
        if dist.is_initialized() and dist.get_world_size() > 1:
            return PendingLoss(value, dist.all_reduce(value, async_op=True))
        return PendingLoss(value)


class PendingLoss:
    """A loss whose all-reduce may still be in flight."""

    def __init__(self, value: torch.Tensor, work: Any = None) -> None:
        self._value = value
        self._work = work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._value

def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    *,
    rank: int,
    device: torch.device,
    mesh: Any = None,
    timer: CollectiveTimer | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    micro_batches: int = 1,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` (in place) in the order of the module docstring."""
    timer = timer or CollectiveTimer()
    pp_rank, _, _ = plan.coordinates(rank)
    stage_module = None
    if plan.pp > 1:
        from trainyard_trainer.pipeline import keep_stage

        stage_module = keep_stage(model, pp_rank, plan.pp)
    if plan.tp > 1:
        apply_tp(model, mesh["tp"])
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model)
    dp_group = mesh["dp"].get_group() if mesh is not None and plan.world_size > 1 else None
    if plan.zero_stage >= 2:
        apply_fsdp(model, mesh["dp"], reshard_after_forward=plan.zero_stage == 3)
    module: nn.Module = stage_module if stage_module is not None else model
    if plan.zero_stage < 2 and plan.tp == 1 and plan.pp == 1:
        module = apply_ddp(module, device=device, timer=timer, process_group=dp_group)
    result = ParallelModel(model=model, module=module, plan=plan, rank=rank, timer=timer, device=device)
    if plan.pp > 1 and plan.dp > 1:
        result.dp_group = dp_group
    if plan.pp > 1:
        from trainyard_trainer.pipeline import PipelineRunner, ties_embedding, tied_embedding_group

        result.pp_group = mesh["pp"].get_group()
        if ties_embedding(model):  # llama's output head is its own parameter, on the last stage only
            result.tied_group = tied_embedding_group(plan, rank)
        result.pipeline = PipelineRunner(
            module, stage=pp_rank, stages=plan.pp, device=device, group=result.pp_group,
            loss_fn=loss_fn, micro_batches=micro_batches,
        )
    return result
