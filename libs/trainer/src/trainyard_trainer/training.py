"""The training loop of one rank, nanoGPT-style: read it top to bottom.

``train(job, spool)`` runs in phases: 1. data 2. model, optimizer, schedule 3. restore
from the start checkpoint (verified) 4. steps, each followed by a checkpoint when due
and a StepMetrics event. Errors leave as exceptions of trainyard's tree; ``__main__``
turns them into exit codes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from opentelemetry import trace
from torch.distributed.checkpoint.stateful import Stateful

from trainyard_common.catalog import ModelConfig, resolve_model
from trainyard_common.errors import CheckpointError, ConfigError, DataError, NonFiniteError
from trainyard_common.events import GangAllocated, ShardWritten, StepMetrics
from trainyard_common.spec import TrainingSpec
from trainyard_common.spool import SpoolWriter
from trainyard_common.storage import ArtifactLayout
from trainyard_common.tracing import current_traceparent

from trainyard_trainer.checkpoint import (
    CheckpointSchedule,
    SavedShard,
    check_restorable,
    load_checkpoint,
    read_checkpoint_manifest,
    save_checkpoint,
    verified_checkpoint_dir,
)
from trainyard_trainer.data import MANIFEST_FILE, TokenDataset
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import CollectiveTimer, apply_ddp
from trainyard_trainer.runtime import Runtime
from trainyard_trainer.sampler import BatchLoader, GlobalSampler
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard_trainer.settings import RankSettings
from trainyard_trainer.state import Progress, RngState, checkpoint_state

log = logging.getLogger("trainyard_trainer")
_tracer = trace.get_tracer("trainyard_trainer")


@dataclass(frozen=True)
class Job:
    """Everything a rank knows about its job, resolved and checked once."""

    settings: RankSettings
    allocation: GangAllocated
    model_config: ModelConfig
    runtime: Runtime

    @property
    def spec(self) -> TrainingSpec:
        return self.allocation.spec

    @property
    def dp(self) -> int:
        return self.spec.parallelism.data

    @property
    def tokens_per_step(self) -> int:
        return self.spec.training.global_batch_size * self.spec.training.sequence_length


def resolve_job(settings: RankSettings, allocation: GangAllocated, runtime: Runtime) -> Job:
    """Check the allocation against this rank's environment and the spec against what we support."""
    spec = allocation.spec
    if (allocation.job_id, allocation.attempt) != (settings.job_id, settings.attempt):
        raise ConfigError(
            f"allocation file is for job {allocation.job_id} attempt {allocation.attempt}, "
            f"the environment says {settings.job_id} attempt {settings.attempt}"
        )
    if allocation.world_size != settings.world_size:
        raise ConfigError(f"allocation has world size {allocation.world_size}, WORLD_SIZE is {settings.world_size}")
    if spec.parallelism.tensor != 1 or spec.parallelism.pipeline != 1:
        raise ConfigError("tensor and pipeline parallelism are not supported by this trainer yet")
    if spec.parallelism.data != settings.world_size:
        raise ConfigError(f"parallelism.data {spec.parallelism.data} != WORLD_SIZE {settings.world_size}")
    ref = spec.model_config_ref
    try:
        config = resolve_model(ref) if isinstance(ref, str) else ref
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    if spec.training.sequence_length > config.max_seq_len:
        raise ConfigError(
            f"training.sequenceLength {spec.training.sequence_length} exceeds the model's maxSeqLen {config.max_seq_len}"
        )
    return Job(settings=settings, allocation=allocation, model_config=config, runtime=runtime)


