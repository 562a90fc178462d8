"""One rank's handle on its trainyard job: :func:`init` → :class:`Run`.

A run is opened from the rank environment the node agent sets (or in local mode, see
:mod:`trainyard.environment`), and closed by leaving its ``with`` block. In between the script
calls, every step and on every rank alike::

    run.report(step, loss=...)     # StepMetrics (+ per-rank timing from run.timing)
    run.checkpoint(step, state)    # the step boundary: the ranks agree, maybe save, maybe stop
    if run.should_stop(): break    # a pause / preemption was agreed at this step (and saved)

``checkpoint`` is the one collective of the boundary (a 4-int all-reduce MAX on a gloo group of
its own, pipelined: sent at this boundary, reduced while the next step runs, decided on at the
next boundary, so it never holds training up): every rank must call it with the same step, or
the ranks wait for each other until the collective timeout. It decides, for everyone alike: save
when the policy says so (``everySteps``, the coordinator's advice under ``auto`` and always
``maxSteps``, at that step; ``everyMinutes`` on any rank's clock, one step after it ran out) or
when any rank was asked to checkpoint and stop (SIGUSR1 or the request file; at the step after
the request was seen); after a request, stop once that save is durable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainyard_contract import exitcodes
from trainyard_contract.catalog import ModelConfig, resolve_model
from trainyard_contract.errors import ConfigError, DataError, NonFiniteError, TrainyardError
from trainyard_contract.events import GangAllocated, ShardWritten, StepMetrics
from trainyard_contract.settings import load_settings
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.spool import SpoolWriter
from trainyard_contract.storage import ArtifactLayout
from trainyard_contract.tracing import current_traceparent, job_context, setup_tracing, shutdown_tracing

from trainyard.checkpoint import Checkpointer, CheckpointSchedule, SavedShard
from trainyard.tensorhash import reportable
from trainyard.context import Context, open_context
from trainyard.data import MANIFEST_FILE, DatasetManifest, TokenDataset, load_dataset_manifest
from trainyard.environment import (
    LOCAL_ENV,
    apply_spec_choices,
    checkpoint_request,
    local_settings,
    missing_rank_variables,
    not_in_trainyard_message,
    read_allocation,
)
from trainyard.exits import RankEnd, exit_code_for
from trainyard.loader import DataLoader
from trainyard.metrics import PeakFlops, device_peak_flops, mfu
from trainyard.policy import BoundaryAgreement, checkpoint_policy
from trainyard.preemption import CheckpointRequest, StoppedOnRequest, plan_boundary
from trainyard.restore import restore as restore_state
from trainyard.runrecord import CheckpointPolicyRecord, RestoreRecord
from trainyard.runtime import (
    Runtime,
    configure_determinism,
    init_distributed,
    rank_cpu_threads,
    select_runtime,
    shutdown_distributed,
    usable_cores,
)
from trainyard.sampler import GlobalSampler
from trainyard.shardcache import ShardCache
from trainyard.settings import RankSettings
from trainyard.state import Progress, RngState
from trainyard.timing import Timing

__all__ = ["Run", "conclude", "init"]

log = logging.getLogger("trainyard")
_tracer = trace.get_tracer("trainyard")
PEAK_FLOPS_CACHE = ("calibration", "peak-flops.json")  # under the node's root (the artifact root when local)


class Run:
    """One rank of a trainyard job; see the module docstring. Open it with :func:`init` (scripts)
    or :meth:`open` (the built-in trainer, which handles its own exit)."""

    def __init__(self, *, settings: RankSettings, allocation: GangAllocated, runtime: Runtime, ctx: Context,
                 spool: SpoolWriter, request: CheckpointRequest, end: RankEnd | None = None,
                 local: bool = False, exit_on_error: bool = False) -> None:
        self.settings = settings
        self.allocation = allocation
        self.runtime = runtime
        self.ctx = ctx
        self.spool = spool
        self.request = request
        self.end = end if end is not None else RankEnd()
        self.local = local
        self.exit_on_error = exit_on_error
        self.layout = ArtifactLayout(settings.artifact_root)  # checkpoints, datasets: maybe an object store
        self.node_layout = ArtifactLayout(settings.local_root)  # the attempt's own files, on this node
        training = allocation.spec.training
        self.progress = Progress()
        self.rng = RngState(settings.rank, runtime.device, seed=training.seed)
        self.timing = Timing(synchronize=runtime.synchronize)
        self.policy: CheckpointPolicyRecord = checkpoint_policy(self)
        self.schedule = CheckpointSchedule(max_steps=training.max_steps, every_steps=self.policy.every_steps,
                                           every_minutes=self.policy.every_minutes, last_save_at=time.monotonic())
        self.checkpointer = Checkpointer(rank=settings.rank, mode=settings.checkpoint_mode, barrier=ctx.barrier,
                                         agree=ctx.agree, group=ctx.background, device=runtime.device)
        self.agreement = BoundaryAgreement(ctx)
        self.restored: RestoreRecord | None = None
        self.stopped: StoppedOnRequest | None = None
        self.parallelism: dict[str, int] = {"dp": settings.world_size, "tp": 1, "pp": 1}
        self.peak: PeakFlops | None = None
        self.flops_per_token: float | None = None
        self._last_saved: int | None = None
        self._counted = 0  # the last step whose tokens run.progress counted
        self._last_report = time.perf_counter()
        self._nan_at: int | None = None
        self._metrics_file: Any = None
        self._closers = contextlib.ExitStack()
        self._closed = False
        self._hook = (register_optimizer_step_pre_hook(self._before_optimizer_step)
                      if settings.checkpoint_mode == "async" else None)

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, settings: RankSettings, *, end: RankEnd | None = None, request: CheckpointRequest | None = None,
             local: bool = False, exit_on_error: bool = False) -> Run:
        """Read the allocation, choose device and backend, seed, join the process group, open the spool.

        Raises trainyard's errors (ConfigError: exit 2); on success the caller owns the run and
        must :meth:`close` it (``with`` does)."""
        request = request or checkpoint_request(settings)
        allocation = read_allocation(settings)
        settings = apply_spec_choices(settings, allocation.spec)
        if (allocation.job_id, allocation.attempt) != (settings.job_id, settings.attempt):
            raise ConfigError(f"allocation file is for job {allocation.job_id} attempt {allocation.attempt}, "
                              f"the environment says {settings.job_id} attempt {settings.attempt}")
        if allocation.world_size != settings.world_size:
            raise ConfigError(f"allocation has world size {allocation.world_size}, WORLD_SIZE is {settings.world_size}")
        runtime = select_runtime(settings)
        training = allocation.spec.training
        configure_determinism(runtime, seed=training.seed, rank=settings.rank, deterministic=training.deterministic,
                              cpu_threads=rank_cpu_threads(settings, usable_cores()))
        init_distributed(settings, runtime)  # local mode too: a world of one, so user collectives work
        try:
            ctx = open_context(settings.rank, settings.world_size)
            spool = SpoolWriter(settings.events_file)
        except BaseException:
            shutdown_distributed()
            raise
        return cls(settings=settings, allocation=allocation, runtime=runtime, ctx=ctx, spool=spool,
                   request=request, end=end, local=local, exit_on_error=exit_on_error)

    # ------------------------------------------------------------------ who and where

    @property
    def rank(self) -> int:
        return self.settings.rank

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    @property
    def local_rank(self) -> int:
        return self.settings.local_rank

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def backend(self) -> str:
        return self.runtime.backend

    @property
    def job_id(self) -> str:
        return self.settings.job_id

    @property
    def attempt(self) -> int:
        return self.settings.attempt

    @property
    def spec(self) -> TrainingSpec:
        return self.allocation.spec

    @property
    def model_config(self) -> ModelConfig:
        """The spec's ``modelConfig``: inline, or a catalog entry (``gpt-tiny@v1``) resolved."""
        ref = self.spec.model_config_ref
        try:
            return resolve_model(ref) if isinstance(ref, str) else ref
        except KeyError as exc:
            raise ConfigError(str(exc.args[0])) from None

    @property
    def max_steps(self) -> int:
        return self.spec.training.max_steps

    @property
    def tokens_per_step(self) -> int:
        t = self.spec.training
        return t.global_batch_size * t.sequence_length

    @property
    def attempt_dir(self) -> Path:
        s = self.settings
        return self.node_layout.attempt_dir(s.tenant, s.job_id, s.attempt)

    @property
    def dataset_manifest_path(self) -> Path:
        return self.layout.dataset_ref_dir(self.spec.dataset) / MANIFEST_FILE

    def dataset(self) -> DatasetManifest:
        """The manifest of the spec's dataset (tokenizer, vocabulary size, shards)."""
        return load_dataset_manifest(self.dataset_manifest_path)

    # ------------------------------------------------------------------ data

    def data_loader(self, *, dp: int | None = None, dp_rank: int | None = None,
                    device: torch.device | None = None) -> DataLoader:
        """A resumable, deterministic loader over the spec's dataset, this rank's rows of every step.

        ``dp`` / ``dp_rank``: the data-parallel size and this rank's place in it (default: every
        rank is a data-parallel rank). The batch comes from the spec (``globalBatchSize``,
        ``microBatchSize``, ``sequenceLength``, ``seed``)."""
        t = self.spec.training
        dp = self.world_size if dp is None else dp
        dp_rank = self.rank if dp_rank is None else dp_rank
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError(
                f"training.globalBatchSize {t.global_batch_size} is not a multiple of microBatchSize "
                f"{t.micro_batch_size} x data-parallel size {dp}: choose sizes that divide")
        try:
            dataset = TokenDataset(self.dataset_manifest_path, t.sequence_length, cache=self._shard_cache())
        except FileNotFoundError as exc:
            raise DataError(f"dataset {self.spec.dataset} not found at {self.dataset_manifest_path}: {exc}") from exc
        sampler = GlobalSampler(len(dataset), seed=t.seed, global_batch=t.global_batch_size,
                                micro_batch=t.micro_batch_size, dp=dp, dp_rank=dp_rank)
        return DataLoader(dataset, sampler, device or self.device)

    def _shard_cache(self) -> ShardCache | None:
        """The node's shard cache, for a dataset in an object store (None for a directory: read in place)."""
        if not self.layout.remote:
            return None
        limit = self.settings.shard_cache_max_gb
        cache = ShardCache(self.settings.shard_cache_path, rank=self.rank,
                           max_bytes=None if limit is None else int(limit * 1e9),
                           min_free_bytes=int(self.settings.shard_cache_min_free_gb * 1e9))
        self._closers.callback(cache.close)
        return cache

    # ------------------------------------------------------------------ restore / checkpoint

    def full_state(self, state: Mapping[str, Stateful]) -> dict[str, Stateful]:
        """``state`` plus the run's own ``progress`` (step, tokens) and ``rng`` (this rank's generators),
        unless the caller brings its own under those keys."""
        full = dict(state)
        full.setdefault("progress", self.progress)
        full.setdefault("rng", self.rng)
        return full

    def restore(self, state: Mapping[str, Stateful]) -> int:
        """Load the allocation's start checkpoint into ``state``; the step it was saved at (0: none).

        Verified first (manifest, every file's size and sha256, split over the ranks); a
        checkpoint that fails is refused (CheckpointRefused) and the previous READY one tried.
        None verifying raises NoVerifiedCheckpointError (exit 4). Every rank calls it."""
        full = self.full_state(state)
        self.restored = restore_state(self, full, self.ctx, self.layout, self.spool, node_layout=self.node_layout)
        step = full["progress"].global_step  # type: ignore[attr-defined]
        self._last_saved = step if self.restored.manifest_uri is not None else None
        self._counted = max(self._counted, self.progress.global_step)
        self.end.global_step = step
        self.schedule.saved(time.monotonic())
        self._last_report = time.perf_counter()
        return step

    def checkpoint(self, step: int, state: Mapping[str, Stateful],
                   on_durable: Callable[[SavedShard, int], None] | None = None) -> bool:
        """The step boundary (a collective: every rank, every step, the same ``step``): save when the
        policy or a request says so; True when a save of ``step`` started.

        Async mode (the default): the state is copied in the background and written while the
        next step runs; the next ``optimizer.step()`` waits for the copy. A request stops the run
        (:meth:`should_stop`) once the save is durable. ``on_durable(saved, step)`` runs on every
        rank when its shard is durable and its ShardWritten spooled."""
        full = self.full_state(state)
        progress: Progress = full["progress"]  # type: ignore[assignment]
        if progress is self.progress:
            self.advance(step)
        elif progress.global_step < step:
            progress.global_step = step
        boundary = self.agreement.collect()  # what every rank sent at the previous boundary
        stall = self.checkpointer.settle(done_save=boundary.done_save, failed_save=boundary.failed_save)
        decided = plan_boundary(step=step, max_steps=self.max_steps,
                                due=self.schedule.due_by_step(step) or boundary.due,
                                requested=boundary.requested, last_saved_step=self._last_saved)
        if decided.stop:
            log.warning("checkpoint requested%s: %s step %d, then stopping", " (signal)" if self.request.signalled
                        else "", "saving" if decided.save else "already saved", step)
        if decided.save:
            stall += self._save(step, full, progress, on_durable)
            self.schedule.saved(time.monotonic())
            self._last_saved = step
        if decided.stop or (decided.save and step >= self.max_steps):
            stall += self.checkpointer.wait()  # durable, and its ShardWritten spooled
        elif step < self.max_steps:
            self.agreement.send(self.schedule, self.checkpointer, self.request)
        self.timing.add(checkpoint=stall)
        if decided.stop:
            self.stopped = StoppedOnRequest(step, saved=decided.save)
        return decided.save

    def advance(self, step: int, *, tokens: int | None = None, samples: int | None = None) -> Progress:
        """Count ``step`` as done in ``run.progress`` (once: :meth:`report` and :meth:`checkpoint` call
        it; the first call for a step counts its tokens and samples, default the spec's global batch)."""
        p = self.progress
        if step > self._counted:
            t = self.spec.training
            p.consumed_tokens += self.tokens_per_step if tokens is None else tokens
            p.consumed_samples += t.global_batch_size if samples is None else samples
            self._counted = step
        p.global_step = max(p.global_step, step)
        self.end.global_step = step
        return p

    def should_stop(self) -> bool:
        """Whether the ranks agreed, at the last :meth:`checkpoint`, to stop (pause or preemption);
        the step is saved and durable. Leave the loop; the run exits 7 and resumes there later."""
        return self.stopped is not None

    def before_update(self) -> float:
        """Wait until a pending asynchronous save has its copy of the state (seconds waited).

        Called for you before every ``optimizer.step()``; call it yourself before changing the
        checkpointed state in place any other way (an EMA, a manual weight update)."""
        return self.checkpointer.before_update()

    def wait(self) -> float:
        """Until the pending save (if any) is durable and reported (a collective); seconds waited."""
        waited = self.checkpointer.wait()
        self.timing.add(checkpoint=waited)
        return waited

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        waited = self.checkpointer.before_update()
        if waited:
            self.timing.add(checkpoint=waited)

    def _save(self, step: int, state: dict[str, Stateful], progress: Progress,
              on_durable: Callable[[SavedShard, int], None] | None) -> float:
        s = self.settings
        tokens, samples = progress.consumed_tokens, progress.consumed_samples
        directory = self.layout.checkpoint_dir(s.tenant, s.job_id, s.attempt, step)
        span = _tracer.start_span("checkpoint save", attributes={
            "trainyard.job_id": s.job_id, "trainyard.rank": s.rank, "trainyard.global_step": step,
            "trainyard.attempt": s.attempt, "trainyard.checkpoint_mode": s.checkpoint_mode})

        def durable(saved: SavedShard) -> None:
            self._shard_written(saved, step=step, tokens=tokens, samples=samples, span=span)
            if on_durable is not None:
                on_durable(saved, step)

        return self.checkpointer.save(state, directory, durable)

    def _shard_written(self, saved: SavedShard, *, step: int, tokens: int, samples: int, span: Any) -> None:
        s = self.settings
        stall = saved.seconds if saved.stall is None else saved.stall
        tensors = reportable(saved.tensors)
        if tensors is None and saved.tensors is not None:
            log.warning("checkpoint step %d: the digests of the %d entries this rank saved do not fit in its shard "
                        "report; the checkpoint gets no tensorsHash", step, len(saved.tensors))
        with trace.use_span(span, end_on_exit=True):
            span.set_attribute("trainyard.shard_bytes", saved.shard.size_bytes)
            self.spool.write(ShardWritten(
                job_id=s.job_id, tenant=s.tenant, attempt=s.attempt, epoch=s.epoch, global_step=step, rank=s.rank,
                world_size=s.world_size, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes,
                sha256=saved.shard.sha256, extra_files=saved.extra_files, consumed_tokens=tokens,
                consumed_samples=samples, spec_hash=self.allocation.spec_hash, parallelism=dict(self.parallelism),
                write_seconds=max(saved.seconds, 0.0), stall_seconds=max(stall, 0.0), tensor_digests=tensors,
            ), traceparent=current_traceparent())
        log.info("checkpoint step %d durable: %s (%d bytes, %.2fs from start to rename)", step, saved.shard.uri,
                 saved.shard.size_bytes, saved.seconds)

    # ------------------------------------------------------------------ metrics

    def enable_mfu(self, flops_per_token: float) -> PeakFlops | None:
        """Report MFU from now on: the model's training FLOPs per token (6N + attention) against the
        device's peak (a table, ``TRAINYARD_PEAK_FLOPS``, or a CPU probe run once per host). A collective."""
        s, runtime = self.settings, self.runtime
        cache = self.node_layout.root.joinpath(*PEAK_FLOPS_CACHE)
        first_on_host = s.local_rank == 0
        if first_on_host:
            self.peak = device_peak_flops(runtime.device, runtime.autocast_dtype, cache_file=cache,
                                          override=s.peak_flops)
        self.ctx.barrier()  # the others read the first rank's probe from the cache
        if not first_on_host:
            self.peak = device_peak_flops(runtime.device, runtime.autocast_dtype, cache_file=cache,
                                          override=s.peak_flops)
        self.flops_per_token = flops_per_token
        return self.peak

    def report(self, step: int, *, loss: float, tokens: int | None = None, samples: int | None = None,
               lr: float | None = None, **metrics: float) -> StepMetrics:
        """StepMetrics for ``step`` (spooled; the platform's metrics, stragglers, goodput read it).

        ``tokens`` / ``samples``: what the whole job consumed in this step (default: the spec's
        global batch). Timing is the window since the previous report (``run.timing``, plus the
        SDK's checkpoint stalls). ``metrics``: your own numbers, logged and appended to
        ``metrics/rank<r>.jsonl`` in the attempt directory, and carried in the event. A non-finite loss raises
        NonFiniteError (exit 3, the exit note names ``step``)."""
        if not math.isfinite(loss):
            self.end.global_step = self._nan_at = step
            raise NonFiniteError(f"loss {loss} at step {step} is not finite")
        now = time.perf_counter()
        seconds, self._last_report = now - self._last_report, now
        t = self.spec.training
        tokens = self.tokens_per_step if tokens is None else tokens
        samples = t.global_batch_size if samples is None else samples
        p = self.advance(step, tokens=tokens, samples=samples)
        times = self.timing.take()
        tokens_per_second = tokens / seconds if seconds > 0 else None
        step_mfu = None
        if tokens_per_second and self.peak and self.flops_per_token:
            step_mfu = mfu(flops_per_token=self.flops_per_token, tokens_per_second=tokens_per_second,
                           devices=self.world_size, peak_flops=self.peak.flops)
        s = self.settings
        event = StepMetrics(
            job_id=s.job_id, tenant=s.tenant, attempt=s.attempt, rank=s.rank, step=step, max_steps=t.max_steps,
            loss=loss, lr=lr, consumed_tokens=p.consumed_tokens, consumed_samples=p.consumed_samples,
            tokens_per_second=tokens_per_second, mfu=step_mfu, step_seconds=seconds,
            compute_seconds=times.compute, collective_seconds=times.collective,
            data_wait_seconds=times.data_wait, checkpoint_seconds=times.checkpoint,
            metrics=_finite_numbers(metrics),
        )
        # A step's metrics need not survive a host crash (the next step's replace them): no fsync.
        self.spool.write(event, traceparent=current_traceparent(), durable=False)
        if metrics:
            self._write_metrics(step, metrics)
        if log.isEnabledFor(logging.INFO):
            extra = "".join(f" {k} {v:.4g}" for k, v in metrics.items())
            log.info("step %d/%d loss %.4f lr %s%s %.0f tok/s mfu %s (data %.3fs compute %.3fs comm %.3fs "
                     "ckpt %.3fs)", step, t.max_steps, loss, f"{lr:.3g}" if lr is not None else "-", extra,
                     tokens_per_second or 0.0, f"{step_mfu:.4f}" if step_mfu is not None else "-",
                     times.data_wait, times.compute, times.collective, times.checkpoint)
        return event

    def _write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._metrics_file is None:
            path = self.attempt_dir / "metrics" / f"rank{self.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics_file = self._closers.enter_context(path.open("a", buffering=1))
        self._metrics_file.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Abandon a pending save (it never gets its final name), close the spool, leave the process
        group (a run opened by :func:`init` keeps it until the process exits). Idempotent; does not
        wait (leaving a ``with`` block without an error does)."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        self.checkpointer.close()
        self._closers.close()
        self.spool.close()
        if not self.exit_on_error:
            shutdown_distributed()
        # A script's run (``init``) leaves the process group up until the process exits: the script's
        # DDP model still holds it, and freeing a Reducer after its group was destroyed can deadlock
        # in gloo's destructor.

    def finish(self, exc: BaseException | None = None) -> int:
        """End the run: on success wait until the last save is durable; the exit code for how it
        ended (0, 7 after an agreed stop, else the error's), the exit note written; closed."""
        try:
            if exc is None:
                try:
                    self.agreement.drain()
                    self.checkpointer.wait()
                except Exception as failed:  # noqa: BLE001 - a failed final save is the run's error
                    exc = failed
            if exc is None and self.stopped is not None:
                exc = self.stopped
            if isinstance(exc, NonFiniteError) and self._nan_at is None:
                self.end.global_step = self.progress.global_step + 1  # the step that was not finite
            return conclude(self.settings, self.end, exc)
        finally:
            self.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: as they are
            self.close()
            return False
        code = self.finish(exc)
        if self.exit_on_error:
            shutdown_tracing()
            if code != exitcodes.OK:
                raise SystemExit(code) from None  # the error is logged (and in the exit note), not a traceback twice
        return False


