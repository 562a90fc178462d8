"""Evaluation results attached to checkpoints: the decision (pure) and its shell.

An evaluation job (``spec.evaluation``, submitted by a ``checkpointReady`` trigger or by hand) loads the
checkpoint its ``initFrom`` names and its rank 0 reports ``EvaluationReported`` (relayed by the node agent,
its identity stamped). The event is a wake-up, not a fact: :func:`decide` reads the evaluation job's record
(the API wrote its spec) and attaches the numbers to *that* checkpoint — the trained job's checkpoint
artifact at ``initFrom.globalStep`` — never to one the event could name. A job that is no evaluation, a
job of another tenant than the event's, a trained job of another tenant, or a rank other than 0 attaches
nothing (counted, logged). The result is written once per evaluation job (HSETNX on ``ty:evals:<job>``):
a redelivered event or a retried attempt changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import Counter
from redis.asyncio import Redis

from trainyard_contract.events import EvaluationReported, utcnow
from trainyard_contract.records import ArtifactRecord, EvaluationResult, JobRecord
from trainyard_runtime.store import Keys, StateStore

__all__ = ["Attach", "EvaluationRecorder", "Ignore", "Missing", "decide"]

log = logging.getLogger(__name__)

EVALUATIONS_ATTACHED = Counter("trainyard_registry_evaluations_attached_total",
                               "evaluation results attached to a checkpoint")
EVALUATIONS_REFUSED = Counter("trainyard_registry_evaluations_refused_total",
                              "EvaluationReported events that attached nothing, by why", ["reason"])


@dataclass(frozen=True)
class Attach:
    """Record ``result`` among the evaluations of ``job_id`` (the trained job)."""

    job_id: str
    result: EvaluationResult


@dataclass(frozen=True)
class Ignore:
    """Attach nothing; ``reason`` is a metric label, ``message`` the log line. ``violation``: a claim the rank
    may not make (another tenant's checkpoint, a job that is no evaluation), worth an alert."""

    reason: str
    message: str
    violation: bool = False


@dataclass(frozen=True)
class Missing:
    """A record the decision needs is not there (yet): retry."""

    what: str


Decision = Attach | Ignore | Missing


def decide(event: EvaluationReported, evaluation: JobRecord | None, trained: JobRecord | None,
           artifacts: Sequence[ArtifactRecord], *, now: datetime) -> Decision:
    """What to do with one EvaluationReported: ``evaluation`` is the record of the event's job, ``trained`` the
    record of the job its ``initFrom.jobId`` names, ``artifacts`` the trained job's artifacts."""
    if evaluation is None:
        return Missing(f"evaluation job {event.job_id} has no record")
    spec, init = evaluation.spec, evaluation.spec.init_from
    if spec.evaluation is None or init is None or init.job_id is None or init.global_step is None:
        return Ignore("not-evaluation", f"job {event.job_id} is no evaluation job (its spec has no evaluation "
                                        "with initFrom.jobId and globalStep)", violation=True)
    if event.tenant != evaluation.tenant:
        return Ignore("tenant", f"EvaluationReported for {event.job_id} names tenant {event.tenant!r}; the job's "
                                f"is {evaluation.tenant!r}", violation=True)
    if event.rank != 0:
        return Ignore("rank", f"EvaluationReported for {event.job_id} from rank {event.rank}: rank 0 reports")
    if trained is None or trained.tenant != evaluation.tenant:
        return Ignore("other-tenant", f"evaluation job {event.job_id} names job {init.job_id!r}, which is no job "
                                      f"of tenant {evaluation.tenant!r}", violation=True)
    checkpoint = evaluated_checkpoint(artifacts, tenant=trained.tenant, global_step=init.global_step)
    if checkpoint is None:
        return Missing(f"job {trained.job_id} has no checkpoint artifact at step {init.global_step}")
    return Attach(trained.job_id, EvaluationResult(
        evaluation_job_id=evaluation.job_id, checkpoint_id=checkpoint.artifact_id, global_step=init.global_step,
        metrics=dict(event.metrics), finished_at=now))


def evaluated_checkpoint(artifacts: Sequence[ArtifactRecord], *, tenant: str,
                         global_step: int) -> ArtifactRecord | None:
    """The checkpoint artifact at ``global_step``: a live one before a retired one, the latest attempt's first."""
    found = [a for a in artifacts if a.type == "checkpoint" and a.global_step == global_step and a.tenant == tenant]
    found.sort(key=lambda a: (a.retired_at is None, a.producer_attempt))
    return found[-1] if found else None


class EvaluationRecorder:
    """The shell: load the records :func:`decide` needs, write what it says (HSETNX: once per evaluation job)."""

    def __init__(self, redis: Redis, missing: Callable[[str, str], Exception], *,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.redis = redis
        self.store = StateStore(redis)
        self.missing = missing  # (event id, what) → the error to raise: retryable until its limit
        self.clock = clock

    async def on_evaluation_reported(self, event: EvaluationReported) -> None:
        """Attach the event's numbers to the checkpoint its job evaluated (once per evaluation job)."""
        evaluation = await self.store.get_job(event.job_id)
        init = evaluation.spec.init_from if evaluation is not None else None
        trained = await self.store.get_job(init.job_id) if init is not None and init.job_id else None
        artifacts = await self.store.list_artifacts(trained.job_id) if trained is not None else []
        decision = decide(event, evaluation, trained, artifacts, now=self.clock())
        if isinstance(decision, Missing):
            raise self.missing(str(event.event_id), decision.what)
        if isinstance(decision, Ignore):
            EVALUATIONS_REFUSED.labels(decision.reason).inc()
            (log.warning if decision.violation else log.info)("evaluation not attached: %s", decision.message)
            return
        written = bool(await self.redis.hsetnx(Keys.evaluations(decision.job_id), decision.result.evaluation_job_id,
                                               decision.result.dumps()))
        if written:
            EVALUATIONS_ATTACHED.inc()
            log.info("evaluation %s of %s attached: %s", decision.result.evaluation_job_id,
                     decision.result.checkpoint_id, decision.result.metrics)