def build_optimizer(model: torch.nn.Module, spec: TrainingSpec) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum = beta1); weight decay on matrices and embeddings only."""
    opt = spec.training.optimizer
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    lr = spec.training.learning_rate
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=opt.beta1)
    return torch.optim.AdamW(groups, lr=lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)


# ----------------------------------------------------------------------------- one step


@dataclass
class StepTimes:
    data_wait: float = 0.0
    compute: float = 0.0
    collective: float = 0.0
    checkpoint: float = 0.0


@dataclass
class StepOutcome:
    loss: float
    grad_norm: float
    lr: float
    times: StepTimes = field(default_factory=StepTimes)


def train_step(
    ddp: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    runtime: Runtime,
    timer: CollectiveTimer,
    grad_clip: float | None,
    world_size: int,
    clock: Callable[[], float] = time.perf_counter,
) -> StepOutcome:
    """Forward/backward over this rank's micro batches, synchronise, check, update.

    Each micro-batch loss is a mean over its tokens; dividing by the number of micro steps and
    letting DDP average over ranks makes the gradient that of the mean loss over the global
    batch. Gradients are all-reduced only on the last micro step (``no_sync`` before it).
    """
    started = clock()
    accumulation = len(batches)
    loss_sum = torch.zeros((), device=runtime.device)
    timer.reset()
    for k, (inputs, targets) in enumerate(batches):
        sync = k == accumulation - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            with runtime.autocast():
                _, loss = ddp(inputs, targets)
            (loss / accumulation).backward()
        loss_sum += loss.detach()
    backward_end = clock()
    exposed = timer.exposed_seconds(backward_end)

    grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), grad_clip if grad_clip else math.inf)
    reduce_started = clock()
    global_loss = loss_sum / accumulation
    dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)
    loss_value = global_loss.item() / world_size
    reduce_seconds = clock() - reduce_started
    norm_value = grad_norm.item()
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        raise NonFiniteError(f"loss {loss_value} / grad norm {norm_value} is not finite")

    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    total = clock() - started
    collective = exposed + reduce_seconds
    return StepOutcome(
        loss=loss_value, grad_norm=norm_value, lr=float(lr),
        times=StepTimes(compute=max(0.0, total - collective), collective=collective),
    )


# ----------------------------------------------------------------------------- the loop


def train(job: Job, spool: SpoolWriter) -> Progress:
    """Train from the start checkpoint (or step 0) to ``maxSteps``; returns the final counters."""
    settings, spec, runtime = job.settings, job.spec, job.runtime
    training = spec.training
    rank, world = settings.rank, settings.world_size

    # 1. data
    layout = ArtifactLayout(settings.artifact_root)
    name, version = spec.dataset.split("@", 1)
    dataset = TokenDataset(layout.dataset_dir(name, version) / MANIFEST_FILE, training.sequence_length)
    if dataset.manifest.tokenizer.vocab_size > job.model_config.vocab_size:
        raise DataError(
            f"dataset {spec.dataset} has a vocabulary of {dataset.manifest.tokenizer.vocab_size}, "
            f"the model only {job.model_config.vocab_size}"
        )
    sampler = GlobalSampler(
        len(dataset), seed=training.seed, global_batch=training.global_batch_size,
        micro_batch=training.micro_batch_size, dp=job.dp, dp_rank=rank,
    )
    loader = BatchLoader(dataset, sampler, runtime.device)

    # 2. model, optimizer, schedule
    model = build_model(job.model_config, seed=training.seed, device=runtime.device)
    timer = CollectiveTimer()
    ddp = apply_ddp(model, device=runtime.device, timer=timer)
    optimizer = build_optimizer(model, spec)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=training.lr_schedule, max_steps=training.max_steps)
    progress = Progress()
    state = checkpoint_state(
        model=ddp, optimizer=optimizer, lr_scheduler=lr_scheduler, sampler=sampler,
        progress=progress, rng=RngState(rank, runtime.device, seed=training.seed),
    )
    log.info("model %s: %d parameters; dataset %s: %d samples of %d tokens; %d ranks x %d micro x %d accumulation",
             spec.model_config_ref if isinstance(spec.model_config_ref, str) else "inline",
             model.num_parameters(), spec.dataset, len(dataset), training.sequence_length + 1,
             world, training.micro_batch_size, spec.grad_accumulation)

    # 3. restore
    if (ref := job.allocation.start_checkpoint) is not None:
        manifest = read_checkpoint_manifest(ref)
        if problems := check_restorable(manifest, world_size=world, spec_hash=job.allocation.spec_hash):
            raise CheckpointError(f"cannot resume from {ref.manifest_uri}: " + "; ".join(problems))
        directory = verified_checkpoint_dir(manifest, ref.manifest_uri)
        load_checkpoint(state, directory)
        log.info("resumed from %s at step %d (%d tokens consumed)",
                 ref.manifest_uri, progress.global_step, progress.consumed_tokens)

    # 4. steps
    policy = spec.checkpoint_policy
    schedule = CheckpointSchedule(
        max_steps=training.max_steps, every_steps=policy.every_steps, every_minutes=policy.every_minutes,
        last_save_at=time.monotonic(),
    )
    ddp.train()
    while progress.global_step < training.max_steps:
        step_started = time.perf_counter()
        batches = loader.next_step()
        data_wait = time.perf_counter() - step_started
        outcome = train_step(
            ddp, optimizer, lr_scheduler, batches, runtime=runtime, timer=timer,
            grad_clip=training.grad_clip, world_size=world,
        )
        outcome.times.data_wait = data_wait
        progress.advance(samples=training.global_batch_size, tokens=job.tokens_per_step)
        if _checkpoint_due(schedule, progress.global_step, runtime):
            saved = _save_and_report(job, state, progress, spool, layout)
            schedule.saved(time.monotonic())
            outcome.times.checkpoint = saved.seconds
        _report_step(job, progress, outcome, time.perf_counter() - step_started, spool)
    return progress


def _checkpoint_due(schedule: CheckpointSchedule, step: int, runtime: Runtime) -> bool:
    due = schedule.due(step, time.monotonic())
    if not schedule.needs_agreement or step >= schedule.max_steps:
        return due
    flag = torch.tensor([1 if due else 0], device=runtime.device)
    dist.broadcast(flag, src=0)  # rank 0's clock decides for everyone
    return bool(flag.item())


def _save_and_report(
    job: Job, state: Mapping[str, Stateful], progress: Progress, spool: SpoolWriter, layout: ArtifactLayout
) -> SavedShard:
    settings = job.settings
    directory = layout.checkpoint_dir(settings.tenant, settings.job_id, settings.attempt, progress.global_step)
    with _tracer.start_as_current_span(
        "checkpoint save",
        attributes={"trainyard.job_id": settings.job_id, "trainyard.rank": settings.rank,
                    "trainyard.global_step": progress.global_step, "trainyard.attempt": settings.attempt},
    ) as span:
        saved = save_checkpoint(state, directory, rank=settings.rank, barrier=dist.barrier)
        span.set_attribute("trainyard.shard_bytes", saved.shard.size_bytes)
        spool.write(
            ShardWritten(
                job_id=settings.job_id, tenant=settings.tenant, attempt=settings.attempt, epoch=settings.epoch,
                global_step=progress.global_step, rank=settings.rank, world_size=settings.world_size,
                uri=saved.shard.uri, size_bytes=saved.shard.size_bytes, sha256=saved.shard.sha256,
                extra_files=saved.extra_files, consumed_tokens=progress.consumed_tokens,
                consumed_samples=progress.consumed_samples, spec_hash=job.allocation.spec_hash,
                parallelism={"dp": job.dp, "tp": 1, "pp": 1},
            ),
            traceparent=current_traceparent(),
        )
    log.info("checkpoint step %d: %s (%d bytes, %.2fs)", progress.global_step, saved.shard.uri,
             saved.shard.size_bytes, saved.seconds)
    return saved


def _report_step(job: Job, progress: Progress, outcome: StepOutcome, seconds: float, spool: SpoolWriter) -> None:
    settings, times = job.settings, outcome.times
    tokens_per_second = job.tokens_per_step / seconds if seconds > 0 else None
    spool.write(
        StepMetrics(
            job_id=settings.job_id, tenant=settings.tenant, attempt=settings.attempt, rank=settings.rank,
            step=progress.global_step, max_steps=job.spec.training.max_steps, loss=outcome.loss, lr=outcome.lr,
            consumed_tokens=progress.consumed_tokens, consumed_samples=progress.consumed_samples,
            tokens_per_second=tokens_per_second, step_seconds=seconds, compute_seconds=times.compute,
            collective_seconds=times.collective, data_wait_seconds=times.data_wait,
            checkpoint_seconds=times.checkpoint,
        ),
        traceparent=current_traceparent(),
    )
    log.info("step %d/%d loss %.4f lr %.3g grad-norm %.3f %.0f tok/s (data %.3fs compute %.3fs comm %.3fs ckpt %.3fs)",
             progress.global_step, job.spec.training.max_steps, outcome.loss, outcome.lr, outcome.grad_norm,
             tokens_per_second or 0.0, times.data_wait, times.compute, times.collective, times.checkpoint)
