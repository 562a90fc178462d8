"""The planner's view of the snapshot: job records as :class:`PendingJob` / :class:`RunningJob`, nodes as a
:class:`ClusterSnapshot`, then :func:`planner.plan` over them.

Pure but for two caches the leader keeps between passes: each spec's memory floor (by spec hash) and each queued
job's gang request (while the snapshot hands out the same record object, i.e. until the record changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from trainyard_contract.devices import Device
from trainyard_contract.records import JobRecord, NodeRecord

from trainyard_scheduler import health
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.gang import GangRequest
from trainyard_scheduler.planner import Decision, PendingJob, RunningJob, expected_duration_s, plan
from trainyard_scheduler.policy import QueueConfig
from trainyard_scheduler.sizing import min_device_memory
from trainyard_scheduler.snapshot import HeldAllocation, Snapshot
from trainyard_scheduler.topology import ClusterSnapshot

_MEMORY_CACHE = 10_000


def attempt_devices(job: JobRecord) -> list[Device]:
    """The devices of the job's current attempt."""
    current = job.current
    if current is None:
        return []
    return [Device(n, int(i)) for n, i in (d.rsplit(":", 1) for d in current.devices)]


def remaining_seconds(job: JobRecord) -> float | None:
    """The spec's ``expectedDurationMinutes`` scaled to what is left after the last attempt's start
    checkpoint (backfill only; None: unknown, so never backfilled past a reservation)."""
    total = expected_duration_s(job.spec.resources.expected_duration_minutes)
    if total is None:
        return None
    current, max_steps = job.current, job.spec.training.max_steps
    done = current.start_checkpoint.global_step if current and current.start_checkpoint else 0
    return total * max(0.0, 1.0 - done / max_steps) if max_steps else total


def running_job(job: JobRecord, queue: QueueConfig) -> RunningJob | None:
    """A live attempt as quotas, preemption and reservations see it (None: no live attempt)."""
    current = job.current
    if not tr.is_live(current):
        return None
    assert current is not None
    priority = queue.priority(job.tenant, job.priority)
    aged = priority + queue.boost((current.started_at - job.created_at).total_seconds())
    remaining = remaining_seconds(job)
    return RunningJob(job_id=job.job_id, tenant=job.tenant, priority=priority,
                      gpu_type=job.spec.resources.gpu_type, devices=tuple(attempt_devices(job)),
                      started_at=current.started_at, preempted_by=current.preempted_by, admitted_priority=aged,
                      expected_end=current.started_at + timedelta(seconds=remaining) if remaining else None)


def leased_devices(held: Mapping[str, HeldAllocation], running: list[RunningJob]) -> dict[str, set[int]]:
    """Device indices per node that are taken: held by a lease, or a live attempt's (even if its lease expired)."""
    leased: dict[str, set[int]] = {}
    for allocation in held.values():
        for device in allocation.devices:
            leased.setdefault(device.node_id, set()).add(device.index)
    for r in running:
        for device in r.devices:
            leased.setdefault(device.node_id, set()).add(device.index)
    return leased


class QueueView:
    """Builds the planner's inputs from one snapshot and plans them (see the module docstring)."""

    def __init__(self, policy: tr.RetryPolicy, reputation: health.ReputationPolicy) -> None:
        self.policy, self.reputation = policy, reputation
        self._memory: dict[str, int] = {}
        self._requests: dict[str, tuple[JobRecord, GangRequest]] = {}  # job id → (record, its gang request)

    def plan(self, jobs: Mapping[str, JobRecord], nodes: list[NodeRecord], view: Snapshot, now: datetime,
             queue: QueueConfig) -> list[Decision]:
        """The decisions of this pass over the snapshot."""
        running = [r for j in jobs.values() if (r := running_job(j, queue)) is not None]
        cluster = ClusterSnapshot.build(nodes, leased_devices(view.held, running),
                                        penalties=health.penalties(view.reputation, now, self.reputation))
        preempting: dict[str, list[str]] = {}
        for r in running:
            if r.preempted_by is not None:
                preempting.setdefault(r.preempted_by, []).append(r.job_id)
        pending = [self.pending(j, tuple(preempting.get(j.job_id, ())), queue)
                   for j in jobs.values() if tr.is_pending(j)]
        if len(self._requests) > 2 * len(pending) + 100:
            self._requests = {k: v for k, v in self._requests.items() if k in jobs}
        return plan(cluster, pending, now, running=running, policy=queue)

    def pending(self, job: JobRecord, preempting: tuple[str, ...], queue: QueueConfig) -> PendingJob:
        """The planner's view of a queued job; its gang request is kept while the record is the same object."""
        cached = self._requests.get(job.job_id)
        if cached is None or cached[0] is not job:
            cached = self._requests[job.job_id] = (job, GangRequest.from_spec(job.spec,
                                                                              min_memory_bytes=self._floor(job)))
        return PendingJob(
            job_id=job.job_id, request=cached[1], submitted_at=job.created_at,
            priority=queue.priority(job.tenant, job.priority), not_before=tr.retry_not_before(job, self.policy),
            tenant=job.tenant, preempting=preempting, expected_duration_s=remaining_seconds(job),
        )

    def _floor(self, job: JobRecord) -> int:
        """The spec's per-device memory floor, estimated once per spec hash."""
        if job.spec_hash not in self._memory:
            if len(self._memory) > _MEMORY_CACHE:
                self._memory.clear()
            self._memory[job.spec_hash] = min_device_memory(job.spec)
        return self._memory[job.spec_hash]
