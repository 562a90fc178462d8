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
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from torch.distributed.checkpoint.stateful import Stateful
from trainyard_contract import exitcodes
from trainyard_contract.catalog import ModelConfig, resolve_model
from trainyard_contract.errors import (
    ConfigError,
    NonFiniteError,
    TrainyardError,
)
from trainyard_contract.events import GangAllocated, StepMetrics
from trainyard_contract.settings import load_settings
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.spool import SpoolWriter
from trainyard_contract.storage import ArtifactLayout
from trainyard_contract.tracing import (
    job_context,
    setup_tracing,
    shutdown_tracing,
)

from trainyard.boundary import StepBoundary
from trainyard.checkpoint import Checkpointer, CheckpointSchedule, SavedShard
from trainyard.context import Context, open_context
from trainyard.data import (
    MANIFEST_FILE,
    DatasetManifest,
    load_dataset_manifest,
)
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
from trainyard.loader import DataLoader, open_loader
from trainyard.metrics import PeakFlops
from trainyard.policy import BoundaryAgreement, checkpoint_policy
from trainyard.preemption import CheckpointRequest, StoppedOnRequest
from trainyard.reporting import EvaluationReports, StepReporter
from trainyard.replicas import Replicas, is_replacement, open_replicas, replacement_view
from trainyard.restore import restore as restore_state
from trainyard.runrecord import CheckpointPolicyRecord, RestoreRecord
from trainyard.runtime import (
    Runtime,
    configure_determinism,
    init_distributed,
    init_replica_world,
    rank_cpu_threads,
    select_runtime,
    shutdown_distributed,
    usable_cores,
)
from trainyard.settings import RankSettings
from trainyard.shardcache import ShardCache
from trainyard.state import Progress, RngState
from trainyard.timing import Timing

__all__ = ["Run", "conclude", "init"]

log = logging.getLogger("trainyard")
_tracer = trace.get_tracer("trainyard")


