"""The registry's I/O shell: datasets, checkpoint artifacts and model artifacts with lineage.

* DATASETS / DatasetVersionPublished → verified (manifest under its owner's prefix, its sha256,
  every shard's size and sha256: :mod:`.verification`) → ``DatasetRecord`` keyed by the qualified
  ref + ArtifactRegistered(kind="dataset") in one MULTI; else a ``DatasetRejection`` +
  DatasetRejected (also for a different sha256 of a ref recorded already: the first stays);
* CHECKPOINTS / CheckpointReady → ``ArtifactRecord`` type "checkpoint" (one for a checkpoint that was
  READY and is DELETED or refused since is recorded already retired, never dead-lettered);
* CHECKPOINTS / CheckpointRefused → that checkpoint's artifact is marked retired;
* CHECKPOINTS / EvaluationReported (an evaluation job's rank 0) → an ``EvaluationResult`` in ``ty:evals:<job>`` of
  the checkpoint the evaluation job's spec names (:mod:`.evaluations`);
* a periodic retire sweep marks retired the artifacts whose checkpoint retention has DELETED
  (jobs with live artifacts are indexed in ``Keys.registry_live``);
* JOBS / JobStateChanged(succeeded) → ``ArtifactRecord`` type "model" (latest READY checkpoint); when the
  job's spec says ``export``, its ExportRequested (requestedBy "spec") and requested ExportRecord are staged
  in the same MULTI;
* EXPORTS / ExportRequested → :class:`.exporter.Exporter` (its own consumer group): an ``export`` artifact
  (a Hugging Face model directory) or ExportFailed.

What it records and retires is announced on REGISTRY, the public feed (``ArtifactRegistered`` /
``ArtifactRetired``), staged in the outbox in the MULTI that writes the record: the transaction
that creates an artifact announces it, the one that retires it announces that, so a redelivery
announces nothing twice. A late CheckpointReady for a checkpoint retired since announces
Registered then Retired (one MULTI), so a follower that applies the feed in order ends where
the record is.

Artifact ids are deterministic and created only when absent, so re-deliveries are no-ops.
Events on different topics arrive in any order: when a record an event needs is not there
yet, the handler raises a retryable error (the bus re-delivers after back-off), and after
``missing_retry_limit`` tries a non-retryable one (the bus dead-letters it), so a partition
is never blocked forever.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from opentelemetry import trace
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from trainyard_contract.errors import ConflictError, NotFoundError, StateStoreError
from trainyard_contract.events import (
    CHECKPOINTS,
    DATASETS,
    JOBS,
    TERMINAL_STATES,
    CheckpointReady,
    CheckpointRefused,
    DatasetVersionPublished,
    EvaluationReported,
    Event,
    ExportRequested,
    JobStateChanged,
    dataset_key,
    utcnow,
)
from trainyard_contract.records import (
    ArtifactRecord,
    CheckpointRecord,
    DatasetRecord,
    DatasetRejection,
    JobRecord,
    checkpoint_id,
    expects_final_checkpoint,
)
from trainyard_runtime.bus import Handler
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.storage import (
    ArtifactLayout,
    ObjectPath,
    is_object_url,
    location_uri,
    read_bytes,
    sha256_file,
    sha256_of,
    stat_size,
    uri_to_path,
)
from trainyard_runtime.store import Keys, StateStore

from trainyard_registry.evaluations import EvaluationRecorder
from trainyard_registry.exporter import Exporter
from trainyard_registry.exports import auto_export, requested_record
from trainyard_registry.lineage import (
    checkpoint_artifact,
    dataset_conflict,
    dataset_from_manifest,
    dataset_record,
    dataset_registered,
    dataset_rejection,
    model_artifact,
    ready_mismatch,
    registered,
    retire,
    retired_notice,
    retired_since_ready,
    retirements,
)
from trainyard_registry.settings import RegistrySettings
from trainyard_registry.verification import (
    FileSeen,
    Listed,
    VersionSeen,
    listed_files,
    plain_file_name,
    ref_problem,
    version_problems,
)

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

    def __init__(self, redis: Redis, outbox: Outbox, settings: RegistrySettings, *, clock: Clock = utcnow) -> None:
        self.redis = redis
        self.outbox = outbox  # what it records is announced on REGISTRY (and DATASETS) in the same MULTI
        self.store = StateStore(redis)
        self.layout = ArtifactLayout(settings.artifact_root_abs)
        self.clock = clock
        self._tries = _MissingTries(settings.missing_retry_limit)
        self.retire_interval_s = settings.retire_interval_s
        self.exporter = Exporter(redis, outbox, settings, clock=clock)
        self.evaluations = EvaluationRecorder(redis, self._tries.missing, clock=clock)

    def install(self, runtime: ServiceRuntime) -> None:
        """Subscribe to datasets, checkpoints and jobs (one consumer group, one consumer)."""
        routes: tuple[tuple[str, dict[type[Event], Handler]], ...] = (
            (DATASETS, {DatasetVersionPublished: self.on_dataset_published}),
            (CHECKPOINTS, {CheckpointReady: self.on_checkpoint_ready,
                           CheckpointRefused: self.on_checkpoint_refused,
                           EvaluationReported: self.evaluations.on_evaluation_reported}),
            (JOBS, {JobStateChanged: self.on_job_state_changed}),
        )
        for topic, handlers in routes:
            runtime.bus.subscribe(topic, handlers, deduper_factory=runtime.deduper, background=True)
        runtime.add_loop("retire-sweep", self.retire_sweep, every_s=self.retire_interval_s)
        self.exporter.install(runtime)

    # ------------------------------------------------------------------ datasets
    async def on_dataset_published(self, event: DatasetVersionPublished) -> None:
        """Verify a published version, then record it for its tenant and announce it (ArtifactRegistered),
        or record and announce why not (DatasetRejected). The first verified publish of a ref wins."""
        ref = dataset_key(event.tenant, event.name, event.version)
        existing = await self.store.get_dataset(ref) if ref_problem(event) is None else None
        if existing is None:
            problems, manifest = await self._verify(event)
            if not problems:
                record = dataset_record(event, now=self.clock(), manifest=manifest)
                if (existing := await self._record_dataset(record)) is None:
                    log.info("dataset %s verified and recorded (%s)", ref, record.sha256)
                    return
        if existing is not None:  # recorded before (or by a racing publish)
            if (conflict := dataset_conflict(existing, event)) is None:
                log.info("dataset %s re-published with the same sha256: nothing to do", ref)
                return
            problems = [conflict]
        await self._reject(event, problems)

    async def _verify(self, event: DatasetVersionPublished) -> tuple[list[str], Any]:
        """The problems of a published version, and the manifest that was checked."""
        if problem := ref_problem(event):
            return [problem], None
        seen = await asyncio.to_thread(self._read_version, event)
        return version_problems(event, seen), seen.manifest

    def _read_version(self, event: DatasetVersionPublished) -> VersionSeen:
        """What the event points at, read from the artifact store (blocking: run in a thread)."""
        expected = self.layout.dataset_dir(event.name, event.version, event.tenant)
        if isinstance(expected, ObjectPath) or is_object_url(event.manifest_uri):
            return _read_object_version(event, expected)
        try:
            path = uri_to_path(event.manifest_uri).resolve()
        except (StateStoreError, OSError, RuntimeError):
            return VersionSeen(expected_dir=str(expected), manifest_path=None, inside=False)
        if not (path.is_relative_to(expected) and path.is_file()):
            return VersionSeen(expected_dir=str(expected), manifest_path=str(path), inside=False)
        try:
            raw = path.read_bytes()
        except OSError:
            return VersionSeen(expected_dir=str(expected), manifest_path=str(path), inside=True)
        return _version_seen(expected, path, raw, _file_seen)

    async def _record_dataset(self, record: DatasetRecord) -> DatasetRecord | None:
        """Record a verified version and stage its ArtifactRegistered in one MULTI; the version recorded
        before instead, when there is one (nothing is written then). A refusal of this very content (say,
        published before its files were in place) is cleared; one of other content stays, as it is still
        true (its publisher reads it in ``GET /v1/datasets/{ref}?sha256=…``)."""
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(Keys.datasets, Keys.dataset_rejections)
                    if raw := await pipe.hget(Keys.datasets, record.ref):
                        return DatasetRecord.model_validate_json(raw)
                    refused = await pipe.hget(Keys.dataset_rejections, record.ref)
                    pipe.multi()
                    pipe.hset(Keys.datasets, record.ref, record.dumps())
                    if refused and DatasetRejection.model_validate_json(refused).sha256 == record.sha256:
                        pipe.hdel(Keys.dataset_rejections, record.ref)
                    self.outbox.stage(pipe, dataset_registered(record, now=self.clock()))
                    await pipe.execute()
                    return None
                except WatchError:
                    continue

    async def _reject(self, event: DatasetVersionPublished, problems: list[str]) -> None:
        """Keep why the version was refused (apart from verified ones) and stage DatasetRejected, once per
        published event (a re-delivery changes nothing)."""
        record, rejected = dataset_rejection(event, problems, now=self.clock())
        previous = await self.store.get_dataset_rejection(record.ref)
        if previous is not None and previous.published_event_id == record.published_event_id:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(Keys.dataset_rejections, record.ref, record.dumps())
            self.outbox.stage(pipe, rejected)
            await pipe.execute()
        log.warning("dataset %s rejected: %s", record.ref, record.reason)

    # ------------------------------------------------------------------ checkpoints
    async def on_checkpoint_ready(self, event: CheckpointReady) -> None:
        """Record a READY checkpoint as an artifact with lineage."""
        _annotate(event.job_id)
        job = await self._job(str(event.event_id), event.job_id)
        raw = await self.redis.hget(Keys.checkpoints(event.job_id), checkpoint_id(event.global_step, event.attempt))
        record = CheckpointRecord.model_validate_json(raw) if raw else None
        if job.tenant == event.tenant and (retired := retired_since_ready(event, record)):
            # A late event for a checkpoint deleted or refused since: lineage kept, marked retired;
            # announced as registered, then retired.
            artifact = checkpoint_artifact(job, event, await self._dataset(job.spec.dataset), now=self.clock())
            if not await self._put(artifact, retired=retired):
                await self._retire_artifact(job.job_id, artifact.artifact_id, retired)
            log.info("CheckpointReady for retired %s recorded as retired: %s", artifact.artifact_id, retired)
            self._tries.done(str(event.event_id))
            return
        if (problem := ready_mismatch(event, record)) or job.tenant != event.tenant:
            raise ConflictError(
                f"CheckpointReady for {event.job_id} step {event.global_step} attempt {event.attempt} refused: "
                f"{problem or 'its tenant differs from the job'}"
            )
        artifact = checkpoint_artifact(job, event, await self._dataset(job.spec.dataset), now=self.clock())
        await self._put(artifact)
        self._tries.done(str(event.event_id))

    async def on_checkpoint_refused(self, event: CheckpointRefused) -> None:
        """A restoring attempt refused a checkpoint: its artifacts are retired (idempotent)."""
        _annotate(event.job_id)
        reason = f"refused at restore by attempt {event.attempt}: {'; '.join(event.problems) or 'verification failed'}"
        artifacts = [a for a in await self.store.list_artifacts(event.job_id)
                     if a.uri == event.manifest_uri and a.tenant == event.tenant]
        if not artifacts:
            log.info("%s: refused %s has no artifact (yet); a late CheckpointReady is recorded retired",
                     event.job_id, event.manifest_uri)
        for artifact in artifacts:
            await self._retire_artifact(event.job_id, artifact.artifact_id, reason)

    async def retire_sweep(self) -> None:
        """Mark retired the artifacts whose checkpoint record is DELETED (retention) or FAILED."""
        job_ids: list[str] = await self.redis.zrange(Keys.registry_live, 0, -1)  # type: ignore[assignment]  # decoded
        for job_id in job_ids:
            # Asked before the records are read: a deletion the GC made before it is done is in them.
            gc_done = await self._gc_done(job_id)
            artifacts = await self.store.list_artifacts(job_id)
            records = await self.store.list_checkpoints(job_id)
            for changed in retirements(artifacts, records, now=self.clock()):
                await self._retire_artifact(job_id, changed.artifact_id, changed.retired_reason or "retired")
            if gc_done or all(a.retired_at is not None for a in await self.store.list_artifacts(job_id)):
                await self.redis.zrem(Keys.registry_live, job_id)  # nothing more to retire

    async def _gc_done(self, job_id: str) -> bool:
        """The job ended and the coordinator's GC is done with it: none of its checkpoints will go any more."""
        job = await self.store.get_job(job_id)
        gc_pending = await self.redis.zscore(Keys.checkpoint_jobs, job_id) is not None
        return job is not None and job.state in TERMINAL_STATES and not gc_pending

    async def _retire_artifact(self, job_id: str, artifact_id: str, reason: str) -> ArtifactRecord | None:
        key = Keys.artifacts(job_id)
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await pipe.hget(key, artifact_id)
                    changed = retire(ArtifactRecord.model_validate_json(raw), reason, now=self.clock()) if raw else None
                    if changed is None:
                        return None
                    pipe.multi()
                    pipe.hset(key, artifact_id, changed.dumps())
                    self.outbox.stage(pipe, retired_notice(changed, now=self.clock()))
                    await pipe.execute()
                    log.info("artifact %s retired: %s", artifact_id, reason)
                    return changed
                except WatchError:
                    continue

    # ------------------------------------------------------------------ jobs
    async def on_job_state_changed(self, event: JobStateChanged) -> None:
        """On success, record the job's final model: its latest READY checkpoint."""
        if event.state != "succeeded":
            return
        _annotate(event.job_id)
        job = await self._job(str(event.event_id), event.job_id)
        if not expects_final_checkpoint(job):  # user code that saved no final checkpoint: nothing to wait for
            log.info("job %s succeeded without a final checkpoint (its code saved none): no model artifact",
                     event.job_id)
            self._tries.done(str(event.event_id))
            return
        latest = await self.store.latest_ready_checkpoint(event.job_id)
        if latest is None:
            raise self._tries.missing(
                str(event.event_id), f"job {event.job_id} succeeded but has no READY checkpoint yet"
            )
        artifact = model_artifact(job, latest, await self._dataset(job.spec.dataset), now=self.clock())
        await self._put(artifact, export=await self._auto_export(artifact, job))
        self._tries.done(str(event.event_id))

    async def _auto_export(self, artifact: ArtifactRecord, job: JobRecord) -> ExportRequested | None:
        """The spec's export of the final model, unless that export was asked for already (by the API)."""
        request = auto_export(artifact, job.spec, now=self.clock())
        if request is None or await self.redis.exists(Keys.export(request.export_id)):
            return None
        return request

    # ------------------------------------------------------------------ helpers
    async def _job(self, event_id: str, job_id: str) -> JobRecord:
        job = await self.store.get_job(job_id)
        if job is None:
            raise self._tries.missing(event_id, f"job {job_id} has no record")
        return job

    async def _put(self, artifact: ArtifactRecord, *, retired: str | None = None,
                   export: ExportRequested | None = None) -> bool:
        """Record ``artifact`` (already retired, for ``retired``) and announce it, unless it was
        recorded before; False then, and nothing announced. ``export``: its conversion, requested in the
        same MULTI (with the export's record)."""
        now = self.clock()
        events: list[Event] = [registered(artifact, now=now)]
        if export is not None:
            events.append(export)
        if retired is not None:
            artifact = retire(artifact, retired, now=now) or artifact
            events.append(retired_notice(artifact, now=now))
        else:
            await self.redis.zadd(Keys.registry_live, {artifact.job_id: now.timestamp()})

        def stage(pipe: Pipeline) -> None:
            if export is not None:
                pipe.set(Keys.export(export.export_id), requested_record(export, now=now).dumps(), nx=True)
            for event in events:
                self.outbox.stage(pipe, event)

        if await self.store.create_artifact(artifact, stage):
            log.info("artifact %s recorded: %s %s", artifact.artifact_id, artifact.uri, artifact.hash)
            return True
        log.debug("artifact %s was recorded before", artifact.artifact_id)
        return False

    async def _dataset(self, ref: str) -> DatasetRecord | None:
        """The dataset's record, else what its manifest in the artifact store says, else None."""
        if (record := await self.store.get_dataset(ref)) is not None:
            return record
        record = await asyncio.to_thread(self._dataset_from_disk, ref)
        if record is None:
            log.warning("dataset %s is neither registered nor in the artifact store; lineage lacks its hash", ref)
        return record

    def _dataset_from_disk(self, ref: str) -> DatasetRecord | None:
        path = self.layout.dataset_ref_dir(ref) / "manifest.json"  # an object under an object-store root
        try:
            raw = read_bytes(path)
            manifest: Any = json.loads(raw)
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None
        manifest = manifest if isinstance(manifest, dict) else {}
        return dataset_from_manifest(ref, location_uri(path), hashlib.sha256(raw).hexdigest(), manifest,
                                     now=self.clock())


