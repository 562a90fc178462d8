"""The registry's I/O shell: datasets, checkpoint artifacts and model artifacts with lineage.

* DATASETS / DatasetVersionPublished → ``DatasetRecord`` (first publish wins; a different
  sha256 for the same name@version is refused and dead-lettered);
* CHECKPOINTS / CheckpointReady → ``ArtifactRecord`` type "checkpoint";
* JOBS / JobStateChanged(succeeded) → ``ArtifactRecord`` type "model" (latest READY checkpoint).

Artifact ids are deterministic and written with HSETNX, so re-deliveries are no-ops.
Events on different topics arrive in any order: when a record an event needs is not there
yet, the handler raises a retryable error (the bus re-delivers after back-off), and after
``missing_retry_limit`` tries a non-retryable one (the bus dead-letters it), so a partition
is never blocked forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from opentelemetry import trace
from redis.asyncio import Redis

from trainyard_common.errors import ConflictError, NotFoundError
from trainyard_common.events import (
    CHECKPOINTS,
    DATASETS,
    JOBS,
    CheckpointReady,
    DatasetVersionPublished,
    JobStateChanged,
    utcnow,
)
from trainyard_common.records import ArtifactRecord, CheckpointRecord, DatasetRecord, JobRecord, checkpoint_id
from trainyard_common.service import ServiceRuntime
from trainyard_common.storage import ArtifactLayout, path_to_uri, sha256_file
from trainyard_common.store import Keys, StateStore

from trainyard_registry.lineage import (
    checkpoint_artifact,
    dataset_conflict,
    dataset_from_manifest,
    dataset_record,
    model_artifact,
    ready_mismatch,
    split_ref,
)
from trainyard_registry.settings import RegistrySettings

log = logging.getLogger(__name__)

SERVICE_NAME = "registry"
Clock = Callable[[], datetime]


class _MissingTries:
    """Counts, per event, how often a prerequisite record was missing (in memory: a restart
    only grants a fresh allowance)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tries: dict[str, int] = {}

    def missing(self, event_id: str, what: str) -> NotFoundError:
        """The error to raise: retryable until the limit, then final (dead-letter)."""
        n = self._tries.get(event_id, 0) + 1
        if n >= self.limit:
            self._tries.pop(event_id, None)
            return NotFoundError(f"{what} (gave up after {n} tries)", retryable=False)
        self._tries[event_id] = n
        return NotFoundError(f"{what} (try {n} of {self.limit}; will retry)", retryable=True)

    def done(self, event_id: str) -> None:
        self._tries.pop(event_id, None)


class Registry:
    """Records artifacts with lineage. Handlers are idempotent."""

    def __init__(self, redis: Redis, settings: RegistrySettings, *, clock: Clock = utcnow) -> None:
        self.redis = redis
        self.store = StateStore(redis)
        self.layout = ArtifactLayout(settings.artifact_root_abs)
        self.clock = clock
        self._tries = _MissingTries(settings.missing_retry_limit)

    def install(self, runtime: ServiceRuntime) -> None:
        """Subscribe to datasets, checkpoints and jobs (one consumer group, one consumer)."""
        routes = (
            (DATASETS, {DatasetVersionPublished: self.on_dataset_published}),
            (CHECKPOINTS, {CheckpointReady: self.on_checkpoint_ready}),
            (JOBS, {JobStateChanged: self.on_job_state_changed}),
        )
        for topic, handlers in routes:
            runtime.bus.subscribe(topic, handlers, deduper_factory=runtime.deduper)

    # ------------------------------------------------------------------ datasets
    async def on_dataset_published(self, event: DatasetVersionPublished) -> None:
        """Record a dataset version; the first publish of a name@version wins."""
        record = dataset_record(event, now=self.clock())
        if await self.redis.hsetnx(Keys.datasets, record.ref, record.dumps()):
            log.info("dataset %s recorded (%s)", record.ref, record.sha256)
            return
        existing = await self.store.get_dataset(record.ref)
        if existing is not None and (problem := dataset_conflict(existing, record)):
            log.error("%s", problem)
            raise ConflictError(problem)

    # ------------------------------------------------------------------ checkpoints
    async def on_checkpoint_ready(self, event: CheckpointReady) -> None:
        """Record a READY checkpoint as an artifact with lineage."""
        _annotate(event.job_id)
        job = await self._job(str(event.event_id), event.job_id)
        raw = await self.redis.hget(Keys.checkpoints(event.job_id), checkpoint_id(event.global_step, event.attempt))
        record = CheckpointRecord.model_validate_json(raw) if raw else None
        if (problem := ready_mismatch(event, record)) or job.tenant != event.tenant:
            raise ConflictError(
                f"CheckpointReady for {event.job_id} step {event.global_step} attempt {event.attempt} refused: "
                f"{problem or 'its tenant differs from the job'}"
            )
        artifact = checkpoint_artifact(job, event, await self._dataset(job.spec.dataset), now=self.clock())
        await self._put(artifact)
        self._tries.done(str(event.event_id))

    # ------------------------------------------------------------------ jobs
    async def on_job_state_changed(self, event: JobStateChanged) -> None:
        """On success, record the job's final model: its latest READY checkpoint."""
        if event.state != "succeeded":
            return
        _annotate(event.job_id)
        job = await self._job(str(event.event_id), event.job_id)
        latest = await self.store.latest_ready_checkpoint(event.job_id)
        if latest is None:
            raise self._tries.missing(
                str(event.event_id), f"job {event.job_id} succeeded but has no READY checkpoint yet"
            )
        artifact = model_artifact(job, latest, await self._dataset(job.spec.dataset), now=self.clock())
        await self._put(artifact)
        self._tries.done(str(event.event_id))

    # ------------------------------------------------------------------ helpers
    async def _job(self, event_id: str, job_id: str) -> JobRecord:
        job = await self.store.get_job(job_id)
        if job is None:
            raise self._tries.missing(event_id, f"job {job_id} has no record")
        return job

    async def _put(self, artifact: ArtifactRecord) -> None:
        if await self.store.put_artifact(artifact):
            log.info("artifact %s recorded: %s %s", artifact.artifact_id, artifact.uri, artifact.hash)
        else:
            log.debug("artifact %s was recorded before", artifact.artifact_id)

    async def _dataset(self, ref: str) -> DatasetRecord | None:
        """The dataset's record, else what its manifest in the artifact store says, else None."""
        if (record := await self.store.get_dataset(ref)) is not None:
            return record
        record = await asyncio.to_thread(self._dataset_from_disk, ref)
        if record is None:
            log.warning("dataset %s is neither registered nor in the artifact store; lineage lacks its hash", ref)
        return record

    def _dataset_from_disk(self, ref: str) -> DatasetRecord | None:
        path = self.layout.dataset_dir(*split_ref(ref)) / "manifest.json"
        try:
            manifest: Any = json.loads(path.read_bytes())
            digest = sha256_file(path)
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None
        manifest = manifest if isinstance(manifest, dict) else {}
        return dataset_from_manifest(ref, path_to_uri(path), digest, manifest, now=self.clock())


def _annotate(job_id: str) -> None:
    trace.get_current_span().set_attribute("trainyard.job_id", job_id)


def build_service(settings: RegistrySettings, *, clock: Clock = utcnow) -> ServiceRuntime:
    """The registry wired into a :class:`ServiceRuntime` (not started)."""
    runtime = ServiceRuntime(SERVICE_NAME, settings)
    Registry(runtime.redis, settings, clock=clock).install(runtime)
    return runtime