class Run(EvaluationReports):
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
        self.rng = RngState(settings.rank, runtime.device, seed=training.seed)
        self.timing = Timing(synchronize=runtime.synchronize)
        self._closers = contextlib.ExitStack()
        self._closed = False
        self.reporter = StepReporter(settings, allocation.spec, spool=spool, timing=self.timing, end=self.end,
                                     attempt_dir=self.attempt_dir, node_root=self.node_layout.root,
                                     closers=self._closers)
        self.progress = self.reporter.progress
        self.policy: CheckpointPolicyRecord = checkpoint_policy(self)
        self.schedule = CheckpointSchedule(max_steps=training.max_steps, every_steps=self.policy.every_steps,
                                           every_minutes=self.policy.every_minutes, last_save_at=time.monotonic())
        self.checkpointer = Checkpointer(rank=ctx.rank, mode=settings.checkpoint_mode, barrier=ctx.barrier,
                                         agree=ctx.agree, group=ctx.background, device=runtime.device)
        self.agreement = BoundaryAgreement(ctx)
        self.boundary = StepBoundary(settings, spec_hash=allocation.spec_hash, max_steps=training.max_steps,
                                     layout=self.layout, spool=spool, schedule=self.schedule,
                                     checkpointer=self.checkpointer, agreement=self.agreement, request=request,
                                     timing=self.timing, writers=ctx.world_size,
                                     writes=allocation.spec.fault_tolerance is None or settings.rank == 0)
        self.restored: RestoreRecord | None = None

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, settings: RankSettings, *, end: RankEnd | None = None, request: CheckpointRequest | None = None,
             local: bool = False, exit_on_error: bool = False) -> Run:
        """Read the allocation, choose device and backend, seed, join the process group, open the spool.

        Raises trainyard's errors (ConfigError: exit 2); on success the caller owns the run and
        must :meth:`close` it (``with`` does)."""
        joined = join_job(settings, request or checkpoint_request(settings))
        return cls(**vars(joined), end=end, local=local, exit_on_error=exit_on_error)

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
        return self.reporter.tokens_per_step

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
        return open_loader(self.spec, self.dataset_manifest_path, dp=self.world_size if dp is None else dp,
                           dp_rank=self.rank if dp_rank is None else dp_rank, device=device or self.device,
                           cache=self._shard_cache)

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
        None verifying raises NoVerifiedCheckpointError (exit 4). Every rank calls it (a replaced replica of a
        fault-tolerant job: the newest READY one, then it heals from a peer, :mod:`trainyard.replicas`)."""
        full = self.full_state(state)
        job = replacement_view(self) if is_replacement(self.spec) else self
        self.restored = restore_state(job, full, self.ctx, self.layout, self.spool, node_layout=self.node_layout)
        step = full["progress"].global_step  # type: ignore[attr-defined]  # the run's Progress entry
        self.boundary.last_saved = step if self.restored.manifest_uri is not None else None
        self.reporter.restored(step)
        self.schedule.saved(time.monotonic())
        return step

    def replicas(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 extra: Mapping[str, Stateful] | None = None) -> Replicas:
        """This replica of a fault-tolerant job (:mod:`trainyard.replicas`); ``extra``: more state a replica
        that rejoins loads from a healthy peer, besides the model, optimizer and progress."""
        return open_replicas(self, model, optimizer, extra, closers=self._closers)

    def checkpoint(self, step: int, state: Mapping[str, Stateful],
                   on_durable: Callable[[SavedShard, int], None] | None = None) -> bool:
        """The step boundary (a collective: every rank, every step, the same ``step``): save when the
        policy or a request says so; True when a save of ``step`` started.

        Async mode (the default): the state is copied in the background and written while the
        next step runs; the next ``optimizer.step()`` waits for the copy. A request stops the run
        (:meth:`should_stop`) once the save is durable. ``on_durable(saved, step)`` runs on every
        rank when its shard is durable and its ShardWritten spooled."""
        full = self.full_state(state)
        progress: Progress = full["progress"]  # type: ignore[assignment]  # the run's Progress entry
        if progress is self.progress:
            self.advance(step)
        elif progress.global_step < step:
            progress.global_step = step
        return self.boundary.decide(step, full, progress, on_durable)

    def advance(self, step: int, *, tokens: int | None = None, samples: int | None = None) -> Progress:
        """Count ``step`` as done in ``run.progress`` (once: :meth:`report` and :meth:`checkpoint` call
        it; the first call for a step counts its tokens and samples, default the spec's global batch)."""
        return self.reporter.advance(step, tokens=tokens, samples=samples)

    def should_stop(self) -> bool:
        """Whether the ranks agreed, at the last :meth:`checkpoint`, to stop (pause or preemption);
        the step is saved and durable. Leave the loop; the run exits 7 and resumes there later."""
        return self.stopped is not None

    @property
    def stopped(self) -> StoppedOnRequest | None:
        """The agreed stop (its step, whether it saved there), once the ranks agreed on one."""
        return self.boundary.stopped

    @property
    def parallelism(self) -> dict[str, int]:
        """The layout this rank's shards are saved in (``dp``, ``tp``, ``pp``; set by a parallel trainer)."""
        return self.boundary.parallelism

    @parallelism.setter
    def parallelism(self, layout: dict[str, int]) -> None:
        self.boundary.parallelism = layout

    def before_update(self) -> float:
        """Wait until a pending asynchronous save has its copy of the state (seconds waited).

        Called for you before every ``optimizer.step()``; call it yourself before changing the
        checkpointed state in place any other way (an EMA, a manual weight update)."""
        return self.checkpointer.before_update()

    def wait(self) -> float:
        """Until the pending save (if any) is durable and reported (a collective); seconds waited."""
        return self.boundary.wait()

    # ------------------------------------------------------------------ metrics

    @property
    def peak(self) -> PeakFlops | None:
        return self.reporter.peak

    @property
    def flops_per_token(self) -> float | None:
        return self.reporter.flops_per_token

    def enable_mfu(self, flops_per_token: float) -> PeakFlops | None:
        """Report MFU from now on: the model's training FLOPs per token (6N + attention) against the
        device's peak (a table, ``TRAINYARD_PEAK_FLOPS``, or a CPU probe run once per host). A collective."""
        return self.reporter.enable_mfu(self.runtime, self.ctx, flops_per_token)

    def report(self, step: int, *, loss: float, tokens: int | None = None, samples: int | None = None,
               lr: float | None = None, **metrics: float) -> StepMetrics:
        """StepMetrics for ``step`` (spooled; the platform's metrics, stragglers, goodput read it).

        ``tokens`` / ``samples``: what the whole job consumed in this step (default: the spec's
        global batch). Timing is the window since the previous report (``run.timing``, plus the
        SDK's checkpoint stalls). ``metrics``: your own numbers, logged and appended to
        ``metrics/rank<r>.jsonl`` in the attempt directory, and carried in the event. A non-finite loss raises
        NonFiniteError (exit 3, the exit note names ``step``)."""
        return self.reporter.report(step, loss=loss, tokens=tokens, samples=samples, lr=lr, metrics=metrics)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Abandon a pending save (it never gets its final name), close the spool, leave the process
        group (a run opened by :func:`init` keeps it until the process exits). Idempotent; does not
        wait (leaving a ``with`` block without an error does)."""
        if self._closed:
            return
        self._closed = True
        self.boundary.close()
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
            if isinstance(exc, NonFiniteError) and self.reporter.nan_at is None:
                self.end.global_step = self.progress.global_step + 1  # the step that was not finite
            return conclude(self.settings, self.end, exc)
        finally:
            self.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is not None and not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: as they are
            self.close()
            return False
        code = self.finish(exc)
        if self.exit_on_error:
            shutdown_tracing()
            if code != exitcodes.OK or exc is not None:  # an exception that is no failure (NothingToHeal): exit 0
                raise SystemExit(code) from None  # the error is logged (and in the exit note), not a traceback twice
        return False


@dataclass(frozen=True)
class Joined:
    """What :meth:`Run.open` hands the run: the allocation read and checked, the runtime chosen, the process
    group joined, the context and the spool open."""

    settings: RankSettings
    allocation: GangAllocated
    runtime: Runtime
    ctx: Context
    spool: SpoolWriter
    request: CheckpointRequest


def join_job(settings: RankSettings, request: CheckpointRequest) -> Joined:
    """Read the allocation, choose device and backend, seed, join the process group, open the spool."""
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
    replica = allocation.spec.fault_tolerance is not None
    if replica:  # a replica is its own world of one; torchft's Manager joins the replicas (run.replicas())
        init_replica_world(runtime)
    else:
        init_distributed(settings, runtime)  # local mode too: a world of one, so user collectives work
    try:
        ctx = open_context(0, 1) if replica else open_context(settings.rank, settings.world_size)
        spool = SpoolWriter(settings.events_file)
    except BaseException:
        shutdown_distributed()
        raise
    return Joined(settings, allocation, runtime, ctx, spool, request)


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

