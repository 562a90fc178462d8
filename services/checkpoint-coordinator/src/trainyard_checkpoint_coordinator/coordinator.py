"""The coordinator's I/O shell: ShardWritten → shard hash in Redis → (all ranks) verified
manifest on disk → READY record + CheckpointReady in one MULTI.

State in Redis (the system of record), read and written through :class:`~.ledger.CheckpointLedger`
(every settle under WATCH, its event staged in the same MULTI); this module keeps the handlers, the
verification and the commit of the manifest, and the sweep:

* ``Keys.shards(job, attempt, step)``  hash rank → :class:`ShardReport` JSON (HSETNX: the first
  report of a rank wins; a different re-report fails the checkpoint);
* ``Keys.checkpoints(job)``            hash checkpoint id → ``CheckpointRecord`` (PENDING → READY | FAILED;
                                      READY → FAILED when a restoring attempt refuses it: CheckpointRefused);
* :data:`PENDING_INDEX`               sorted set of pending checkpoints by creation time, for the timeout sweep;
* ``<shards key>:timing``             hash rank → {at, writeSeconds} of each report (for the interval advice);
* :data:`JOBS_INDEX`                  jobs with checkpoints, for garbage collection and the advice.

Besides the protocol it garbage-collects (``collector.py``: retention of READY checkpoints, files
of FAILED ones, stale temporary directories) and measures (``measurements.py``: stall, step time,
failures per device type → Young/Daly interval advice in ``ty:job:<id>:ckpt-advice``) and watches
that running jobs stay protected (``watch.py``: a job trained ``stall_intervals`` intervals past its
newest READY checkpoint is flagged CheckpointsStalled in ``ty:job:<id>:ckpt-protection``).

What is verified and what is reported: every file's size and sha256 is recomputed here from a handle
opened by the coordinator before the manifest is written (``contentHash`` summarizes them). The
manifest's ``tensorsHash`` is the combination of the entry digests the ranks reported: not
recomputed, because that would mean parsing the DCP files here, with their pickled ``.metadata``
written by a rank (unpickling it is running the rank's code). Use ``contentHash`` for integrity,
``tensorsHash`` to compare the values of runs you trust; a conflict between two ranks' digests of one
entry still fails the checkpoint.

A settled record never changes again, so duplicates and re-deliveries (also of the final
shard after READY) change nothing and publish nothing. A crash between writing the
manifest and marking READY is repaired by the re-delivery of the shard (the offset is
committed only after the handler returns) or, failing that, by the sweep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from opentelemetry import trace
from redis.asyncio import Redis
from trainyard_contract.errors import StateStoreError
from trainyard_contract.events import (
    CHECKPOINTS,
    METRICS,
    WORKERS,
    CheckpointRefused,
    ShardWritten,
    StepMetrics,
    WorkerExited,
    utcnow,
)
from trainyard_contract.manifest import (
    CheckpointManifest,
    ParallelLayout,
    local_sha256,
    local_stat_size,
    verify_manifest,
)
from trainyard_contract.records import CheckpointRecord, JobRecord, checkpoint_id
from trainyard_contract.storage import (
    ArtifactLayout,
    Location,
    ObjectPath,
    UnsafePathError,
    as_location,
    commit_bytes,
    commit_bytes_under,
    is_object_url,
    location_uri,
    remove_file,
    remove_file_under,
    sha256_under,
    stat_size_under,
    uri_to_path,
)
from trainyard_contract.tracing import job_context
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import StateStore

from trainyard_checkpoint_coordinator import metrics
from trainyard_checkpoint_coordinator.assembly import (
    CheckpointKey,
    Complete,
    JobDefaults,
    Rejected,
    ShardRefused,
    ShardReport,
    ShardVerdict,
    Waiting,
    assess,
    checkpoint_key,
    describe_conflict,
    settle_failed,
    settle_ready,
    settle_refused,
    shard_refusal,
    timeout_reason,
)
from trainyard_checkpoint_coordinator.collector import GarbageCollector
from trainyard_checkpoint_coordinator.ledger import (
    CheckpointLedger,
    Clock,
    parse_member,
)
from trainyard_checkpoint_coordinator.measurements import Measurements
from trainyard_checkpoint_coordinator.settings import CoordinatorSettings
from trainyard_checkpoint_coordinator.watch import ProtectionWatch

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("trainyard.checkpoint_coordinator")

SERVICE_NAME = "checkpoint-coordinator"
#: The measurements' consumer group is the coordinator's group plus this suffix.
MEASUREMENTS_GROUP_SUFFIX = "-measurements"

class Coordinator:
    """Collects shard reports and settles checkpoints. Handlers are idempotent."""

    def __init__(
        self,
        redis: Redis,
        outbox: Outbox,
        settings: CoordinatorSettings,
        *,
        clock: Clock = utcnow,
    ) -> None:
        self.redis = redis
        self.store = StateStore(redis)
        self.outbox = outbox
        self.settings = settings
        self.clock = clock
        self.layout = ArtifactLayout(settings.artifact_root)
        self.collector = GarbageCollector(redis, settings, clock=clock)
        self.measurements = Measurements(redis, settings, clock=clock)
        self.watch = ProtectionWatch(redis, settings, clock=clock)
        self.ledger = CheckpointLedger(redis, outbox, clock=clock)

    def install(self, runtime: ServiceRuntime) -> None:
        """Subscribe (checkpoints; metrics and worker exits for the advice) and register the loops."""
        group = f"{self.settings.group_prefix}.{SERVICE_NAME}"
        # A short retry back-off: while Redis is away every shard report fails, and the exponential
        # back-off must not keep the consumer asleep for long after Redis is back (what the ranks
        # wrote during the outage is unprotected until it is READY).
        runtime.bus.subscribe(CHECKPOINTS, {ShardWritten: self.on_shard_written,
                                            CheckpointRefused: self.on_checkpoint_refused},
                              group=group, deduper_factory=runtime.deduper,
                              retry=self.settings.shard_report_retry())
        # Measurements read in a group of their own, so the per-step metrics (one per rank and step,
        # a backlog of thousands after an outage) never queue in front of the shard reports, and their
        # retries never hold checkpoints up. They are idempotent on their own (max, once per attempt).
        measuring = f"{group}{MEASUREMENTS_GROUP_SUFFIX}"
        runtime.bus.subscribe_batch(METRICS, StepMetrics, self.measurements.on_step_metrics_batch,
                                    group=f"{measuring}-steps", background=True)
        runtime.bus.subscribe(WORKERS, {WorkerExited: self.measurements.on_worker_exited}, group=measuring,
                              background=True)
        runtime.add_loop("pending-sweep", self.sweep, every_s=self.settings.sweep_interval_s)
        runtime.add_loop("garbage-collection", self.collector.collect, every_s=self.settings.gc_interval_s)
        runtime.add_loop("interval-advice", self.measurements.advise_all, every_s=self.settings.advice_interval_s)
        runtime.add_loop("protection-watch", self.watch.check_all, every_s=self.settings.sweep_interval_s)

    # ------------------------------------------------------------------ ShardWritten
    async def on_shard_written(self, event: ShardWritten) -> None:
        """Record one rank's shard; settle the checkpoint once every rank has reported."""
        key = checkpoint_key(event)
        report = ShardReport.from_event(event)
        trace.get_current_span().set_attributes(
            {"trainyard.job_id": key.job_id, "trainyard.attempt": key.attempt,
             "trainyard.global_step": key.global_step, "trainyard.rank": report.rank}
        )
        await self._check_scope(key, report)
        verdict, existing = await self.ledger.classify(key, report)
        if verdict is ShardVerdict.NEW and not await self.ledger.record_shard(key, report, event):
            verdict, existing = await self.ledger.classify(key, report)  # another instance recorded it first
        metrics.SHARDS.labels(verdict.value).inc()
        if verdict is ShardVerdict.STALE:
            log.warning("%s: ignoring rank %d's shard from fenced epoch %d (a zombie attempt)",
                        key, report.rank, report.epoch)
            return
        if verdict is ShardVerdict.CONFLICT:
            assert existing is not None
            reason = describe_conflict(existing, report)
            if not await self._fail(key, reason):
                log.error("%s: %s; the checkpoint is settled already, left as it is", key, reason)
            return
        await self._settle(key)

    async def _check_scope(self, key: CheckpointKey, report: ShardReport) -> None:
        """Refuse (:class:`ShardRefused`: dead-lettered, counted, nothing recorded) a report that is not
        the job's own: the job record says whose job it is and where its checkpoints lie, not the event."""
        job = await self.store.get_job(key.job_id)
        directory = None if job is None else location_uri(
            self.layout.checkpoint_dir(job.tenant, job.job_id, key.attempt, key.global_step))
        reason = shard_refusal(report, key, job_tenant=job.tenant if job else None, checkpoint_dir_uri=directory)
        if reason is not None:
            metrics.SHARDS.labels("refused").inc()
            metrics.REFUSED.inc()
            log.error("%s: security: refusing rank %d's shard report: %s", key, report.rank, reason)
            raise ShardRefused(reason)

    # ------------------------------------------------------------------ CheckpointRefused
    async def on_checkpoint_refused(self, event: CheckpointRefused) -> None:
        """A restoring attempt refused a checkpoint: mark it FAILED so no attempt is handed it again.

        Idempotent: a settled FAILED/DELETED record, or one naming another manifest, stays as it
        is. No CheckpointFailed is published (the CheckpointRefused on the topic is the news);
        the garbage collector removes the files of the FAILED checkpoint later.
        """
        trace.get_current_span().set_attributes(
            {"trainyard.job_id": event.job_id, "trainyard.global_step": event.global_step,
             "trainyard.attempt": event.attempt})
        record_id = await self._refused_id(event)
        if record_id is None:
            log.warning("%s: attempt %d refused %s, which has no checkpoint record; nothing to mark",
                        event.job_id, event.attempt, event.manifest_uri)
            return
        refused = await self.ledger.change(event.job_id, record_id, lambda rec: settle_refused(rec, event))
        if refused is None:
            log.info("%s/%s: refusal by attempt %d changes nothing (settled already)",
                     event.job_id, record_id, event.attempt)
            return
        metrics.CHECKPOINTS.labels("refused").inc()
        log.warning("%s/%s FAILED: %s", event.job_id, record_id, refused.reason)

    async def _refused_id(self, event: CheckpointRefused) -> str | None:
        """The refused record's id: from (step, writing attempt), else found by its manifest."""
        if event.checkpoint_attempt is not None:
            return checkpoint_id(event.global_step, event.checkpoint_attempt)
        for record in await self.store.list_checkpoints(event.job_id):
            if record.manifest_uri == event.manifest_uri and record.global_step == event.global_step:
                return record.checkpoint_id
        return None

    # ------------------------------------------------------------------ settling
    async def _settle(self, key: CheckpointKey, *, timed_out: bool = False) -> None:
        """Assess the reports of a PENDING checkpoint and act: wait, fail, or finalize."""
        record = await self.ledger.record(key)
        if record is None or record.state != "PENDING":
            return
        reports, epoch, job = await asyncio.gather(
            self.ledger.reports(key), self.ledger.epoch(key.job_id), self.store.get_job(key.job_id),
        )
        outcome = assess(
            key, reports, world_size=record.world_size, current_epoch=epoch,
            created_at=self.clock(), defaults=_job_defaults(job),
        )
        match outcome:
            case Waiting(missing=missing):
                if timed_out:
                    await self._fail(key, timeout_reason(missing, self.settings.shard_timeout_s))
                else:
                    log.debug("%s: waiting for ranks %s", key, list(missing))
            case Rejected():
                await self._fail(key, outcome.reason)
            case Complete():
                await self._finalize(key, outcome, job)

    async def _finalize(self, key: CheckpointKey, complete: Complete, job: JobRecord | None) -> None:
        """1. verify every file  2. write manifest.json atomically (the commit point: a rename locally,
        one PUT in an object store)  3. READY + event in one MULTI."""
        manifest = complete.manifest
        started = time.perf_counter()
        with _tracer.start_as_current_span(
            "checkpoint verify", attributes={"trainyard.shards": len(manifest.shards),
                                             "trainyard.extra_files": len(manifest.extra_files)}
        ) as span:
            problems = await asyncio.to_thread(_verify, manifest, self.layout.root)  # hashing must not block the loop
            span.set_attribute("trainyard.problems", len(problems))
        metrics.VERIFY_SECONDS.observe(time.perf_counter() - started)
        if problems:
            await self._fail(key, "; ".join(problems))
            return
        path = as_location(complete.manifest_uri)
        with _tracer.start_as_current_span("checkpoint write manifest",
                                           attributes={"trainyard.uri": complete.manifest_uri}):
            try:
                await asyncio.to_thread(commit_manifest, self.layout.root, path, manifest.to_bytes())
            except (UnsafePathError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
                metrics.REFUSED.inc()
                await self._fail(key, f"security: the manifest was not committed: {exc}")
                return
        now = self.clock()
        timing = await self.ledger.timing(key)
        record = await self.ledger.transition(
            key, lambda rec, epoch: settle_ready(rec, complete, current_epoch=epoch, now=now, timing=timing)
        )
        if record is None:
            return
        if record.state != "READY":  # fenced between verification and READY: no manifest may stay
            await asyncio.to_thread(remove_manifest, self.layout.root, path)
            self._count_failed(key, record)
            return
        metrics.CHECKPOINTS.labels("ready").inc()
        metrics.CHECKPOINT_BYTES.observe(manifest.total_bytes())
        log.info("%s READY: %d shards, content %s, tensors %s, manifest %s", key, len(manifest.shards),
                 manifest.content_hash, manifest.tensors_hash, complete.manifest_uri)
        await self._after_ready(key.job_id)

    async def _fail(self, key: CheckpointKey, reason: str) -> bool:
        """Mark a PENDING checkpoint FAILED and announce it; False when it was settled already."""
        record = await self.ledger.transition(key, lambda rec, _epoch: settle_failed(rec, reason))
        if record is not None:
            self._count_failed(key, record)
        return record is not None

    def _count_failed(self, key: CheckpointKey, record: CheckpointRecord) -> None:
        metrics.CHECKPOINTS.labels("failed").inc()
        log.warning("%s FAILED: %s", key, record.reason)

    async def _after_ready(self, job_id: str) -> None:
        """Retention and a fresh interval advice; their failures never undo the READY."""
        try:
            await self.collector.collect_job(job_id)
            await self.measurements.advise(job_id)
        except Exception as exc:  # noqa: BLE001 - the periodic loops retry
            log.warning("%s: retention or advice after READY failed (the loops retry): %r", job_id, exc)

    # ------------------------------------------------------------------ timeout sweep
    async def sweep(self) -> None:
        """Settle what the shard reports alone did not: a checkpoint pending for a sweep interval
        whose shards are all recorded is finalized (a crash, or a failure that was not retried,
        left it behind after its last report); one whose attempt was fenced by a newer epoch
        fails at once (its missing ranks are gone, and a zombie never produces READY); one
        pending longer than ``shard_timeout_s`` and still missing ranks fails."""
        now = self.clock().timestamp()
        timeout_cutoff = now - self.settings.shard_timeout_s
        cutoff = now - min(self.settings.sweep_interval_s, self.settings.shard_timeout_s)
        for member, created in await self.ledger.pending_before(cutoff):
            key = parse_member(member)
            record = await self.ledger.record(key)
            if record is None or record.state != "PENDING":
                await self.ledger.unindex(member)
                continue
            timed_out = created <= timeout_cutoff
            if not timed_out and not await self.ledger.fenced(key, record) \
                    and await self.ledger.shard_count(key) < record.world_size:
                continue  # still collecting: the shard reports settle it, or the timeout does
            job = await self.store.get_job(key.job_id)
            with job_context(job.traceparent if job else None), _tracer.start_as_current_span(
                "checkpoint timeout" if timed_out else "checkpoint repair",
                attributes={"trainyard.job_id": key.job_id, "trainyard.checkpoint_id": key.checkpoint_id}
            ):
                await self._settle(key, timed_out=timed_out)


def _job_defaults(job: JobRecord | None) -> JobDefaults:
    if job is None:
        return JobDefaults()
    p = job.spec.parallelism
    return JobDefaults(spec_hash=job.spec_hash, parallelism=ParallelLayout(dp=p.data, tp=p.tensor, pp=p.pipeline))


def _verify(manifest: CheckpointManifest, root: Location | None = None) -> list[str]:
    """verify_manifest against the files (or objects); unreadable locations are problems, not crashes.
    Under a local ``root`` every file is read from a handle opened by walking down from the root without
    following a link (``storage.open_file_under``): what is hashed is the file under the job's prefix."""
    if isinstance(root, Path):
        def size(uri: str) -> int | None:
            return local_stat_size(uri) if is_object_url(uri) else stat_size_under(root, uri_to_path(uri))

        def sha(uri: str) -> str:
            return local_sha256(uri) if is_object_url(uri) else sha256_under(root, uri_to_path(uri))
    else:
        size, sha = local_stat_size, local_sha256
    try:
        return verify_manifest(manifest, stat_size=size, file_sha256=sha)
    except (StateStoreError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        return [f"cannot read the checkpoint files: {exc}"]


def commit_manifest(root: Location, location: Location, data: bytes) -> None:
    """The commit point: one PUT in an object store; locally an atomic rename in the step directory,
    opened from the artifact root one component at a time without following a link
    (:func:`~trainyard_contract.storage.commit_bytes_under`): the step directory is the rank's, and a
    link swapped in for it after verification is refused, never written through."""
    if isinstance(location, ObjectPath) or not isinstance(root, Path):
        commit_bytes(location, data)
    else:
        commit_bytes_under(root, location, data)


def remove_manifest(root: Location, location: Location) -> None:
    """Undo :func:`commit_manifest` (a fenced checkpoint), through the same directory handles."""
    if isinstance(location, ObjectPath) or not isinstance(root, Path):
        remove_file(location)
    else:
        remove_file_under(root, location)


def build_service(settings: CoordinatorSettings, *, clock: Clock = utcnow) -> ServiceRuntime:
    """The coordinator wired into a :class:`ServiceRuntime` (not started)."""
    runtime = ServiceRuntime(SERVICE_NAME, settings)
    Coordinator(runtime.redis, runtime.outbox, settings, clock=clock).install(runtime)
    return runtime
