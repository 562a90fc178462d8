"""The built-in trainer's loop, nanoGPT-style, on the rank SDK (:mod:`trainyard`): read it top to bottom.

``train(job, run)`` runs in phases: 0. the distributed context (the run's control groups plus
the device mesh, every rank's host) 1. data (the run's loader over the spec's dataset) 2. model,
parallelism, optimizer, schedule 3. peak FLOP/s 4. restore (``run.restore``: verified, with
fallback to an earlier READY one) and the run record 5. steps: each is ``train_step``, then
``run.checkpoint`` (the one agreement of all ranks: due? requested? the pending save done?) and
``run.report`` (StepMetrics). Asked to checkpoint and stop, the ranks save that step, wait until
it is durable and stop with :class:`StoppedOnRequest` (exit 7). Errors leave as exceptions of
trainyard's tree; ``__main__`` (through ``Run.finish``) turns them into exit codes.

The checkpoint / metrics / stop protocol is the SDK's, the same one user scripts get; what is
the trainer's own is the GPT, its parallelism and the run record.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainyard import Run
from trainyard.checkpoint import NoVerifiedCheckpointError, SavedShard
from trainyard.context import Context
from trainyard.exits import exit_code_for
from trainyard.loader import DataLoader
from trainyard.metrics import PeakFlops, flops_per_token
from trainyard.policy import BoundaryAgreement, checkpoint_policy
from trainyard.preemption import StoppedOnRequest
from trainyard.restore import refused_records, report_refusals
from trainyard.runrecord import (
    RUN_RECORD_FILE,
    BatchRecord,
    CheckpointRecord,
    Environment,
    ParallelRecord,
    ProgressRecord,
    RestoreRecord,
    RunRecord,
    StopRecord,
    ThroughputRecord,
    cpu_threads_change,
    local_environment,
)
from trainyard.runtime import Runtime
from trainyard.sampler import BatchLayout, batch_layout, micro_batch_seed
from trainyard.settings import RankSettings
from trainyard.state import Progress, checkpoint_state
from trainyard.timing import StepTimes
from trainyard_contract.catalog import ModelConfig, resolve_model
from trainyard_contract.errors import ConfigError, DataError, NonFiniteError
from trainyard_contract.events import GangAllocated, StepMetrics
from trainyard_contract.spec import TrainingSpec

from trainyard_trainer.evaluation import evaluate, held_out_samples
from trainyard_trainer.hfstart import maybe_init_from_hugging_face
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import (
    CollectiveTimer,
    ParallelModel,
    ParallelPlan,
    build_mesh,
    parallelize,
    resolve_plan,
)
from trainyard_trainer.pipeline import lm_loss
from trainyard_trainer.schedule import build_lr_scheduler

__all__ = [
    "BoundaryAgreement",
    "Context",
    "Job",
    "NonFiniteError",
    "StepOutcome",
    "StepTimes",
    "build_optimizer",
    "checkpoint_policy",
    "report_refusals",
    "resolve_job",
    "train",
    "train_step",
]

log = logging.getLogger("trainyard_trainer")


@dataclass(frozen=True)
class Job:
    """Everything a rank knows about its job, resolved and checked once."""

    settings: RankSettings
    allocation: GangAllocated
    model_config: ModelConfig
    runtime: Runtime
    plan: ParallelPlan = field(default_factory=lambda: ParallelPlan(dp=1))
    batch: BatchLayout | None = None

    @property
    def spec(self) -> TrainingSpec:
        return self.allocation.spec

    @property
    def dp(self) -> int:
        return self.plan.dp

    @property
    def tokens_per_step(self) -> int:
        return self.spec.training.global_batch_size * self.spec.training.sequence_length


def resolve_job(settings: RankSettings, allocation: GangAllocated, runtime: Runtime) -> Job:
    """Check the allocation against this rank's environment and the spec against what we support.

    The world may differ from the spec's ``parallelism.data * tensor * pipeline``: the data-parallel
    size is ``WORLD_SIZE / (tensor * pipeline)`` and the gradient accumulation follows from the
    spec's global batch, which stays what it was (elastic resume).
    """
    spec = allocation.spec
    if (allocation.job_id, allocation.attempt) != (settings.job_id, settings.attempt):
        raise ConfigError(
            f"allocation file is for job {allocation.job_id} attempt {allocation.attempt}, "
            f"the environment says {settings.job_id} attempt {settings.attempt}"
        )
    if allocation.world_size != settings.world_size:
        raise ConfigError(f"allocation has world size {allocation.world_size}, WORLD_SIZE is {settings.world_size}")
    ref = spec.model_config_ref
    try:
        config = resolve_model(ref) if isinstance(ref, str) else ref
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    if spec.training.sequence_length > config.max_seq_len:
        raise ConfigError(
            f"training.sequenceLength {spec.training.sequence_length} exceeds the model's maxSeqLen "
            f"{config.max_seq_len}"
        )
    plan = resolve_plan(
        world_size=settings.world_size, local_world_size=settings.local_world_size,
        tensor=spec.parallelism.tensor, pipeline=spec.parallelism.pipeline, sharding=settings.sharding,
        activation_checkpointing=settings.activation_checkpointing, config=config,
    )
    batch = batch_layout(
        global_batch=spec.training.global_batch_size, micro_batch=spec.training.micro_batch_size,
        dp=plan.dp, spec_dp=spec.parallelism.data, sequence_length=spec.training.sequence_length,
    )
    return Job(settings=settings, allocation=allocation, model_config=config, runtime=runtime, plan=plan, batch=batch)


def build_optimizer(
    model: torch.nn.Module, spec: TrainingSpec, *, sharding: str = "ddp", process_group: Any = None
) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum = beta1); weight decay on matrices and embeddings only.

    ``sharding="zero1"`` wraps it in ``ZeroRedundancyOptimizer`` over ``process_group`` (the dp
    group): each rank keeps and updates the state of its partition, then broadcasts its parameters.
    """
    opt = spec.training.optimizer
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    lr = spec.training.learning_rate
    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    if opt.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": lr, "momentum": opt.beta1}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps}
        params = decay + no_decay
        if params and all(p.is_cuda and not isinstance(p, DTensor) for p in params):
            kwargs["fused"] = True  # one kernel per step instead of one per tensor; deterministic
    if sharding == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(decay, optimizer_class=cls, process_group=process_group,
                                       weight_decay=opt.weight_decay, **kwargs)
        zero.add_param_group(groups[1])
        return zero
    return cls(groups, **kwargs)


