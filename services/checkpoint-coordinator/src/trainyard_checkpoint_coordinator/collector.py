"""Garbage collection of checkpoint files: the I/O shell around :func:`retention.plan_gc`.

For each job in :data:`JOBS_INDEX` (jobs that reported a shard): load its records, attempts and
checkpoint directories, plan, apply. Every step is idempotent, so the loop finishes whatever a
crash interrupted. A READY checkpoint is retired in the order that keeps readers safe: the
manifest goes first (the checkpoint is no longer loadable), then the record becomes DELETED,
then the shards go, then ``deletedAt`` is stamped. Under an object-store root the same steps
delete objects (a "directory" is a prefix; its age is that of its newest object).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from datetime import datetime

from redis.asyncio import Redis
from redis.exceptions import WatchError

from trainyard_contract.events import TERMINAL_STATES, utcnow
from trainyard_contract.records import CheckpointRecord, JobRecord
from trainyard_contract.storage import (
    ArtifactLayout,
    Location,
    ObjectPath,
    as_location,
    list_children,
    UnsafePathError,
    remove_file,
    remove_file_under,
    remove_tree,
    remove_tree_under,
)
from trainyard_runtime.store import Keys, StateStore

from trainyard_checkpoint_coordinator import metrics
from trainyard_checkpoint_coordinator.assembly import MANIFEST_NAME
from trainyard_checkpoint_coordinator.retention import Collect, DirectoryInfo, GcAction, Retire, Sweep, plan_gc
from trainyard_checkpoint_coordinator.settings import CoordinatorSettings

log = logging.getLogger(__name__)

#: Sorted set of job ids that have checkpoints (score: last shard report), for GC and advice.
JOBS_INDEX = Keys.checkpoint_jobs

Clock = Callable[[], datetime]
RecordChange = Callable[[CheckpointRecord], CheckpointRecord | None]


def list_directories(checkpoints_dir: Location, now: float) -> list[DirectoryInfo]:
    """The job's checkpoint directories with their age (seconds since their last change)."""
    return [DirectoryInfo(child.name, max(now - (child.mtime if child.mtime is not None else now), 0.0))
            for child in list_children(checkpoints_dir) if child.is_dir]