def _file_seen(directory: Path, item: Listed) -> FileSeen:
    """The size and (streamed) sha256 of one listed file, if it is a regular file in ``directory``."""
    path = directory / item.file
    try:
        if path.resolve().parent != directory or not path.is_file():
            return FileSeen(size=None)
        size = path.stat().st_size
        if item.size is not None and size != item.size:
            return FileSeen(size=size)
        return FileSeen(size=size, sha256=sha256_file(path))
    except OSError:
        return FileSeen(size=None)


def _read_object_version(event: DatasetVersionPublished, expected: Any) -> VersionSeen:
    """:meth:`Registry._read_version` under an object-store root: the manifest must be an object under the
    owner's prefix (an object URL is normalised, so ``..`` cannot leave it); every listed object's size,
    then its sha256, streamed. A missing object is a finding; any other store error is retryable."""
    try:
        location = ObjectPath.parse(event.manifest_uri)
    except ValueError:
        return VersionSeen(expected_dir=str(expected), manifest_path=None, inside=False)
    if not (isinstance(expected, ObjectPath) and expected in location.parents):
        return VersionSeen(expected_dir=str(expected), manifest_path=str(location), inside=False)
    try:
        raw = read_bytes(location)
    except FileNotFoundError:
        return VersionSeen(expected_dir=str(expected), manifest_path=str(location), inside=False)
    except OSError as exc:
        raise StateStoreError(f"cannot read {location}: {exc}", retryable=True) from exc
    return _version_seen(expected, location, raw, _object_seen)