# ----------------------------------------------------------------------------- one step


@dataclass
class StepOutcome:
    loss: float
    grad_norm: float
    lr: float
    times: StepTimes = field(default_factory=StepTimes)


def as_parallel_model(model: torch.nn.Module | ParallelModel, timer: CollectiveTimer | None,
                      world_size: int, device: torch.device) -> ParallelModel:
    """A bare DDP module (the original calling convention) as a data-parallel ParallelModel."""
    if isinstance(model, ParallelModel):
        return model
    inner = getattr(model, "module", model)
    return ParallelModel(model=inner, module=model, plan=ParallelPlan(dp=world_size), rank=0,
                         timer=timer or CollectiveTimer(), device=device)


def forward_backward(pm: ParallelModel, batches: list[tuple[torch.Tensor, torch.Tensor]], *, runtime: Runtime,
                     seeds: list[int] | None) -> torch.Tensor:
    """Forward and backward over this rank's micro batches (the pipeline schedule's, when there is one): the
    gradients accumulated, the mean of the micro-batch losses returned (not yet reduced over ranks)."""
    if pm.pipeline is not None:
        return pm.pipeline.step(batches, seeds=seeds, autocast=runtime.autocast())
    accumulation = len(batches)
    loss_sum = torch.zeros((), device=runtime.device)
    for k, (inputs, targets) in enumerate(batches):
        with pm.sync_context(last_micro_step=k == accumulation - 1):
            if seeds:
                torch.manual_seed(seeds[k])
            with runtime.autocast():
                _, loss = pm.module(inputs, targets)
            (loss / accumulation).backward()
        loss_sum += loss.detach()
    return loss_sum / accumulation


