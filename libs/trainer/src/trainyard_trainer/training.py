"""The training loop of one rank, nanoGPT-style: read it top to bottom.

``train(job, spool)`` runs in phases: 0. the distributed context (mesh, a gloo control
group, every rank's host) 1. data 2. model, parallelism, optimizer, schedule 3. restore from
the start checkpoint, verified, with fallback to an earlier READY one 4. peak FLOP/s and the
run record 5. steps, each followed by one agreement of all ranks (checkpoint due? requested? the pending
save done?), a checkpoint when due or requested, and a StepMetrics event; asked to checkpoint
(:mod:`preemption`), the ranks save that step, wait until it is durable and stop with
:class:`StoppedOnRequest` (exit 7). Errors leave as exceptions of trainyard's tree;
``__main__`` turns them into exit codes.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry import trace
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainyard_common.catalog import ModelConfig, resolve_model
from trainyard_common.errors import CheckpointError, ConfigError, DataError, NonFiniteError
from trainyard_common.events import CheckpointRefused, GangAllocated, ShardWritten, StepMetrics
from trainyard_common.spec import TrainingSpec
from trainyard_common.spool import SpoolWriter
from trainyard_common.storage import ArtifactLayout
from trainyard_common.tracing import current_traceparent

from trainyard_trainer.checkpoint import (
    Candidate,
    Checkpointer,
    CheckpointSchedule,
    NoVerifiedCheckpointError,
    RestoreChoice,
    Refusal,
    SavedShard,
    check_restorable,
    checkpoint_dir_of,
    choose_checkpoint,
    find_ready_checkpoints,
    load_checkpoint,
    requested_candidate,
    verify_files_shared,
)
from trainyard_trainer.data import MANIFEST_FILE, TokenDataset
from trainyard_trainer.exits import RankEnd, exit_code_for
from trainyard_trainer.metrics import PeakFlops, device_peak_flops, flops_per_token, mfu
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
from trainyard_trainer.preemption import (
    CHECKPOINT_REQUEST_FILE,
    Boundary,
    CheckpointRequest,
    StoppedOnRequest,
    agreed,
    boundary_flags,
    plan_boundary,
)
from trainyard_trainer.runrecord import (
    RUN_RECORD_FILE,
    BatchRecord,
    CheckpointPolicyRecord,
    CheckpointRecord,
    Environment,
    ParallelRecord,
    ProgressRecord,
    RefusedCheckpoint,
    RestoreRecord,
    RunRecord,
    StopRecord,
    ThroughputRecord,
    local_environment,
)
from trainyard_trainer.runtime import Runtime, new_cpu_group
from trainyard_trainer.sampler import BatchLayout, BatchLoader, GlobalSampler, batch_layout, micro_batch_seed
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard_trainer.settings import RankSettings
from trainyard_trainer.state import Progress, RngState, checkpoint_state

__all__ = ["Job", "NonFiniteError", "StepOutcome", "StepTimes", "build_optimizer", "resolve_job", "train", "train_step"]

log = logging.getLogger("trainyard_trainer")
_tracer = trace.get_tracer("trainyard_trainer")
PEAK_FLOPS_CACHE = ("calibration", "peak-flops.json")  # under the artifact root


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
            f"training.sequenceLength {spec.training.sequence_length} exceeds the model's maxSeqLen {config.max_seq_len}"
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


def as_parallel_model(model: torch.nn.Module | ParallelModel, timer: CollectiveTimer | None,
                      world_size: int, device: torch.device) -> ParallelModel:
    """A bare DDP module (the original calling convention) as a data-parallel ParallelModel."""
    if isinstance(model, ParallelModel):
        return model
    inner = getattr(model, "module", model)
    return ParallelModel(model=inner, module=model, plan=ParallelPlan(dp=world_size), rank=0,
                         timer=timer or CollectiveTimer(), device=device)


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
    accumulation = len(batches)
    timer.reset()
    if pm.pipeline is not None:
        local_mean = pm.pipeline.step(batches, seeds=seeds, autocast=runtime.autocast())
    else:
        loss_sum = torch.zeros((), device=runtime.device)
        for k, (inputs, targets) in enumerate(batches):
            with pm.sync_context(last_micro_step=k == accumulation - 1):
                if seeds:
                    torch.manual_seed(seeds[k])
                with runtime.autocast():
                    _, loss = pm.module(inputs, targets)
                (loss / accumulation).backward()
            loss_sum += loss.detach()
        local_mean = loss_sum / accumulation
    runtime.synchronize()
    backward_end = clock()
    exposed = timer.exposed_seconds(backward_end)

    reduce_started = clock()
    pm.finish_gradients()
    grad_norm = pm.clip_grad_norm(grad_clip)
    loss_value = pm.global_mean_loss(local_mean).item()
    norm_value = float(grad_norm.item())
    reduce_seconds = clock() - reduce_started
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        raise NonFiniteError(f"loss {loss_value} / grad norm {norm_value} is not finite")

    stall = before_update() if before_update is not None else 0.0
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    runtime.synchronize()
    total = clock() - started
    collective = exposed + reduce_seconds
    return StepOutcome(
        loss=loss_value, grad_norm=norm_value, lr=float(lr),
        times=StepTimes(compute=max(0.0, total - collective - stall), collective=collective, checkpoint=stall),
    )


# ----------------------------------------------------------------------------- the distributed context


@dataclass
class Context:
    """Collectives the loop needs beyond the model's: a CPU control group and its helpers."""

    rank: int
    world_size: int
    control: Any = None  # gloo group for the main thread's small agreements (None in a world of one)
    background: Any = None  # gloo group of background checkpoint writes: a group per thread
    mesh: Any = None

    def barrier(self) -> None:
        if self.control is not None:
            dist.barrier(group=self.control)

    def agree(self, values: list[int]) -> list[int]:
        """Element-wise sum of ``values`` over all ranks."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def agree_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum of ``values`` over all ranks (any rank's "yes" is everyone's)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_reduce(self, values: list[int], op: Any) -> list[int]:
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=op, group=self.control)
        return [int(v) for v in tensor.tolist()]

    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out


def open_context(job: Job) -> Context:
    settings = job.settings
    if not dist.is_initialized():
        return Context(rank=0, world_size=1)
    return Context(rank=settings.rank, world_size=settings.world_size, control=new_cpu_group(),
                   background=new_cpu_group(), mesh=build_mesh(job.plan, job.runtime.device.type))


# ----------------------------------------------------------------------------- restore


def restore(job: Job, state: dict[str, Stateful], ctx: Context, layout: ArtifactLayout,
            spool: SpoolWriter | None = None) -> RestoreRecord:
    """Verify and load the start checkpoint, or fall back to the newest earlier READY one.

    Rank 0 spools a CheckpointRefused for every READY checkpoint it refused (the coordinator
    marks it FAILED), whether or not an earlier one then verified."""
    settings = job.settings
    started = time.perf_counter()
    ref = job.allocation.start_checkpoint
    requested = requested_candidate(ref) if ref is not None else None
    available = find_ready_checkpoints(layout.checkpoints_dir(settings.tenant, settings.job_id)) if ref else []

    def verify(candidate: Candidate) -> list[str]:
        assert candidate.manifest is not None
        foreign = candidate.manifest.job_id != settings.job_id  # initFrom: another job's weights
        problems = check_restorable(candidate.manifest, spec_hash=None if foreign else job.allocation.spec_hash)
        try:
            checkpoint_dir_of(candidate.manifest, candidate.manifest_uri)
        except CheckpointError as exc:
            problems.append(str(exc))
        if problems:
            return problems
        return verify_files_shared(candidate.manifest, rank=ctx.rank, world_size=ctx.world_size,
                                   gather=ctx.gather if ctx.world_size > 1 else None)

    try:
        choice: RestoreChoice = choose_checkpoint(requested, available, verify)
    except NoVerifiedCheckpointError as exc:
        if spool is not None and ctx.rank == 0:
            report_refusals(job, spool, exc.refused)
        raise
    if spool is not None and ctx.rank == 0:
        report_refusals(job, spool, choice.refused)
    for refusal in choice.refused:
        log.error("refusing checkpoint step %s (%s): %s", refusal.global_step, refusal.manifest_uri,
                  "; ".join(refusal.problems))
    record = RestoreRecord(
        manifest_uri=None, reason=choice.reason, requested_manifest_uri=ref.manifest_uri if ref else None,
        refused=[RefusedCheckpoint(manifest_uri=r.manifest_uri, global_step=r.global_step, problems=r.problems)
                 for r in choice.refused],
        rng="fresh",
    )
    if choice.candidate is None:
        return record
    manifest = choice.candidate.manifest
    assert manifest is not None
    directory = checkpoint_dir_of(manifest, choice.candidate.manifest_uri)
    if manifest.job_id != settings.job_id:
        return _init_from(job, state, manifest, directory, choice.candidate.manifest_uri, record, started)
    same_world = manifest.world_size == settings.world_size
    to_load = dict(state) if same_world else {k: v for k, v in state.items() if k != "rng"}
    load_checkpoint(to_load, directory)
    progress: Progress = state["progress"]  # type: ignore[assignment]
    if not same_world:
        state["rng"].reseed(progress.global_step)  # type: ignore[attr-defined]
    record.manifest_uri = choice.candidate.manifest_uri
    record.global_step = progress.global_step
    record.world_size = manifest.world_size
    record.rng = "restored" if same_world else (
        f"reseeded: written by {manifest.world_size} ranks, this attempt has {settings.world_size}")
    record.seconds = time.perf_counter() - started
    (log.warning if choice.fell_back else log.info)(
        "restore: %s; resumed from %s at step %d (%d tokens consumed)",
        choice.reason, choice.candidate.manifest_uri, progress.global_step, progress.consumed_tokens)
    return record


def _init_from(job: Job, state: dict[str, Stateful], manifest: Any, directory: Any, manifest_uri: str,
               record: RestoreRecord, started: float) -> RestoreRecord:
    """``initFrom``: load only the model weights of another job's checkpoint; the optimizer,
    schedule, sampler, RNG and counters start fresh under this job's spec. A model of another
    shape fails the load (CheckpointError: exit 4, the job fails with the reason)."""
    try:
        load_checkpoint({"model": state["model"]}, directory)
    except CheckpointError as exc:
        raise CheckpointError(
            f"initFrom: cannot load the weights of job {manifest.job_id} step {manifest.global_step} "
            f"({manifest_uri}) into this model: {exc}") from exc
    record.manifest_uri = manifest_uri
    record.global_step = 0
    record.world_size = manifest.world_size
    record.reason = (f"initialised from job {manifest.job_id} step {manifest.global_step} (weights only; "
                     "optimizer, schedule, data position and step counter start fresh)")
    record.seconds = time.perf_counter() - started
    log.info("restore: %s", record.reason)
    return record


def report_refusals(job: Job, spool: SpoolWriter, refused: list[Refusal]) -> int:
    """Spool one CheckpointRefused per refused checkpoint whose step is known; returns how many."""
    settings, sent = job.settings, 0
    for r in refused:
        if r.global_step is None:  # a manifest that does not parse names no step; the coordinator cannot match it
            log.warning("not reporting refused checkpoint %s: its step is unknown", r.manifest_uri)
            continue
        spool.write(CheckpointRefused(
            job_id=settings.job_id, tenant=settings.tenant, attempt=settings.attempt, manifest_uri=r.manifest_uri,
            global_step=r.global_step, checkpoint_attempt=r.attempt, problems=list(r.problems),
        ), traceparent=current_traceparent())
        sent += 1
    return sent


# ----------------------------------------------------------------------------- the loop


@dataclass
class Reporter:
    """StepMetrics, ShardWritten and the run record of one rank (the record is rank 0's alone)."""

    job: Job
    spool: SpoolWriter
    record: RunRecord | None
    record_path: Any
    peak: PeakFlops | None
    flops_per_token: float
    progress: Progress
    sampler: GlobalSampler
    step_seconds: list[float] = field(default_factory=list)

    def step(self, outcome: StepOutcome, seconds: float) -> None:
        job, settings, times, progress = self.job, self.job.settings, outcome.times, self.progress
        tokens_per_second = job.tokens_per_step / seconds if seconds > 0 else None
        step_mfu = None
        if tokens_per_second and self.peak:
            step_mfu = mfu(flops_per_token=self.flops_per_token, tokens_per_second=tokens_per_second,
                           devices=settings.world_size, peak_flops=self.peak.flops)
        self.spool.write(
            StepMetrics(
                job_id=settings.job_id, tenant=settings.tenant, attempt=settings.attempt, rank=settings.rank,
                step=progress.global_step, max_steps=job.spec.training.max_steps, loss=outcome.loss, lr=outcome.lr,
                consumed_tokens=progress.consumed_tokens, consumed_samples=progress.consumed_samples,
                tokens_per_second=tokens_per_second, mfu=step_mfu, step_seconds=seconds,
                compute_seconds=times.compute, collective_seconds=times.collective,
                data_wait_seconds=times.data_wait, checkpoint_seconds=times.checkpoint,
            ),
            traceparent=current_traceparent(),
        )
        self.step_seconds.append(seconds)
        if self.record is not None:
            self.record.loss_curve.append((progress.global_step, outcome.loss))
        log.info("step %d/%d loss %.4f lr %.3g grad-norm %.3f %.0f tok/s mfu %s "
                 "(data %.3fs compute %.3fs comm %.3fs ckpt %.3fs)",
                 progress.global_step, job.spec.training.max_steps, outcome.loss, outcome.lr, outcome.grad_norm,
                 tokens_per_second or 0.0, f"{step_mfu:.4f}" if step_mfu is not None else "-",
                 times.data_wait, times.compute, times.collective, times.checkpoint)

    def shard(self, saved: SavedShard, *, step: int, tokens: int, samples: int, span: Any) -> None:
        job, settings = self.job, self.job.settings
        with trace.use_span(span, end_on_exit=True):
            span.set_attribute("trainyard.shard_bytes", saved.shard.size_bytes)
            self.spool.write(
                ShardWritten(
                    job_id=settings.job_id, tenant=settings.tenant, attempt=settings.attempt, epoch=settings.epoch,
                    global_step=step, rank=settings.rank, world_size=settings.world_size,
                    uri=saved.shard.uri, size_bytes=saved.shard.size_bytes, sha256=saved.shard.sha256,
                    extra_files=saved.extra_files, consumed_tokens=tokens, consumed_samples=samples,
                    spec_hash=job.allocation.spec_hash,
                    parallelism={"dp": job.plan.dp, "tp": job.plan.tp, "pp": job.plan.pp},
                    write_seconds=max(saved.seconds, 0.0), stall_seconds=max(_stall_of(saved), 0.0),
                ),
                traceparent=current_traceparent(),
            )
        log.info("checkpoint step %d durable: %s (%d bytes, %.2fs from start to rename)", step, saved.shard.uri,
                 saved.shard.size_bytes, saved.seconds)
        if self.record is not None:
            self.record.checkpoints.append(CheckpointRecord(
                global_step=step, directory=str(saved.directory), mode=settings.checkpoint_mode,
                stall_seconds=_stall_of(saved), write_seconds=saved.seconds,
                shard_bytes=saved.shard.size_bytes,
            ))

    def flush(self, *, status: str | None = None, exit_code: int | None = None, error: str | None = None,
              **fields: Any) -> None:
        """Rewrite the run record (rank 0) with the live counters."""
        if self.record is None:
            return
        r, p = self.record, self.progress
        r.progress.global_step = p.global_step
        r.progress.consumed_tokens = p.consumed_tokens
        r.progress.consumed_samples = p.consumed_samples
        r.progress.tokens_this_attempt = (p.global_step - r.progress.start_step) * self.job.tokens_per_step
        r.progress.sampler_position = self.sampler.position
        if self.step_seconds:
            steady = self.step_seconds[1:] or self.step_seconds  # the first step pays for warm-up
            mean = sum(steady) / len(steady)
            r.throughput.mean_step_seconds = mean
            r.throughput.mean_tokens_per_second = self.job.tokens_per_step / mean
            if self.peak:
                r.throughput.mean_mfu = mfu(flops_per_token=self.flops_per_token,
                                            tokens_per_second=self.job.tokens_per_step / mean,
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


def train(job: Job, spool: SpoolWriter, *, request: CheckpointRequest | None = None,
          end: RankEnd | None = None) -> Progress:
    """Train from the start checkpoint (or step 0) to ``maxSteps``; returns the final counters.

    ``request`` says whether this rank was asked to checkpoint and stop (default: the request
    file only, no signal handler); ``end.global_step`` follows the last completed step (the
    failing one after a NaN), for the exit note.
    """
    settings, spec, runtime, plan = job.settings, job.spec, job.runtime, job.plan
    end = end if end is not None else RankEnd()
    training = spec.training
    rank, world = settings.rank, settings.world_size
    batch = job.batch or batch_layout(global_batch=training.global_batch_size, micro_batch=training.micro_batch_size,
                                      dp=plan.dp, spec_dp=spec.parallelism.data,
                                      sequence_length=training.sequence_length)

    # 0. the distributed context: mesh, control group, every rank's host and versions
    ctx = open_context(job)
    environments = ctx.gather(local_environment())
    _, dp_rank, _ = plan.coordinates(rank)

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
        micro_batch=training.micro_batch_size, dp=plan.dp, dp_rank=dp_rank,
    )
    loader = BatchLoader(dataset, sampler, runtime.device)

    # 2. model, parallelism, optimizer, schedule
    model = build_model(job.model_config, seed=training.seed, device=runtime.device)
    num_parameters = model.num_parameters()
    pm = parallelize(model, plan, rank=rank, device=runtime.device, mesh=ctx.mesh, timer=CollectiveTimer(),
                     loss_fn=lm_loss, micro_batches=batch.grad_accumulation)
    dp_group = ctx.mesh["dp"].get_group() if ctx.mesh is not None else None
    optimizer = build_optimizer(pm.model, spec, sharding=plan.sharding, process_group=dp_group)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=training.lr_schedule, max_steps=training.max_steps)
    progress = Progress()
    rng = RngState(rank, runtime.device, seed=training.seed)
    state = checkpoint_state(model=pm.model, optimizer=optimizer, lr_scheduler=lr_scheduler, sampler=sampler,
                             progress=progress, rng=rng)
    log.info("model %s: %d parameters; dataset %s: %d samples of %d tokens; %s; %s; %s",
             spec.model_config_ref if isinstance(spec.model_config_ref, str) else "inline", num_parameters,
             spec.dataset, len(dataset), training.sequence_length + 1, plan.describe(), batch.statement(),
             runtime.precision)
    for note in plan.notes:
        log.warning("parallel plan: %s", note)

    # 3. peak FLOP/s (a CPU probe runs once per host, on its first rank, while the others wait)
    peak = _peak_flops(job, ctx, layout.root.joinpath(*PEAK_FLOPS_CACHE))
    fpt = flops_per_token(job.model_config, training.sequence_length)
    record_path = layout.attempt_dir(settings.tenant, settings.job_id, settings.attempt) / RUN_RECORD_FILE

    def new_record(restored: RestoreRecord) -> RunRecord | None:
        if rank != 0:
            return None
        return _initial_record(job, batch, environments, restored, fpt, peak, num_parameters,
                               start_step=progress.global_step, start_position=sampler.position, progress=progress)

    # 4. restore, and the run record saying from what and why
    try:
        restored = restore(job, state, ctx, layout, spool)
    except NoVerifiedCheckpointError as exc:
        failed = new_record(RestoreRecord(
            manifest_uri=None, reason=str(exc), requested_manifest_uri=job.allocation.start_checkpoint.manifest_uri
            if job.allocation.start_checkpoint else None,
            refused=[RefusedCheckpoint(manifest_uri=r.manifest_uri, global_step=r.global_step, problems=r.problems)
                     for r in exc.refused],
        ))
        _flush_failure(Reporter(job, spool, failed, record_path, peak, fpt, progress, sampler), exc)
        raise
    loader.last_start = sampler.position
    end.global_step = progress.global_step
    reporter = Reporter(job, spool, new_record(restored), record_path, peak, fpt, progress, sampler)
    policy = checkpoint_policy(job)
    if reporter.record is not None:
        reporter.record.checkpoint_policy = policy
    reporter.flush()

    # 5. steps
    schedule = CheckpointSchedule(max_steps=training.max_steps, every_steps=policy.every_steps,
                                  every_minutes=policy.every_minutes, last_save_at=time.monotonic())
    checkpointer = Checkpointer(rank=rank, mode=settings.checkpoint_mode, barrier=ctx.barrier, agree=ctx.agree,
                                group=ctx.background, device=runtime.device)
    if request is None:
        request = CheckpointRequest(checkpoint_request_file(job, layout), allocation_id=settings.allocation_id,
                                    epoch=settings.epoch)
    last_saved = progress.global_step if restored.manifest_uri is not None else None
    dropout = job.model_config.dropout > 0
    pm.module.train()
    try:
        while progress.global_step < training.max_steps:
            step_started = time.perf_counter()
            batches = loader.next_step()
            data_wait = time.perf_counter() - step_started
            seeds = [micro_batch_seed(training.seed, p) for p in loader.last_positions] if dropout else None
            outcome = train_step(pm, optimizer, lr_scheduler, batches, runtime=runtime, grad_clip=training.grad_clip,
                                 world_size=world, seeds=seeds, before_update=checkpointer.before_update)
            outcome.times.data_wait = data_wait
            progress.advance(samples=training.global_batch_size, tokens=job.tokens_per_step)
            step = end.global_step = progress.global_step
            boundary = agree_at_boundary(ctx, schedule, checkpointer, request, step)
            stall = outcome.times.checkpoint
            stall += checkpointer.settle(all_done=boundary.save_done, any_failed=boundary.save_failed)
            decided = plan_boundary(step=step, max_steps=training.max_steps, due=boundary.due,
                                    requested=boundary.requested, last_saved_step=last_saved)
            if decided.stop:
                log.warning("checkpoint requested%s: %s step %d, then stopping",
                            " (signal)" if request.signalled else "", "saving" if decided.save else "already saved",
                            step)
            if decided.save:
                stall += _save(job, checkpointer, state, progress, layout, reporter)
                schedule.saved(time.monotonic())
                last_saved = step
            if decided.stop or (decided.save and step >= training.max_steps):
                stall += checkpointer.wait()  # durable, and its ShardWritten spooled
            outcome.times.checkpoint = stall
            reporter.step(outcome, time.perf_counter() - step_started)
            if decided.stop:
                raise StoppedOnRequest(step, saved=decided.save)
        checkpointer.wait()
    except BaseException as exc:
        checkpointer.close()
        if isinstance(exc, NonFiniteError):
            end.global_step = progress.global_step + 1  # the step whose loss or gradient was not finite
        _flush_failure(reporter, exc, end=end, signalled=request.signalled)
        raise
    checkpointer.close()
    reporter.flush(status="succeeded", exit_code=0)
    return progress


