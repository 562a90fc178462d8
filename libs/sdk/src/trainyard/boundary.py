"""The step boundary (design.md §6): the one collective of a step, where the ranks agree — pipelined, on the
previous boundary's exchange (:class:`~trainyard.policy.BoundaryAgreement`) — whether to save this step and
whether to stop after it (:func:`~trainyard.preemption.plan_boundary`, pure), then save (the
:class:`~trainyard.checkpoint.Checkpointer`, asynchronous by default) and spool each rank's ShardWritten once
its shard is durable. :class:`~trainyard.run.Run` delegates here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.optimizer import register_optimizer_step_pre_hook
from trainyard_contract.events import ShardWritten
from trainyard_contract.spool import SpoolWriter
from trainyard_contract.storage import ArtifactLayout
from trainyard_contract.tracing import current_traceparent

from trainyard.checkpoint import Checkpointer, CheckpointSchedule, SavedShard
from trainyard.policy import BoundaryAgreement
from trainyard.preemption import CheckpointRequest, StoppedOnRequest, plan_boundary
from trainyard.settings import RankSettings
from trainyard.state import Progress
from trainyard.tensorhash import reportable
from trainyard.timing import Timing

log = logging.getLogger("trainyard")
_tracer = trace.get_tracer("trainyard")

OnDurable = Callable[[SavedShard, int], None]


class StepBoundary:
    """Decides at each boundary whether to save and stop, saves, and reports the durable shards."""

    def __init__(self, settings: RankSettings, *, spec_hash: str, max_steps: int, layout: ArtifactLayout,
                 spool: SpoolWriter, schedule: CheckpointSchedule, checkpointer: Checkpointer,
                 agreement: BoundaryAgreement, request: CheckpointRequest, timing: Timing, writers: int | None = None,
                 writes: bool = True) -> None:
        """``writers``: the ranks that write each checkpoint (default the world; a fault-tolerant job's: replica
        0 alone, a world of one); ``writes``: whether this rank is one of them (the other replicas skip the save
        and take the same decisions, stops included)."""
        self.settings, self.spec_hash, self.max_steps, self.layout = settings, spec_hash, max_steps, layout
        self.spool, self.schedule, self.checkpointer = spool, schedule, checkpointer
        self.agreement, self.request, self.timing = agreement, request, timing
        self.writers = settings.world_size if writers is None else writers
        self.writes = writes
        self.parallelism: dict[str, int] = {"dp": self.writers, "tp": 1, "pp": 1}
        self.last_saved: int | None = None
        self.stopped: StoppedOnRequest | None = None
        self._hook = (register_optimizer_step_pre_hook(self._before_optimizer_step)
                      if settings.checkpoint_mode == "async" else None)

    def decide(self, step: int, full: dict[str, Stateful], progress: Progress, on_durable: OnDurable | None) -> bool:
        """The boundary at ``step`` (see :meth:`trainyard.run.Run.checkpoint`); True when a save started."""
        boundary = self.agreement.collect()  # what every rank sent at the previous boundary
        stall = self.checkpointer.settle(done_save=boundary.done_save, failed_save=boundary.failed_save)
        decided = plan_boundary(step=step, max_steps=self.max_steps,
                                due=self.schedule.due_by_step(step) or boundary.due,
                                requested=boundary.requested, last_saved_step=self.last_saved)
        if decided.stop:
            log.warning("checkpoint requested%s: %s step %d, then stopping", " (signal)" if self.request.signalled
                        else "", "saving" if decided.save else "already saved", step)
        if decided.save and self.writes:
            stall += self._save(step, full, progress, on_durable)
            self.schedule.saved(time.monotonic())
            self.last_saved = step
        if decided.stop or (decided.save and step >= self.max_steps):
            stall += self.checkpointer.wait()  # durable, and its ShardWritten spooled
        elif step < self.max_steps:
            self.agreement.send(self.schedule, self.checkpointer, self.request)
        self.timing.add(checkpoint=stall)
        if decided.stop:
            self.stopped = StoppedOnRequest(step, saved=decided.save)
        return decided.save and self.writes

    def wait(self) -> float:
        """Until the pending save (if any) is durable and reported (a collective); seconds waited."""
        waited = self.checkpointer.wait()
        self.timing.add(checkpoint=waited)
        return waited

    def close(self) -> None:
        """Abandon a pending save (it never gets its final name); unhook the optimizers."""
        if self._hook is not None:
            self._hook.remove()
        self.checkpointer.close()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        waited = self.checkpointer.before_update()
        if waited:
            self.timing.add(checkpoint=waited)

    def _save(self, step: int, state: dict[str, Stateful], progress: Progress, on_durable: OnDurable | None) -> float:
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
                world_size=self.writers, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes,
                sha256=saved.shard.sha256, extra_files=saved.extra_files, consumed_tokens=tokens,
                consumed_samples=samples, spec_hash=self.spec_hash, parallelism=dict(self.parallelism),
                write_seconds=max(saved.seconds, 0.0), stall_seconds=max(stall, 0.0), tensor_digests=tensors,
            ), traceparent=current_traceparent())
        log.info("checkpoint step %d durable: %s (%d bytes, %.2fs from start to rename)", step, saved.shard.uri,
                 saved.shard.size_bytes, saved.seconds)
