"""The job, worker and checkpoint handlers: an event decoded, a pure transition, the job written (any instance).

* JOBS     JobSubmitted → a wake-up and an audit, never a way in: the job is the record the API wrote, taken in by
           the leader's pass from the change log (:mod:`trainyard_scheduler.intake`, the one door). A JobSubmitted
           without the API's record is refused; one that differs from it loses to it. JobControlRequested →
           cancel/pause/resume, acted on only when the API recorded it (``Keys.control_requests``) as the event
           says. Anyone on the broker can publish either, so a refused event is dead-lettered ``security: …``,
           logged, counted (``trainyard_scheduler_unauthorised_events_total``) and alerted on (deploy/prometheus).
* WORKERS  WorkerStarted / WorkerExited / SecurityViolation → attempt and job transitions; a failure blames its node;
  EnvironmentPreparing → noted on the attempt (it restarts the start time-out).
* CHECKPOINTS CheckpointReady → success once the attempt completed and maxSteps is READY; ends a pause, drain or
           preemption once it is the ranks' own stop checkpoint and every rank has exited
           (transitions.stop_checkpoint). CheckpointFailed → the attempt's failure rules.

Handlers apply facts and are safe from any instance (design.md §3.7); each job change is one
:meth:`JobWriter.mutate`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from redis.asyncio import Redis

from trainyard_contract.events import (
    CheckpointFailed,
    CheckpointReady,
    Event,
    JobControlRequested,
    JobSubmitted,
    SecurityViolation,
    WorkerExited,
    WorkerStarted,
    EnvironmentPreparing,
)
from trainyard_contract.records import JobRecord
from trainyard_runtime.bus import Deduper
from trainyard_runtime.controlrecords import Refusal, UnauthorisedEventError, control_refusal, parse_control_request
from trainyard_runtime.store import Keys, StateStore

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.jobtx import Facts
from trainyard_scheduler.metrics import UNAUTHORISED_EVENTS
from trainyard_scheduler.queueconfig import QueueConfigSource
from trainyard_scheduler.writer import JobWriter, WakeAt

log = logging.getLogger(__name__)


def submission_refusal(event: JobSubmitted, stored: JobRecord | None) -> Refusal | None:
    """Why a JobSubmitted is not the job as the API stored it (None: it is): no record at all (``unrecorded``:
    the event is ignored), or a record with another tenant or spec (``mismatch``: the record wins)."""
    if stored is None:
        return Refusal("unrecorded", f"job {event.job_id} (tenant {event.tenant!r}): no job record written by the API")
    differs = [f"{name} {got!r} (stored {want!r})" for name, got, want in (
        ("tenant", event.tenant, stored.tenant), ("spec", event.spec_hash, stored.spec_hash)) if got != want]
    if differs:
        return Refusal("mismatch", f"job {event.job_id}: the event carries {', '.join(differs)}")
    return None


def refuse(event_type: str, event: JobSubmitted | JobControlRequested, refusal: Refusal, *, fatal: bool) -> None:
    """Count and log an event the API's record does not back; ``fatal``: refuse it (UnauthorisedEventError, so the
    bus dead-letters it ``security: …`` without marking its id handled), else the record wins and handling goes on."""
    UNAUTHORISED_EVENTS.labels(event_type, refusal.kind).inc()
    if not fatal:
        log.warning("%s %s: %s; keeping the stored job", event_type, event.event_id, refusal.text)
        return
    log.warning("forged/%s %s %s ignored: %s", "unknown" if event_type == "JobSubmitted" else "unrecorded",
                event_type, event.event_id, refusal.text)
    raise UnauthorisedEventError(event_type, refusal)


class JobHandlers:
    """The handlers of the job, worker and checkpoint topics (see the module docstring)."""

    def __init__(self, *, redis: Redis, store: StateStore, writer: JobWriter, queue: QueueConfigSource,
                 pause_grace_s: float, clock: Callable[[], datetime], wake_at: WakeAt) -> None:
        self.redis, self.store, self.writer, self.queue, self.clock = redis, store, writer, queue, clock
        self.pause_grace_s = pause_grace_s
        self._wake_at = wake_at
        self.seen: Deduper | None = None  # the worker batches' handled ids (Scheduler.install sets it)

    # ------------------------------------------------------------------ jobs
    async def on_job_submitted(self, event: JobSubmitted) -> None:
        """A wake-up and an audit: the job is the record the API wrote, never the event. No record: a forged (or
        unknown) submission, refused (UnauthorisedEventError: dead-lettered) and counted, nothing written; a record
        that differs: the record wins, counted. A queued job wakes the pass, which takes it in through the door
        every job comes through (the change log, :mod:`trainyard_scheduler.intake`); this handler writes nothing."""
        job = await self.store.get_job(event.job_id)
        if (refusal := submission_refusal(event, job)) is not None:
            refuse("JobSubmitted", event, refusal, fatal=job is None)
        if job is None:  # refused above
            return
        if tr.is_pending(job):
            self._wake_at(None)
        log.info("job %s known (tenant %s, %d %s devices)", job.job_id, job.tenant,
                 job.spec.resources.gpu_count, job.spec.resources.gpu_type)

    async def on_control(self, event: JobControlRequested) -> None:
        """A wake-up: acted on only when the API recorded this very request (Keys.control_requests, by the event's
        id, matching job, tenant and action); the recorded request is what is applied. Anything else is refused
        (UnauthorisedEventError: dead-lettered, counted) and changes nothing."""
        raw = await self.redis.hget(Keys.control_requests(event.job_id), str(event.event_id))
        recorded = parse_control_request(raw)
        if (refusal := control_refusal(event, recorded, now=self.clock())) is not None:
            refuse("JobControlRequested", event, refusal, fatal=True)
        if recorded is None:  # refused above
            return

        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            if job.tenant != recorded.tenant:  # the API records only the job's own tenant: never in practice
                return tr.unchanged(job, f"{recorded.action} from tenant {recorded.tenant!r} ignored: not the owner")
            return tr.request_control(job, recorded.action, recorded.reason, self.clock(),
                                      latest_ready_step=facts.latest_ready_step, grace_s=self.pause_grace_s,
                                      final_ready=facts.final_ready)

        outcome = await self.writer.mutate(event.job_id, decide, need_checkpoints=True,
                                           label=f"control {recorded.action}")
        if outcome is None:
            log.warning("%s for unknown job %s ignored", recorded.action, event.job_id)

    # ------------------------------------------------------------------ workers
    async def on_worker_batch(self, events: list[Event]) -> None:
        """WORKERS a fetched batch at a time: the ids handled already are skipped (one round trip); each job's
        events are applied in the order they came, a run of one job's WorkerStarted as one write
        (:func:`~trainyard_scheduler.transitions.worker_runs`); a write's ids are marked handled after it. A
        failure part-way is safe: what was written is marked, the rest is handed back or handled alone."""
        if self.seen is None:
            raise RuntimeError("JobHandlers.seen is set by Scheduler.install")
        fresh = [e for e, new in zip(events, await self.seen.unseen([str(e.event_id) for e in events]),
                                     strict=True) if new]
        for run in tr.worker_runs(fresh):
            await self._worker_run(run)
            await self.seen.mark_all([str(e.event_id) for e in run])

    async def _worker_run(self, run: list[Event]) -> None:
        first = run[0]
        if isinstance(first, WorkerStarted):
            started = [e for e in run if isinstance(e, WorkerStarted)]
            await self.writer.mutate(first.job_id, lambda job, _: tr.workers_started(job, started, self.clock()),
                                     label=f"{len(started)} worker(s) started")
        elif isinstance(first, WorkerExited):
            await self.on_worker_exited(first)
        elif isinstance(first, EnvironmentPreparing):
            await self.on_environment_preparing(first)
        elif isinstance(first, SecurityViolation):
            await self.on_security_violation(first)

    async def on_worker_started(self, event: WorkerStarted) -> None:
        await self.writer.mutate(event.job_id, lambda job, _: tr.worker_started(job, event, self.clock()),
                                 label="worker started")

    async def on_environment_preparing(self, event: EnvironmentPreparing) -> None:
        await self.writer.mutate(event.job_id, lambda job, _: tr.environment_noted(job, event, self.clock()),
                                 label="environment progress")

    async def on_worker_exited(self, event: WorkerExited) -> None:
        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            return tr.worker_exited(job, event, final_ready=facts.final_ready, policy=self.writer.policy,
                                    now=self.clock(), latest_ready_step=facts.latest_ready_step)

        await self.writer.mutate(event.job_id, decide, need_checkpoints=True, label="worker exited")

    async def on_security_violation(self, event: SecurityViolation) -> None:
        outcome = await self.writer.mutate(event.job_id,
                                           lambda job, _: tr.security_violation(job, event, self.clock()),
                                           label="security violation")
        if outcome is None:
            log.warning("security violation for unknown job %s ignored: %s", event.job_id, event.detail)

    # ------------------------------------------------------------------ checkpoints
    async def on_checkpoint_ready(self, event: CheckpointReady) -> None:
        preemptor_waiting = await self._preemptor_waiting(event.job_id)

        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            outcome = tr.checkpoint_ready(job, global_step=event.global_step, now=self.clock())
            current = job.current
            if outcome.changed or current is None or not tr.is_stopping(job):
                return outcome
            latest = facts.latest_ready_step
            if event.attempt == current.attempt:
                latest = max(latest or 0, event.global_step)
            return tr.check_preemption(job, latest_ready_step=latest, preemptor_waiting=preemptor_waiting,
                                       grace_s=self.queue.config.preemption.checkpoint_grace_seconds,
                                       now=self.clock(), pause_grace_s=self.pause_grace_s)

        await self.writer.mutate(event.job_id, decide, need_checkpoints=True, label="checkpoint ready")

    async def on_checkpoint_failed(self, event: CheckpointFailed) -> None:
        def decide(job: JobRecord, facts: Facts) -> tr.Outcome:
            return tr.checkpoint_failed(job, global_step=event.global_step, reason=event.reason,
                                        attempt=event.attempt, policy=self.writer.policy, now=self.clock(),
                                        latest_ready_step=facts.latest_ready_step)

        await self.writer.mutate(event.job_id, decide, need_checkpoints=True, label="checkpoint failed")

    async def _preemptor_waiting(self, job_id: str) -> bool:
        job = await self.store.get_job(job_id)
        by = job.current.preempted_by if job and job.current else None
        if by is None:
            return False
        preemptor = await self.store.get_job(by)
        return preemptor is not None and tr.is_pending(preemptor)
