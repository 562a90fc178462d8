"""Records → response bodies. Pure functions: what a client sees of a job."""

from __future__ import annotations

from collections.abc import Sequence

from trainyard_common.records import AttemptRecord, CheckpointRecord, JobRecord, Progress

from trainyard_api.schemas import (
    AttemptView,
    CheckpointView,
    JobSummary,
    JobView,
    ProgressView,
)


def attempt_view(a: AttemptRecord) -> AttemptView:
    return AttemptView(
        attempt=a.attempt, allocation_id=a.allocation_id, epoch=a.epoch, state=a.state,
        nodes=list(a.nodes), world_size=a.world_size, start_checkpoint=a.start_checkpoint,
        started_at=a.started_at, ended_at=a.ended_at, failure_reason=a.failure_reason,
        placement_score=a.placement_score,
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
        consumed_tokens=c.consumed_tokens, reason=c.reason, created_at=c.created_at, ready_at=c.ready_at,
    )


def job_view(
    job: JobRecord, progress: Progress | None, checkpoints: Sequence[CheckpointRecord]
) -> JobView:
    """The full job document of ``GET /v1/training-jobs/{id}``."""
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
    )


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
    )