def _flush_failure(reporter: Reporter, exc: BaseException, *, end: RankEnd | None = None,
                   signalled: bool = False) -> None:
    try:
        if isinstance(exc, StoppedOnRequest):
            reporter.flush(status="preempted", exit_code=exit_code_for(exc),
                           stopped=StopRecord(global_step=exc.global_step, saved=exc.saved, signalled=signalled))
            return
        failed_step = end.global_step if end is not None and isinstance(exc, NonFiniteError) else None
        reporter.flush(status="failed", exit_code=exit_code_for(exc), error=f"{type(exc).__name__}: {exc}",
                       failed_step=failed_step)
    except Exception:  # noqa: BLE001 - the original error matters more than the record
        log.exception("could not write the run record after a failure")


def _peak_flops(job: Job, ctx: Context, cache: Any) -> PeakFlops | None:
    settings, runtime = job.settings, job.runtime
    first_on_host = settings.local_rank == 0
    peak = None
    if first_on_host:
        peak = device_peak_flops(runtime.device, runtime.autocast_dtype, cache_file=cache,
                                 override=settings.peak_flops)
    ctx.barrier()
    if not first_on_host:
        peak = device_peak_flops(runtime.device, runtime.autocast_dtype, cache_file=cache,
                                 override=settings.peak_flops)
    return peak