def conclude(settings: RankSettings, end: RankEnd, exc: BaseException | None) -> int:
    """The exit code for how a rank ended; logs it, marks the current span, writes the exit note."""
    code, error = exitcodes.OK, None
    span = trace.get_current_span()
    if isinstance(exc, StoppedOnRequest):
        code = exit_code_for(exc)
        span.set_attribute("trainyard.stopped_at_step", exc.global_step)
        log.warning("%s (exit %d, %s)", exc, code, exitcodes.exit_reason(code))
    elif exc is not None:
        code = exit_code_for(exc)
        error = f"{type(exc).__name__}: {exc}"
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        if isinstance(exc, TrainyardError | torch.OutOfMemoryError | MemoryError):
            log.error("%s: %s (exit %d, %s)", type(exc).__name__, exc, code, exitcodes.exit_reason(code))
        else:
            log.error("unexpected error (exit %d)", code, exc_info=exc)
    span.set_attribute("trainyard.exit_code", code)
    if settings.exit_note_file is not None:
        try:
            end.write(settings.exit_note_file, code=code, error=error)
        except OSError as note_error:
            log.warning("could not write the exit note %s: %r", settings.exit_note_file, note_error)
    return code


def _configure_logging(settings: RankSettings) -> None:
    if logging.getLogger().handlers:
        return
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # the agent tails it
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stdout,
                        format=f"%(asctime)s rank{settings.rank} %(levelname)s %(name)s: %(message)s")


