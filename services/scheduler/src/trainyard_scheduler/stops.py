"""Attempts asked to checkpoint and stop: drains, pauses and preemptions, applied by the leader's pass.

The planner decides whom to preempt; the pure transitions (:func:`transitions.request_preemption`,
:func:`request_drain`, :func:`check_preemption`) decide each record's next state under the one stop rule
(``transitions.stop_checkpoint``). This module walks the jobs the pass holds and applies them, fenced.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from trainyard_contract.records import JobRecord
from trainyard_runtime.store import StateStore

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.jobtx import Facts
from trainyard_scheduler.planner import Preempt
from trainyard_scheduler.queueconfig import QueueConfigSource
from trainyard_scheduler.writer import JobWriter


class Stops:
    """Starts and advances the stops of live attempts (see the module docstring)."""

    def __init__(self, *, store: StateStore, writer: JobWriter, queue: QueueConfigSource, pause_grace_s: float,
                 clock: Callable[[], datetime]) -> None:
        self.store, self.writer, self.queue, self.clock = store, writer, queue, clock
        self.pause_grace_s = pause_grace_s

    async def preempt(self, decision: Preempt, epoch: int) -> None:
        """Ask each victim of ``decision`` to checkpoint and stop for its preemptor."""
        grace = self.queue.config.preemption.checkpoint_grace_seconds
        for victim in decision.victims:
            latest = await self.store.latest_ready_checkpoint(victim)

            def decide(job: JobRecord, _: Facts, step: int | None = latest.global_step if latest else None
                       ) -> tr.Outcome:
                return tr.request_preemption(job, by=decision.job_id, reason=decision.reason,
                                             latest_ready_step=step, grace_s=grace, now=self.clock())

            await self.writer.mutate(victim, decide, label="preempt", fence=epoch)

    async def advance_drains(self, jobs: dict[str, JobRecord], epoch: int, drains: dict[str, dict]) -> None:
        """Ask the live attempts on drained nodes to checkpoint and stop (once; the pause protocol)."""
        if not drains:
            return
        for job in list(jobs.values()):
            current = job.current
            if not tr.is_live(current) or current is None or current.interruption is not None:
                continue
            hit = [n for n in current.nodes if n in drains]
            if not hit:
                continue
            entry = drains[hit[0]]
            reason = f"node {', '.join(hit)} drained by {entry.get('by') or 'admin'} ({entry.get('reason')})"

            def decide(j: JobRecord, facts: Facts, r: str = reason) -> tr.Outcome:
                return tr.request_drain(j, reason=r, latest_ready_step=facts.latest_ready_step,
                                        grace_s=self.pause_grace_s, now=self.clock())

            outcome = await self.writer.mutate(job.job_id, decide, need_checkpoints=True, label="drain", fence=epoch)
            if outcome is not None and outcome.changed:
                jobs[job.job_id] = outcome.job

    async def advance_preemptions(self, jobs: dict[str, JobRecord], epoch: int) -> None:
        """Revoke pausing or preempted attempts whose checkpoint is READY or whose grace ran out;
        withdraw needless preemptions."""
        grace = self.queue.config.preemption.checkpoint_grace_seconds
        for job in list(jobs.values()):
            current = job.current
            if current is None or not tr.is_stopping(job):
                continue
            preemptor = jobs.get(current.preempted_by) if current.preempted_by else None
            waiting = preemptor is not None and tr.is_pending(preemptor)

            def decide(j: JobRecord, facts: Facts, w: bool = waiting) -> tr.Outcome:
                return tr.check_preemption(j, latest_ready_step=facts.latest_ready_step, preemptor_waiting=w,
                                           grace_s=grace, now=self.clock(), pause_grace_s=self.pause_grace_s)

            outcome = await self.writer.mutate(job.job_id, decide, need_checkpoints=True, label="preemption",
                                               fence=epoch)
            if outcome is not None and outcome.changed:
                jobs[job.job_id] = outcome.job