def _initial_record(job: Job, batch: BatchLayout, environments: list[dict[str, Any]], restored: RestoreRecord,
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


def checkpoint_policy(job: Job) -> CheckpointPolicyRecord:
    """When this attempt saves: the allocation's ``checkpointEverySteps`` (``checkpointPolicy.auto``:
    the coordinator's Young/Daly advice) overrides the spec's ``everySteps`` / ``everyMinutes``."""
    spec_policy, advised = job.spec.checkpoint_policy, job.allocation.checkpoint_every_steps
    if advised is not None:
        log.info("checkpoint every %d steps: the platform's advice for checkpointPolicy.auto (the spec says "
                 "everySteps=%s everyMinutes=%s)", advised, spec_policy.every_steps, spec_policy.every_minutes)
        return CheckpointPolicyRecord(every_steps=advised, every_minutes=None,
                                      source="auto: the allocation's checkpointEverySteps (Young/Daly advice)")
    return CheckpointPolicyRecord(every_steps=spec_policy.every_steps, every_minutes=spec_policy.every_minutes,
                                  source="spec")


def checkpoint_request_file(job: Job, layout: ArtifactLayout) -> Path:
    """Where the node agent writes a checkpoint request for this attempt."""
    settings = job.settings
    return settings.checkpoint_request_file or (
        layout.attempt_dir(settings.tenant, settings.job_id, settings.attempt) / CHECKPOINT_REQUEST_FILE)


def agree_at_boundary(ctx: Context, schedule: CheckpointSchedule, checkpointer: Checkpointer,
                      request: CheckpointRequest, step: int) -> Boundary:
    """The step's one collective (world > 1): MAX over ranks of [save due, requested, the pending
    save not done, it failed]. Any rank's clock or request makes everyone save at this step."""
    pending, not_done, failed = checkpointer.local_status()
    flags = boundary_flags(due=schedule.due(step, time.monotonic()), requested=request.requested(),
                           pending=pending, not_done=not_done, failed=failed)
    return agreed(ctx.agree_max(flags))


def _stall_of(saved: SavedShard) -> float:
    return saved.seconds if saved.stall is None else saved.stall


def _save(
    job: Job, checkpointer: Checkpointer, state: Mapping[str, Stateful], progress: Progress,
    layout: ArtifactLayout, reporter: Reporter,
) -> float:
    """Start (or run) the save of this step; ShardWritten and the run record follow once it is durable."""
    settings = job.settings
    step, tokens, samples = progress.global_step, progress.consumed_tokens, progress.consumed_samples
    directory = layout.checkpoint_dir(settings.tenant, settings.job_id, settings.attempt, step)
    span = _tracer.start_span(
        "checkpoint save",
        attributes={"trainyard.job_id": settings.job_id, "trainyard.rank": settings.rank,
                    "trainyard.global_step": step, "trainyard.attempt": settings.attempt,
                    "trainyard.checkpoint_mode": settings.checkpoint_mode},
    )

    def on_durable(saved: SavedShard) -> None:
        reporter.shard(saved, step=step, tokens=tokens, samples=samples, span=span)
        reporter.flush()

    return checkpointer.save(state, directory, on_durable)