def _fail(message: str, code: int = exitcodes.CONFIG) -> SystemExit:
    print(message, file=sys.stderr)
    return SystemExit(code)


def init(*, local: bool | None = None, spec: TrainingSpec | str | None = None,
         settings: RankSettings | None = None) -> Run:
    """Open this rank's run from the rank environment; use it as ``with trainyard.init() as run:``.

    Leaving the block waits for the last save to be durable, writes the exit note and exits the
    process with trainyard's code when it is not 0 (7 after a stop on request; an exception's:
    config 2, nan 3, checkpoint 4, data 5, oom 6, else 1). Outside trainyard (no rank environment)
    it prints what is missing and exits 2, unless local mode is on (``local=True`` or
    ``TRAINYARD_LOCAL=1``): a world of one, ``spec`` (a TrainingSpec or a spec.yaml path) or
    ``TRAINYARD_LOCAL_SPEC`` or ``spec.yaml`` beside the script."""
    if local is None:
        local = os.environ.get(LOCAL_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if settings is None:
        try:
            if local:
                settings = local_settings(spec=spec)
            elif missing := missing_rank_variables():
                raise _fail(not_in_trainyard_message(missing))
            else:
                settings = load_settings(RankSettings)
        except ConfigError as exc:
            raise _fail(f"trainyard: {exc}") from None
    _configure_logging(settings)
    setup_tracing("trainyard-rank", instance_id=f"{settings.job_id}/a{settings.attempt}/r{settings.rank}")
    end = RankEnd()
    scope = contextlib.ExitStack()
    scope.enter_context(job_context(settings.traceparent))
    scope.enter_context(_tracer.start_as_current_span(f"train rank {settings.rank}", attributes={
        "trainyard.job_id": settings.job_id, "trainyard.attempt": settings.attempt,
        "trainyard.rank": settings.rank, "trainyard.world_size": settings.world_size}))
    try:
        run = Run.open(settings, end=end, local=local, exit_on_error=True)
    except Exception as exc:  # noqa: BLE001 - the process boundary: the error becomes an exit code
        code = conclude(settings, end, exc)
        scope.close()
        shutdown_tracing()
        raise SystemExit(code) from None
    run._closers.callback(scope.close)
    if local:
        log.info("local mode: a world of one; artifacts under %s", settings.artifact_root)
    return run


def _finite_numbers(metrics: Mapping[str, float]) -> dict[str, float]:
    """The user's metrics as the event carries them: finite floats (a NaN accuracy is left out, not an error)."""
    out: dict[str, float] = {}
    for name, value in list(metrics.items())[:64]:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"run.report({name}=…): a metric must be a number, not {type(value).__name__}") from None
        if math.isfinite(number):
            out[str(name)[:128]] = number
    return out