def train_step(
    model: torch.nn.Module | ParallelModel,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    runtime: Runtime,
    timer: CollectiveTimer | None = None,
    grad_clip: float | None,
    world_size: int = 1,
    seeds: list[int] | None = None,
    before_update: Callable[[], float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepOutcome:
    """Forward/backward over this rank's micro batches, synchronise, check, update.

    Each micro-batch loss is a mean over its tokens; dividing by the number of micro steps and
    letting data parallelism average over ranks makes the gradient that of the mean loss over
    the global batch. DDP all-reduces only on the last micro step (``no_sync`` before it).
    ``seeds`` (one per micro batch) reseed the dropout generator; see ``micro_batch_seed``.
    ``before_update()`` runs just before the optimizer changes the state (an asynchronous
    checkpoint finishing its copy); the seconds it returns are the step's checkpoint stall.
    """
    pm = as_parallel_model(model, timer, world_size, runtime.device)
    timer = pm.timer
    started = clock()
    timer.reset()
    local_mean = forward_backward(pm, batches, runtime=runtime, seeds=seeds)
    runtime.synchronize()
    backward_end = clock()
    exposed = timer.exposed_seconds(backward_end)

    reduce_started = clock()
    pm.finish_gradients()
    global_loss = pm.global_mean_loss(local_mean)  # reduced while the norm and the update run
    grad_norm = pm.clip_grad_norm(grad_clip)
    norm_value = float(grad_norm.item())
    reduce_seconds = clock() - reduce_started
    if not math.isfinite(norm_value):  # the same on every rank: the gradients were reduced
        raise NonFiniteError(f"loss {global_loss.wait().item()} / grad norm {norm_value} is not finite")

    stall = before_update() if before_update is not None else 0.0
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    loss_started = clock()
    loss_value = global_loss.wait().item()
    reduce_seconds += clock() - loss_started
    if not math.isfinite(loss_value):  # the same on every rank; the next attempt resumes from a saved step
        raise NonFiniteError(f"loss {loss_value} / grad norm {norm_value} is not finite")
    runtime.synchronize()
    total = clock() - started
    collective = exposed + reduce_seconds
    return StepOutcome(
        loss=loss_value, grad_norm=norm_value, lr=float(lr),
        times=StepTimes(compute=max(0.0, total - collective - stall), collective=collective, checkpoint=stall),
    )



# ----------------------------------------------------------------------------- the run record


@dataclass
class RecordKeeper:
    """Rank 0's run record (``record`` is None on the other ranks): what ran, from what, how fast."""

    job: Job
    record: RunRecord | None
    record_path: Any
    peak: PeakFlops | None
    flops_per_token: float
    progress: Progress
    sampler: Any
    step_seconds: list[float] = field(default_factory=list)

    def step(self, event: StepMetrics) -> None:
        self.step_seconds.append(event.step_seconds)
        if self.record is not None:
            self.record.loss_curve.append((event.step, event.loss))

    def shard(self, saved: SavedShard, step: int) -> None:
        if self.record is not None:
            self.record.checkpoints.append(CheckpointRecord(
                global_step=step, directory=str(saved.directory), mode=self.job.settings.checkpoint_mode,
                stall_seconds=saved.seconds if saved.stall is None else saved.stall, write_seconds=saved.seconds,
                shard_bytes=saved.shard.size_bytes,
            ))
        self.flush()

    def flush(self, *, status: str | None = None, exit_code: int | None = None, error: str | None = None,
              **fields: Any) -> None:
        """Rewrite the run record (rank 0) with the live counters."""
        if self.record is None:
            return
        r, p, tokens_per_step = self.record, self.progress, self.job.tokens_per_step
        r.progress.global_step = p.global_step
        r.progress.consumed_tokens = p.consumed_tokens
        r.progress.consumed_samples = p.consumed_samples
        r.progress.tokens_this_attempt = (p.global_step - r.progress.start_step) * tokens_per_step
        r.progress.sampler_position = self.sampler.position
        if self.step_seconds:
            steady = self.step_seconds[1:] or self.step_seconds  # the first step pays for warm-up
            mean = sum(steady) / len(steady)
            r.throughput.mean_step_seconds = mean
            r.throughput.mean_tokens_per_second = tokens_per_step / mean if mean > 0 else None
            if self.peak and mean > 0:
                from trainyard.metrics import mfu

                r.throughput.mean_mfu = mfu(flops_per_token=self.flops_per_token,
                                            tokens_per_second=tokens_per_step / mean,
                                            devices=self.job.settings.world_size, peak_flops=self.peak.flops)
        if status:
            r.status = status
        if exit_code is not None:
            r.exit_code = exit_code
        if error:
            r.error = error
        for name, value in fields.items():  # failed_step, stopped: RunRecord fields set once at the end
            setattr(r, name, value)
        r.write(self.record_path)

    def failed(self, exc: BaseException, *, failed_step: int | None = None, signalled: bool = False) -> None:
        """The record of an attempt that ends with ``exc`` (a stop on request is not a failure)."""
        try:
            if isinstance(exc, StoppedOnRequest):
                self.flush(status="preempted", exit_code=exit_code_for(exc),
                           stopped=StopRecord(global_step=exc.global_step, saved=exc.saved, signalled=signalled))
                return
            self.flush(status="failed", exit_code=exit_code_for(exc), error=f"{type(exc).__name__}: {exc}",
                       failed_step=failed_step if isinstance(exc, NonFiniteError) else None)
        except Exception:  # noqa: BLE001 - the original error matters more than the record
            log.exception("could not write the run record after a failure")


# ----------------------------------------------------------------------------- the loop


@dataclass
class Trainee:
    """What phase 2 builds: the model as parallelised, its optimizer and schedule."""

    pm: ParallelModel
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    num_parameters: int


def open_data(job: Job, run: Run) -> DataLoader:
    """Phase 1: the run's loader over the spec's dataset, this rank's data-parallel share."""
    _, dp_rank, _ = job.plan.coordinates(job.settings.rank)
    loader = run.data_loader(dp=job.plan.dp, dp_rank=dp_rank)
    vocab = loader.dataset.manifest.tokenizer.vocab_size
    if vocab > job.model_config.vocab_size:
        raise DataError(f"dataset {job.spec.dataset} has a vocabulary of {vocab}, "
                        f"the model only {job.model_config.vocab_size}")
    return loader


def build_trainee(job: Job, ctx: Context, batch: BatchLayout) -> Trainee:
    """Phase 2: the GPT from the spec's seed, parallelised by the plan, with its optimizer and schedule."""
    training, runtime, plan = job.spec.training, job.runtime, job.plan
    model = build_model(job.model_config, seed=training.seed, device=runtime.device)
    pm = parallelize(model, plan, rank=job.settings.rank, device=runtime.device, mesh=ctx.mesh,
                     timer=CollectiveTimer(), loss_fn=lm_loss, micro_batches=batch.grad_accumulation)
    dp_group = ctx.mesh["dp"].get_group() if ctx.mesh is not None else None
    optimizer = build_optimizer(pm.model, job.spec, sharding=plan.sharding, process_group=dp_group)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=training.lr_schedule, max_steps=training.max_steps)
    return Trainee(pm, optimizer, lr_scheduler, model.num_parameters())


def run_step(job: Job, run: Run, trainee: Trainee, loader: DataLoader) -> StepOutcome:
    """One optimizer step; its data wait, compute, exposed communication and stall go to ``run.timing``."""
    training = job.spec.training
    started = time.perf_counter()
    batches = next(loader)
    data_wait = time.perf_counter() - started
    seeds = [micro_batch_seed(training.seed, p) for p in loader.last_positions] if job.model_config.dropout > 0 \
        else None
    outcome = train_step(trainee.pm, trainee.optimizer, trainee.lr_scheduler, batches, runtime=job.runtime,
                         grad_clip=training.grad_clip, world_size=job.settings.world_size, seeds=seeds,
                         before_update=run.before_update)
    outcome.times.data_wait = data_wait
    t = outcome.times
    run.timing.add(data_wait=t.data_wait, compute=t.compute, collective=t.collective, checkpoint=t.checkpoint)
    return outcome


def train(job: Job, run: Run) -> Progress:
    """Train from the start checkpoint (or step 0) to ``maxSteps``; returns the final counters.

    ``run.end.global_step`` follows the last completed step (the failing one after a NaN), for
    the exit note; a stop on request raises :class:`StoppedOnRequest` once its save is durable.
    """
    settings, spec, runtime, plan = job.settings, job.spec, job.runtime, job.plan
    if spec.fault_tolerance is not None:  # replicas joined per step by torchft: a loop of their own
        from trainyard_trainer.replica_training import train_replica

        return train_replica(job, run)
    training, progress = spec.training, run.progress
    batch = job.batch or batch_layout(global_batch=training.global_batch_size, micro_batch=training.micro_batch_size,
                                      dp=plan.dp, spec_dp=spec.parallelism.data,
                                      sequence_length=training.sequence_length)
    run.parallelism = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp}

    # 0. the distributed context: the run's control groups, the device mesh, every rank's host and versions
    ctx = run.ctx
    if dist.is_initialized():
        ctx.mesh = build_mesh(plan, runtime.device.type)
    environments = ctx.gather(local_environment())

    # 1. data
    loader = open_data(job, run)

    # 2. model, parallelism, optimizer, schedule
    trainee = build_trainee(job, ctx, batch)
    state = checkpoint_state(model=trainee.pm.model, optimizer=trainee.optimizer, lr_scheduler=trainee.lr_scheduler,
                             sampler=loader.sampler, progress=progress, rng=run.rng)
    log.info("model %s: %d parameters; dataset %s: %d samples of %d tokens; %s; %s; %s",
             spec.model_config_ref if isinstance(spec.model_config_ref, str) else "inline", trainee.num_parameters,
             spec.dataset, len(loader.dataset), training.sequence_length + 1, plan.describe(), batch.statement(),
             runtime.precision)
    for note in plan.notes:
        log.warning("parallel plan: %s", note)

    # 3. peak FLOP/s (a CPU probe runs once per host, on its first rank, while the others wait)
    fpt = flops_per_token(job.model_config, training.sequence_length)
    peak = run.enable_mfu(fpt)
    record_path = run.attempt_dir / RUN_RECORD_FILE

    def keeper_for(restored: RestoreRecord) -> RecordKeeper:
        record = None if settings.rank != 0 else initial_record(
            job, batch, environments, restored, fpt, peak, trainee.num_parameters,
            start_step=progress.global_step, start_position=loader.sampler.position, progress=progress)
        return RecordKeeper(job, record, record_path, peak, fpt, progress, loader.sampler)

    # 4. restore, and the run record saying from what and why
    keeper = restore_and_record(job, run, state, trainee, loader, environments, keeper_for)
    if spec.evaluation is not None:  # an evaluation job: the start checkpoint's held-out loss, no steps
        evaluate_start(job, run, trainee, loader)
        keeper.flush(status="succeeded", exit_code=0)
        return progress

    # 5. steps: train, then the boundary (agree, maybe save, maybe stop), then StepMetrics
    train_steps(job, run, trainee, loader, state, keeper)
    keeper.flush(status="succeeded", exit_code=0)
    return progress


