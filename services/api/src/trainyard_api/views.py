"""Records → response bodies. Pure functions: what a client sees of a job."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord, Progress
from trainyard_telemetry.goodput import WASTE_KINDS, Ledger
from trainyard_telemetry.goodput_history import GoodputInterval

from trainyard_api.schemas import (
    AttemptView,
    NodeEnvironmentView,
    ReplicaReplacementView,
    CheckpointAdviceView,
    CheckpointView,
    GoodputIntervalView,
    GoodputView,
    JobCondition,
    JobSummary,
    JobView,
    ProgressView,
    RankTimingView,
    StragglerView,
)

_ADVICE_INPUTS = ("checkpointCostSeconds", "costSource", "writeSeconds", "stallSeconds", "stepSeconds", "devices",
                  "deviceType", "failures", "exposureDeviceSeconds", "deviceMtbfSeconds", "jobMtbfSeconds",
                  "mtbfSource", "youngIntervalSeconds", "dalyIntervalSeconds", "measuredCheckpoints")


@dataclass
class JobExtras:
    """What a job view shows besides the records: read models of other services and the ledger."""

    advice: Mapping[str, Any] | None = None
    goodput: Ledger | None = None
    ranks: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    stragglers: Sequence[Mapping[str, Any]] = ()
    protection: Mapping[str, Any] | None = None  # the coordinator's checkpoint-protection verdict
    children: Sequence[str] = ()  # jobs started from this one (initFrom.jobId), newest first


def goodput_view(ledger: Ledger) -> GoodputView:
    s = ledger.seconds()
    return GoodputView(
        allocated_device_seconds=s["allocated"], productive_device_seconds=s["productive"],
        wasted_device_seconds=s["wasted"], in_flight_device_seconds=s["inFlight"], goodput=ledger.goodput,
        wasted={k: s[k] for k in WASTE_KINDS},
    )


def goodput_interval_view(i: GoodputInterval) -> GoodputIntervalView:
    return GoodputIntervalView(
        start=datetime.fromtimestamp(i.start, UTC), end=datetime.fromtimestamp(i.end, UTC),
        allocated_device_seconds=i.allocated, productive_device_seconds=i.productive,
        in_flight_device_seconds=i.in_flight, wasted_device_seconds=i.wasted, goodput=i.goodput,
        goodput_to_date=i.goodput_to_date, wasted=dict(i.wasted_by_kind),
    )


def advice_view(advice: Mapping[str, Any]) -> CheckpointAdviceView:
    """The coordinator's stored advice (camelCase JSON) as the job view shows it."""
    interval = advice.get("intervalSeconds")
    method = None
    if interval is not None:
        for name in ("daly", "young"):
            value = advice.get(f"{name}IntervalSeconds")
            if value is not None and math.isclose(value, interval, rel_tol=1e-9):
                method = name
                break
    return CheckpointAdviceView(
        interval_steps=advice.get("intervalSteps"), interval_seconds=interval, method=method,
        current_interval_steps=advice.get("currentIntervalSteps"),
        current_wasted_fraction=advice.get("currentWastedFraction"),
        advised_wasted_fraction=advice.get("advisedWastedFraction"), auto=bool(advice.get("auto", False)),
        inputs={k: advice[k] for k in _ADVICE_INPUTS if k in advice}, note=advice.get("note"),
        updated_at=advice.get("updatedAt"),
    )


def rank_timing_views(ranks: Mapping[int, Mapping[str, Any]]) -> list[RankTimingView]:
    return [RankTimingView.model_validate({**breakdown, "rank": rank}) for rank, breakdown in sorted(ranks.items())]


def straggler_views(reports: Sequence[Mapping[str, Any]]) -> list[StragglerView]:
    return [StragglerView.model_validate(r) for r in reports]


def attempt_view(a: AttemptRecord) -> AttemptView:
    return AttemptView(
        attempt=a.attempt, allocation_id=a.allocation_id, epoch=a.epoch, state=a.state,
        nodes=list(a.nodes), world_size=a.world_size, start_checkpoint=a.start_checkpoint,
        started_at=a.started_at, ended_at=a.ended_at, failure_reason=a.failure_reason,
        interruption=a.interruption, placement_score=a.placement_score, placement_detail=a.placement_detail,
        starts=dict(a.starts), start_detail=a.start_detail,
        environment={node: NodeEnvironmentView.model_validate(e.model_dump()) for node, e in a.environment.items()},
        generations=dict(a.generations),
        replacements=[ReplicaReplacementView.model_validate(r.model_dump()) for r in a.replacements],
    )