def _version_seen(expected: Any, location: Any, raw: bytes, seen: Callable[[Any, Any], FileSeen]) -> VersionSeen:
    """A manifest found where it belongs (``raw``, at ``location``), and what ``seen`` finds of each plain file it
    lists next to it (on disk or in the store)."""
    try:
        manifest: Any = json.loads(raw)
    except ValueError:
        manifest = None
    files = {item.file: seen(location.parent, item) for item in listed_files(manifest) if plain_file_name(item.file)}
    return VersionSeen(expected_dir=str(expected), manifest_path=str(location), inside=True,
                       sha256=hashlib.sha256(raw).hexdigest(), manifest=manifest, files=files)


def _object_seen(prefix: ObjectPath, item: Listed) -> FileSeen:
    """The size and (streamed) sha256 of one listed object under ``prefix``."""
    location = prefix / item.file
    try:
        size = stat_size(location)
        if size is None or (item.size is not None and size != item.size):
            return FileSeen(size=size)
        return FileSeen(size=size, sha256=sha256_of(location))
    except FileNotFoundError:  # deleted between the two requests
        return FileSeen(size=None)
    except OSError as exc:
        raise StateStoreError(f"cannot read {location}: {exc}", retryable=True) from exc


def _annotate(job_id: str) -> None:
    trace.get_current_span().set_attribute("trainyard.job_id", job_id)


def build_service(settings: RegistrySettings, *, clock: Clock = utcnow) -> ServiceRuntime:
    """The registry wired into a :class:`ServiceRuntime` (not started)."""
    runtime = ServiceRuntime(SERVICE_NAME, settings)
    Registry(runtime.redis, runtime.outbox, settings, clock=clock).install(runtime)
    return runtime