def evaluate_start(job: Job, run: Run, trainee: Trainee, loader: DataLoader) -> dict[str, float]:
    """Evaluate the checkpoint the job started from (``spec.evaluation``) and report it (rank 0's report counts)."""
    assert job.spec.evaluation is not None
    _, dp_rank, _ = job.plan.coordinates(job.settings.rank)
    micro = job.spec.training.micro_batch_size
    batches = held_out_samples(len(loader.dataset), batches=job.spec.evaluation.batches, rows=micro * job.plan.dp)
    metrics = evaluate(trainee.pm, loader.dataset, batches, dp_rank=dp_rank, micro_batch=micro, runtime=job.runtime)
    run.report_evaluation(metrics)
    return metrics


def restore_and_record(job: Job, run: Run, state: dict[str, Any], trainee: Trainee, loader: DataLoader,
                       environments: list[dict[str, Any]],
                       keeper_for: Callable[[RestoreRecord], RecordKeeper]) -> RecordKeeper:
    """Restore the start checkpoint (or the Hugging Face weights the spec names) into ``state``; the run
    record, written before anything can fail, says from what and why (a refusal is recorded, then raised)."""
    settings, spec, runtime = job.settings, job.spec, job.runtime
    try:
        run.restore(state)
    except NoVerifiedCheckpointError as exc:
        ref = job.allocation.start_checkpoint
        keeper_for(RestoreRecord(manifest_uri=None, reason=str(exc), refused=refused_records(exc.refused),
                                 requested_manifest_uri=ref.manifest_uri if ref else None)).failed(exc)
        raise
    assert run.restored is not None
    if runtime.device.type == "cpu" and (
            change := cpu_threads_change(run.restored.cpu_threads, [e["cpu_threads"] for e in environments])):
        run.restored.cpu_threads_note = change
        if settings.rank == 0:
            log.warning("restore: %s", change)
    try:
        maybe_init_from_hugging_face(spec, job.model_config, trainee.pm.model, run.restored, run.layout,
                                     settings.tenant, cache_dir=settings.local_root / "hf-cache")
    except BaseException as exc:
        keeper_for(run.restored).failed(exc)
        raise
    loader.last_start = loader.sampler.position
    keeper = keeper_for(run.restored)
    if keeper.record is not None:
        keeper.record.checkpoint_policy = run.policy
    keeper.flush()
    return keeper


