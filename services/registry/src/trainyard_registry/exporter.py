"""The registry's export worker: EXPORTS / ExportRequested → ``trainyard-export`` in a subprocess →
an ``export`` artifact, or ExportFailed.

1. load the export's record, the checkpoint artifact and the job; decide (:func:`.exports.plan_export`):
   a ready or failed export is a no-op, a retired or unknown checkpoint is refused;
2. read the dataset's manifest for its tokenizer and end-of-document token;
3. run the conversion as a subprocess with the registry's timeout (the command verifies every shard of
   the checkpoint against its manifest, gathers the full state with DCP whatever the layout, and writes the
   directory atomically: a temporary sibling renamed into place);
4. one MULTI: the ArtifactRecord (type export), the ExportRecord ready and ArtifactRegistered(kind export)
   in the outbox; or the ExportRecord failed and ExportFailed.

At-least-once safe: a crash before step 4 leaves at most a whole directory without a record; the
redelivery removes it and converts again. A cancelled handler (shutdown) kills the subprocess and
leaves the event uncommitted, so it is redone after the restart.

Under an object-store root the command still reads and writes local files, in a scratch directory
(under ``TMPDIR``): the checkpoint and tokenizer are downloaded (verified as they stream) and the
directory it wrote is uploaded, its listing last (:mod:`.transfer`); nothing is renamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import WatchError

from trainyard_contract.errors import CheckpointError, StateStoreError
from trainyard_contract.events import EXPORTS, ExportRequested
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import ExportRecord
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.storage import (
    ArtifactLayout,
    Location,
    ObjectPath,
    UnsafePathError,
    as_location,
    is_file,
    location_uri,
    read_bytes,
)
from trainyard_runtime.store import Keys, StateStore

from trainyard_registry.exports import (
    Convert,
    Refuse,
    Skip,
    Tokenizer,
    checkpoint_name,
    dataset_tokenizer,
    export_artifact,
    export_command,
    failed,
    parse_output,
    plan_export,
    ready_record,
    refusal,
    requested_record,
)
from trainyard_registry.lineage import registered
from trainyard_registry.settings import RegistrySettings
from trainyard_registry.transfer import Staged, publish_export, remove_export, stage_inputs

log = logging.getLogger(__name__)

EXPORT_GROUP = "registry-exports"  # its own consumer group: conversions never queue in front of records
MAX_OUTPUT = 1 << 20  # bytes of the command's stdout and stderr kept


class Exporter:
    """Converts READY checkpoints on request. The handler is idempotent."""

    def __init__(self, redis: Redis, outbox: Outbox, settings: RegistrySettings, *,
                 clock: Callable[[], datetime]) -> None:
        self.redis = redis
        self.outbox = outbox
        self.store = StateStore(redis)
        self.layout = ArtifactLayout(settings.artifact_root_abs)
        self.command = list(settings.export_command)
        self.timeout_s = settings.export_timeout_s
        self.clock = clock

    def install(self, runtime: ServiceRuntime) -> None:
        runtime.bus.subscribe(EXPORTS, {ExportRequested: self.on_export_requested},
                              group=f"{runtime.settings.group_prefix}.{EXPORT_GROUP}",
                              deduper_factory=runtime.deduper, background=True)

    async def on_export_requested(self, event: ExportRequested) -> None:
        # 1. what to do
        record = await self.store.get_export(event.export_id)
        checkpoint = await self.store.get_artifact(event.job_id, event.checkpoint_artifact_id)
        job = await self.store.get_job(event.job_id)
        decision = plan_export(event, record, checkpoint, job)
        record = record or requested_record(event, now=self.clock())
        if isinstance(decision, Skip):
            log.info("%s", decision.why)
            return
        if isinstance(decision, Refuse):
            await self._fail(record, decision)
            return
        # 2.-3. convert
        out = self.layout.export_dir(event.tenant, event.job_id, checkpoint_name(event.checkpoint_artifact_id),
                                     event.format)
        outcome = await self._convert(decision, out)
        # 4. record
        if isinstance(outcome, Refuse):
            await asyncio.to_thread(_remove, out)
            await self._fail(record, outcome)
            return
        artifact = export_artifact(decision.checkpoint, event, location_uri(out), outcome, now=self.clock())
        await self._ready(record, artifact)

    async def _convert(self, todo: Convert, out: Location) -> str | Refuse:
        """The listing's sha256 of the directory written at ``out``, or why there is none."""
        spec = todo.job.spec
        dataset = await self.store.get_dataset(spec.dataset)
        manifest = as_location(dataset.manifest_uri) if dataset is not None else \
            self.layout.dataset_ref_dir(spec.dataset) / "manifest.json"
        tokenizer = await asyncio.to_thread(self._tokenizer, spec.dataset, manifest)
        await asyncio.to_thread(_remove, out)  # a whole directory a crash left without its record
        checkpoint = as_location(todo.checkpoint.uri)
        # the checkpoint is always copied (verified as it is read) before the conversion reads it: from an object
        # store, or through handles under a local root, whose directories belong to the job's user (transfer.py)
        root = None if self.layout.remote else Path(self.layout.root)
        scratch = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="trainyard-export-"))
        try:  # inputs down, the command, the directory up (listing last)
            try:
                staged = await asyncio.to_thread(stage_inputs, checkpoint, tokenizer.path, out, scratch, root=root)
            except (CheckpointError, UnsafePathError) as exc:
                log.warning("export %s refused: %s", todo.checkpoint.artifact_id, exc)
                return Refuse(str(exc), [str(exc)])
            outcome = await self._run(todo, staged, tokenizer.eos_token)
            if isinstance(outcome, Refuse) or not isinstance(out, ObjectPath):
                return outcome
            try:
                uploaded = await asyncio.to_thread(publish_export, staged.out, out)
            except StateStoreError as exc:
                if exc.retryable:
                    raise
                return Refuse(f"the export could not be stored: {exc}")
            return uploaded if uploaded == outcome else Refuse(
                f"the listing uploaded has sha256 {uploaded}, the conversion reported {outcome}")
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)

    async def _run(self, todo: Convert, staged: Staged, eos_token: str | None) -> str | Refuse:
        """Run the command over local paths: the listing's sha256 it reports, or why there is none."""
        cmd = export_command(self.command, checkpoint=staged.checkpoint, out=staged.out, spec=todo.job.spec,
                             tokenizer=Tokenizer(staged.tokenizer, eos_token))
        log.info("exporting %s to %s", todo.checkpoint.artifact_id, staged.out)
        returncode, stdout, stderr = await run(cmd, timeout_s=self.timeout_s)
        converted = parse_output(stdout) if returncode == 0 else None
        if converted is None:
            if returncode == 0:
                return Refuse(f"the conversion printed no result ({stdout[-200:]!r})")
            return refusal(returncode, stderr, timeout_s=self.timeout_s, command=cmd)
        return converted.sha256

    def _tokenizer(self, dataset_ref: str, path: Location) -> Tokenizer:
        """The dataset's tokenizer file and end-of-document token, from its manifest at ``path`` (blocking)."""
        try:
            manifest: Any = json.loads(read_bytes(path))
        except (OSError, ValueError):
            log.warning("dataset %s: no readable manifest at %s; the export has no tokenizer", dataset_ref, path)
            return Tokenizer(None, None)
        tokenizer = dataset_tokenizer(manifest, path.parent)
        if tokenizer.path is not None and not is_file(tokenizer.path):
            log.warning("dataset %s: its tokenizer %s is missing; the export has none", dataset_ref, tokenizer.path)
            return Tokenizer(None, None)
        return tokenizer

    async def _ready(self, record: ExportRecord, artifact: Any) -> None:
        """Artifact, ready record and ArtifactRegistered in one MULTI (unless it is ready already)."""
        def stage(pipe: Any, current: ExportRecord) -> None:
            now = self.clock()
            pipe.hset(Keys.artifacts(artifact.job_id), artifact.artifact_id, artifact.dumps())
            pipe.set(Keys.export(record.export_id), ready_record(current, artifact, now=now).dumps())
            self.outbox.stage(pipe, registered(artifact, now=now))

        if await self._transition(record, applies=lambda current: current.state != "ready", stage=stage):
            log.info("export %s ready: %s %s", artifact.artifact_id, artifact.uri, artifact.hash)

    async def _fail(self, record: ExportRecord, refused: Refuse) -> None:
        """The record failed and ExportFailed in one MULTI (unless it is ready or failed already)."""
        def stage(pipe: Any, current: ExportRecord) -> None:
            changed, event = failed(current, refused, now=self.clock())
            pipe.set(Keys.export(record.export_id), changed.dumps())
            self.outbox.stage(pipe, event)

        if await self._transition(record, applies=lambda current: current.state == "requested", stage=stage):
            log.warning("export %s failed: %s", record.export_id, refused.reason)

    async def _transition(self, record: ExportRecord, *, applies: Callable[[ExportRecord], bool],
                          stage: Callable[[Any, ExportRecord], None]) -> bool:
        """WATCH the export's record; if ``applies`` to what is stored (else the request's ``record``), write what
        ``stage`` stages in one MULTI, deciding again when the record changed meanwhile. False: nothing to do."""
        key = Keys.export(record.export_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    current = ExportRecord.model_validate_json(raw) if raw else record
                    if not applies(current):
                        await pipe.reset()
                        return False
                    pipe.multi()
                    stage(pipe, current)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue


async def run(cmd: Sequence[str], *, timeout_s: float) -> tuple[int | None, str, str]:
    """Run ``cmd``; its exit code (None: killed at the timeout), stdout and stderr. Cancelled, it kills the
    process first."""
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await proc.communicate()
    except TimeoutError:
        await _kill(proc)
        return None, "", ""
    except asyncio.CancelledError:
        await _kill(proc)
        raise
    return proc.returncode, stdout[-MAX_OUTPUT:].decode(errors="replace"), stderr[-MAX_OUTPUT:].decode(
        errors="replace")


async def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()


def _remove(directory: Location) -> None:
    """The export directory, and the temporary siblings a killed conversion left (``.<name>.tmp-…``);
    in an object store its objects, the listing first."""
    if isinstance(directory, ObjectPath):
        remove_export(directory)
        return
    shutil.rmtree(directory, ignore_errors=True)
    for partial in directory.parent.glob(f".{directory.name}.tmp-*"):
        shutil.rmtree(partial, ignore_errors=True)
