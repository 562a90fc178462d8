"""A job's way in: a new attempt placed (GangAllocated), a job that can never start, a forged event that
ends it, why a queued one waits. Pure."""

from __future__ import annotations

from datetime import datetime

from trainyard_contract.events import TERMINAL_STATES, CheckpointRef, Event, GangAllocated, SecurityViolation
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import AttemptRecord, DatasetRecord, JobRecord, dataset_visible

from trainyard_scheduler.placement import Placement
from trainyard_scheduler.transitions.state import (
    Outcome,
    is_live,
    is_pending,
    rank0_host,
    revoke_live,
    set_state,
    unchanged,
)
from trainyard_scheduler.transitions.table import Happening, enter


def admit(
    job: JobRecord,
    *,
    placement: Placement,
    allocation_id: str,
    epoch: int,
    master_port: int,
    start_checkpoint: CheckpointRef | None,
    now: datetime,
    checkpoint_every_steps: int | None = None,
    lighthouse_port: int | None = None,
) -> Outcome:
    """A new attempt on ``placement``: the record gains an AttemptRecord; GangAllocated goes out.

    ``checkpoint_every_steps``: the coordinator's advised interval, for a spec with ``checkpointPolicy.auto``.
    ``lighthouse_port``: a fault-tolerant job's Lighthouse, run by the node of rank 0 at ``master_addr``.
    """
    if not is_pending(job):
        return unchanged(job, "no longer pending")
    return enter(job, Happening.PLACED, lambda: _place(job, placement, allocation_id, epoch, master_port,
                                                       start_checkpoint, now, checkpoint_every_steps,
                                                       lighthouse_port))


def _place(job: JobRecord, placement: Placement, allocation_id: str, epoch: int, master_port: int,
           start_checkpoint: CheckpointRef | None, now: datetime, checkpoint_every_steps: int | None,
           lighthouse_port: int | None) -> Outcome:
    number = len(job.attempts) + 1
    attempt = AttemptRecord(
        attempt=number,
        allocation_id=allocation_id,
        epoch=epoch,
        nodes=[n.node_id for n in placement.nodes],
        devices=[str(d) for d in placement.devices()],
        world_size=placement.world_size,
        start_checkpoint=start_checkpoint,
        started_at=now,
        placement_score=placement.score,
        master_addr=placement.master_addr,
        master_port=master_port,
        lighthouse_port=lighthouse_port if job.spec.fault_tolerance is not None else None,
    )
    attempt.placement_detail = placement.detail
    attempt.assignments = placement.assignments()
    attempt.checkpoint_every_steps = checkpoint_every_steps
    new = job.model_copy(deep=True)
    new.attempts.append(attempt)
    new.queued_reason = None
    new.queued_reason_kind = None
    new.updated_at = now
    return Outcome(new, [gang_allocated(new, attempt, now)],
                   note=f"attempt {number} placed on {', '.join(attempt.nodes)}")


def gang_allocated(job: JobRecord, attempt: AttemptRecord, now: datetime) -> GangAllocated:
    """The GangAllocated of ``attempt`` (again: same allocation id and epoch; agents dedupe by allocation)."""
    return GangAllocated(
        occurred_at=now,
        job_id=job.job_id,
        tenant=job.tenant,
        attempt=attempt.attempt,
        allocation_id=attempt.allocation_id,
        epoch=attempt.epoch,
        world_size=attempt.world_size,
        nodes=attempt.assignments,
        master_addr=attempt.master_addr or rank0_host(attempt),
        master_port=attempt.master_port or 29400,
        start_checkpoint=attempt.start_checkpoint,
        spec=job.spec,
        spec_hash=job.spec_hash,
        placement_score=attempt.placement_score,
        placement_detail=attempt.placement_detail,
        checkpoint_every_steps=attempt.checkpoint_every_steps,
        lighthouse_port=attempt.lighthouse_port,
    )


def fail_unstartable(job: JobRecord, reason: str, now: datetime) -> Outcome:
    """A queued job that can never start as specified (e.g. ``initFrom`` names no READY checkpoint)."""
    if job.state in TERMINAL_STATES or is_live(job.current):
        return unchanged(job)

    def fail() -> Outcome:
        new = job.model_copy(deep=True)
        new.updated_at = now
        new.queued_reason = new.queued_reason_kind = None
        events: list[Event] = []
        set_state(new, "failed", events, now, reason=f"{ExitReason.CONFIG}: {reason} (not retryable)")
        return Outcome(new, events, note=f"job failed: {reason}")

    return enter(job, Happening.UNSTARTABLE, fail)


def dataset_refusal(dataset: str, tenant: str, record: DatasetRecord | None) -> str | None:
    """Why a job of ``tenant`` may not read ``dataset`` (its spec's ref, as the readers take it: qualified,
    or the platform's); None when it may. ``record`` is the verified version under that ref, if any.

    The API accepts only visible versions and stores the ref qualified, so this refuses what reached the
    bus some other way (a forged JobSubmitted): a version that was never verified (the platform's too:
    files under ``datasets/`` that the registry refused, or never saw, are read by no job), or one that is
    not the job's tenant's to read.
    """
    if record is not None and dataset_visible(record, tenant):
        return None
    return (f"dataset {dataset!r} is not a verified version tenant {tenant!r} may use "
            "(not published, not verified, or not shared with it)")


def security_violation(job: JobRecord, event: SecurityViolation, now: datetime) -> Outcome:
    """A node agent caught a rank of ``job`` claiming what a rank may not (a forged event): the job
    fails at once, whichever attempt it was, with no retry (its code is at fault, not the nodes:
    nobody is blamed); the live attempt is revoked."""
    if job.state in TERMINAL_STATES:
        return unchanged(job, f"security violation reported for a {job.state} job")
    if event.tenant != job.tenant:
        return unchanged(job, f"security violation names tenant {event.tenant!r}, the job is {job.tenant!r}'s")

    def fail() -> Outcome:
        new = job.model_copy(deep=True)
        new.updated_at = now
        reason = (f"{ExitReason.SECURITY}: rank {event.rank} of attempt {event.attempt} on {event.node_id}: "
                  f"{event.detail} (not retryable)")
        events: list[Event] = []
        released = revoke_live(new, reason, events, now)
        new.control = None
        new.queued_reason = new.queued_reason_kind = None
        set_state(new, "failed", events, now, reason=reason)
        return Outcome(new, events, release=released, note=f"job failed: {reason}")

    return enter(job, Happening.SECURITY_VIOLATION, fail)


def note_waiting(job: JobRecord, reason: str, kind: str | None = None) -> Outcome:
    """Record why a queued job waits (shown by GET while queued)."""
    if job.state != "queued" or (job.queued_reason == reason and job.queued_reason_kind == kind):
        return unchanged(job)
    return enter(job, Happening.WAIT_NOTED, lambda: Outcome(
        job.model_copy(update={"queued_reason": reason, "queued_reason_kind": kind})))