def train_steps(job: Job, run: Run, trainee: Trainee, loader: DataLoader, state: dict[str, Any],
                keeper: RecordKeeper) -> None:
    """Steps until ``maxSteps``: train, then the boundary (agree, maybe save, maybe stop), then StepMetrics.
    A stop on request raises :class:`StoppedOnRequest` once its save is durable; any error is recorded."""
    progress, training = run.progress, job.spec.training
    trainee.pm.module.train()
    try:
        while progress.global_step < training.max_steps:
            outcome = run_step(job, run, trainee, loader)
            step = progress.global_step + 1
            run.checkpoint(step, state, on_durable=keeper.shard)
            keeper.step(run.report(step, loss=outcome.loss, lr=outcome.lr, grad_norm=outcome.grad_norm))
            if run.stopped is not None:
                raise run.stopped
        run.wait()
    except BaseException as exc:
        run.checkpointer.close()
        if isinstance(exc, NonFiniteError):
            run.end.global_step = progress.global_step + 1  # the step whose loss or gradient was not finite
        keeper.failed(exc, failed_step=run.end.global_step, signalled=run.request.signalled)
        raise


def initial_record(job: Job, batch: BatchLayout, environments: list[dict[str, Any]], restored: RestoreRecord,
                    fpt: float, peak: PeakFlops | None, num_parameters: int, *, start_step: int,
                    start_position: int, progress: Progress) -> RunRecord:
    settings, spec, runtime, plan = job.settings, job.spec, job.runtime, job.plan
    mine = environments[0]
    return RunRecord(
        job_id=settings.job_id, tenant=settings.tenant, attempt=settings.attempt,
        allocation_id=settings.allocation_id, world_size=settings.world_size, spec_hash=job.allocation.spec_hash,
        model=spec.model_config_ref if isinstance(spec.model_config_ref, str) else "inline",
        num_parameters=num_parameters, dataset=spec.dataset,
        environment=Environment(
            python=mine["python"], torch=mine["torch"], cuda=mine["cuda"], cudnn=mine["cudnn"], nccl=mine["nccl"],
            platform=mine["platform"], backend=runtime.backend, device=str(runtime.device),
            hostnames=[e["hostname"] for e in environments], code_revision=spec.code_revision,
            cpu_threads=[e["cpu_threads"] for e in environments],
        ),
        batch=BatchRecord(
            micro_batch_size=batch.micro_batch, data_parallel=batch.dp, grad_accumulation=batch.grad_accumulation,
            global_batch_size=batch.global_batch, sequence_length=batch.sequence_length,
            tokens_per_step=batch.tokens_per_step, spec_data_parallel=batch.spec_dp, statement=batch.statement(),
        ),
        parallelism=ParallelRecord(
            dp=plan.dp, tp=plan.tp, pp=plan.pp, sharding=plan.sharding, zero_stage=plan.zero_stage,
            activation_checkpointing=plan.activation_checkpointing, precision=runtime.precision,
            checkpoint_mode=settings.checkpoint_mode, notes=list(plan.notes),
        ),
        restore=restored,
        progress=ProgressRecord(
            start_step=start_step, global_step=progress.global_step, consumed_tokens=progress.consumed_tokens,
            consumed_samples=progress.consumed_samples, tokens_this_attempt=0,
            sampler_start_position=start_position, sampler_position=start_position,
        ),
        throughput=ThroughputRecord(flops_per_token=fpt, peak_flops_per_device=peak.flops if peak else None,
                                    peak_flops_source=peak.source if peak else None),
    )