class GarbageCollector:
    """Applies retention (``keepLast``) and removes the files of FAILED and abandoned checkpoints."""

    def __init__(self, redis: Redis, settings: CoordinatorSettings, *, clock: Clock = utcnow) -> None:
        self.redis = redis
        self.store = StateStore(redis)
        self.settings = settings
        self.layout = ArtifactLayout(settings.artifact_root)
        self.clock = clock

    async def collect(self) -> None:
        """One pass over every job with checkpoints."""
        job_ids: list[str] = await self.redis.zrange(JOBS_INDEX, 0, -1)  # type: ignore[assignment]  # decoded: str
        for job_id in job_ids:
            try:
                await self.collect_job(job_id)
            except OSError as exc:  # one job's unreadable directory does not stop the others
                log.warning("%s: garbage collection failed: %r", job_id, exc)

    async def collect_job(self, job_id: str) -> list[GcAction]:
        """Plan and apply garbage collection for one job; returns what was done."""
        job = await self.store.get_job(job_id)
        records = await self.store.list_checkpoints(job_id)
        tenant = job.tenant if job else (records[0].tenant if records else None)
        if tenant is None:
            await self.redis.zrem(JOBS_INDEX, job_id)
            return []
        root = self.layout.checkpoints_dir(tenant, job_id)
        directories = await asyncio.to_thread(list_directories, root, self.clock().timestamp())
        actions = plan_gc(
            records, directories,
            # Without its job record the spec is unknown: remove no READY checkpoint.
            keep_last=job.spec.checkpoint_policy.keep_last if job else 10**9,
            attempts=job.attempts if job else [],
            stale_after_s=self.settings.shard_timeout_s,
        )
        for action in actions:
            await self._apply(action, root)
        if not actions and self._finished(job):
            await self.redis.zrem(JOBS_INDEX, job_id)
        return actions

    def _finished(self, job: JobRecord | None) -> bool:
        """Terminal long enough that no leftover of it can still be in the making."""
        if job is None or job.state not in TERMINAL_STATES:
            return False
        return (self.clock() - job.updated_at).total_seconds() > self.settings.shard_timeout_s

    # ------------------------------------------------------------------ actions
    async def _apply(self, action: GcAction, root: Location) -> None:
        match action:
            case Retire(record=record, reason=reason):
                await self._retire(record, reason, root)
            case Collect(record=record, reason=reason):
                directory = self._directory(record, root)
                for path in (directory, directory.with_name(directory.name + ".tmp")):
                    await asyncio.to_thread(_remove_tree, path, root, self.layout.root)
                await self._change(record, lambda r: r.model_copy(update={"deleted_at": self.clock()})
                                   if r.deleted_at is None else None)
                metrics.GC.labels("collected").inc()
                log.info("%s/%s: removed its files (%s)", record.job_id, record.checkpoint_id, reason)
            case Sweep(name=name, reason=reason):
                await asyncio.to_thread(_remove_tree, root / name, root, self.layout.root)
                metrics.GC.labels("swept").inc()
                log.info("removed %s: %s", root / name, reason)

    async def _retire(self, record: CheckpointRecord, reason: str, root: Location) -> None:
        directory = self._directory(record, root)
        # 1. the manifest: from now on no restore can choose it
        await asyncio.to_thread(_remove_file, directory / MANIFEST_NAME, self.layout.root)
        # 2. the record stops being READY
        retired = await self._change(
            record, lambda r: r.model_copy(update={"state": "DELETED", "reason": reason})
            if r.state == "READY" else None,
        )
        if retired is None:
            return
        # 3. the shards  4. the stamp
        await asyncio.to_thread(_remove_tree, directory, root, self.layout.root)
        await self._change(retired, lambda r: r.model_copy(update={"deleted_at": self.clock()})
                           if r.deleted_at is None else None)
        metrics.GC.labels("retired").inc()
        log.info("%s/%s: deleted (%s)", record.job_id, record.checkpoint_id, reason)

    def _directory(self, record: CheckpointRecord, root: Location) -> Location:
        if record.manifest_uri:
            return as_location(record.manifest_uri).parent
        return self.layout.checkpoint_dir(record.tenant, record.job_id, record.attempt, record.global_step)

    async def _change(self, record: CheckpointRecord, change: RecordChange) -> CheckpointRecord | None:
        """Rewrite one record (WATCHed); ``change`` returns None to leave it as it is."""
        key = Keys.checkpoints(record.job_id)
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await pipe.hget(key, record.checkpoint_id)
                    if raw is None:
                        return None
                    changed = change(CheckpointRecord.model_validate_json(raw))
                    if changed is None:
                        return None
                    pipe.multi()
                    pipe.hset(key, record.checkpoint_id, changed.dumps())
                    await pipe.execute()
                    return changed
                except WatchError:
                    continue


def _remove_file(path: Location, artifact_root: Location) -> None:
    """Delete one file; locally relative to its directory's handle, walked from the artifact root without
    following a link (a rank owns the step directory), a link on the way refused and logged."""
    if isinstance(path, ObjectPath) or isinstance(artifact_root, ObjectPath):
        remove_file(path)
        return
    try:
        remove_file_under(artifact_root, path)
    except UnsafePathError as exc:
        log.error("security: not removing %s: %s", path, exc)


def _remove_tree(path: Location, root: Location, artifact_root: Location | None = None) -> None:
    """rm -r ``path`` (every object under the prefix), which must lie inside ``root`` (the job's
    checkpoints directory). Locally (with ``artifact_root``) by directory handles walked from the artifact
    root (``storage.remove_tree_under``): a step directory a rank swapped for a link loses the link, never
    the link's target."""
    handles = not (isinstance(path, ObjectPath) or artifact_root is None or isinstance(artifact_root, ObjectPath))
    if isinstance(path, ObjectPath) or isinstance(root, ObjectPath):
        inside = root in path.parents
    elif handles:  # by name: the walk below refuses links
        inside = os.path.normpath(root) in [os.path.normpath(p) for p in path.parents]
    else:
        inside = root.resolve() in path.resolve().parents
    if not inside:
        log.error("refusing to remove %s: not inside %s", path, root)
        return
    if not handles:
        remove_tree(path)
        return
    try:
        remove_tree_under(artifact_root, path)  # type: ignore[arg-type]  # handles: both are local Paths here
    except UnsafePathError as exc:
        log.error("security: not removing %s: %s", path, exc)