def progress_view(job: JobRecord, progress: Progress | None) -> ProgressView:
    """Progress so far; ``maxSteps`` comes from the spec until a rank reports it."""
    p = progress or Progress()
    return ProgressView(
        global_step=p.global_step,
        max_steps=p.max_steps or job.spec.training.max_steps,
        consumed_tokens=p.consumed_tokens,
        last_loss=p.last_loss,
        lr=p.lr,
        tokens_per_second=p.tokens_per_second,
        mfu=p.mfu,
        attempt=p.attempt,
        updated_at=p.updated_at,
    )


def checkpoint_view(c: CheckpointRecord) -> CheckpointView:
    return CheckpointView(
        checkpoint_id=c.checkpoint_id, state=c.state, global_step=c.global_step, attempt=c.attempt,
        world_size=c.world_size, manifest_uri=c.manifest_uri, content_hash=c.content_hash,
        tensors_hash=c.tensors_hash, consumed_tokens=c.consumed_tokens, reason=c.reason, created_at=c.created_at,
        ready_at=c.ready_at,
        write_seconds=c.write_seconds, deleted_at=c.deleted_at, size_bytes=c.size_bytes,
    )


def job_view(
    job: JobRecord, progress: Progress | None, checkpoints: Sequence[CheckpointRecord],
    extras: JobExtras | None = None,
) -> JobView:
    """The full job document of ``GET /v1/training-jobs/{id}``."""
    x = extras or JobExtras()
    return JobView(
        job_id=job.job_id,
        tenant=job.tenant,
        name=job.spec.name,
        state=job.state,
        spec_hash=job.spec_hash,
        spec=job.spec,
        submitted_by=job.submitted_by,
        created_at=job.created_at,
        updated_at=job.updated_at,
        reason=job.reason,
        queued_reason=job.queued_reason if job.state == "queued" else None,
        attempts=[attempt_view(a) for a in job.attempts],
        max_attempts=job.max_attempts,
        progress=progress_view(job, progress),
        checkpoints=[checkpoint_view(c) for c in checkpoints],
        queued_reason_kind=job.queued_reason_kind if job.state == "queued" else None,
        checkpoint_advice=advice_view(x.advice) if x.advice else None,
        goodput=goodput_view(x.goodput) if x.goodput is not None else None,
        rank_timing=rank_timing_views(x.ranks),
        stragglers=straggler_views(x.stragglers),
        conditions=job_conditions(job, x.protection),
        triggered_by=job.triggered_by,
        experiment=job.experiment,
        hugging_face_start=job.hugging_face_start,
        children=list(x.children),
    )


def job_conditions(job: JobRecord, protection: Mapping[str, Any] | None) -> list[JobCondition]:
    """What is wrong with a running job right now: its live attempt trains on unprotected by READY checkpoints."""
    current = job.current
    if (not protection or not protection.get("stalled") or job.state != "running" or current is None
            or protection.get("attempt") != current.attempt):
        return []
    return [JobCondition(type="CheckpointsStalled", reason=str(protection.get("reason") or ""),
                         since=protection.get("since"), attempt=current.attempt,
                         unprotected_intervals=protection.get("unprotectedIntervals"))]


def job_summary(job: JobRecord, progress: Progress | None) -> JobSummary:
    """One row of ``GET /v1/training-jobs``."""
    ref = job.spec.model_config_ref
    return JobSummary(
        job_id=job.job_id,
        name=job.spec.name,
        state=job.state,
        spec_hash=job.spec_hash,
        model=ref if isinstance(ref, str) else "inline",
        dataset=job.spec.dataset,
        gpu_count=job.spec.resources.gpu_count,
        attempts=len(job.attempts),
        global_step=progress.global_step if progress else 0,
        max_steps=job.spec.training.max_steps,
        last_loss=progress.last_loss if progress else None,
        created_at=job.created_at,
        updated_at=job.updated_at,
        queued_reason=job.queued_reason if job.state == "queued" else None,
        reason=job.reason,
        tokens_per_second=progress.tokens_per_second if progress else None,
        mfu=progress.mfu if progress else None,
        eta_seconds=eta_seconds(job, progress),
    )


def eta_seconds(job: JobRecord, progress: Progress | None) -> float | None:
    """Steps left times the latest step time, while the job runs (None before a step time is known)."""
    if job.state != "running" or progress is None or not progress.step_seconds:
        return None
    return max(0, job.spec.training.max_steps - progress.global_step) * progress.step_seconds
