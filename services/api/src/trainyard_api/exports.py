"""Exports as tenants see them: request one of a READY checkpoint, follow it, download its files.

:func:`export_request` decides over plain data (the artifact, the export's record); :class:`ExportService`
loads them, stores a new request's ExportRecord and stages its ExportRequested in one MULTI (the
registry converts it, see services/registry exporter.py). Another tenant's artifact is answered exactly
like one that does not exist.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from redis.exceptions import WatchError

from trainyard_contract.errors import ConflictError, NotFoundError
from trainyard_contract.events import ExportRequested, export_id, utcnow
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import ArtifactRecord, EvaluationResult, ExportRecord, TenantToken
from trainyard_contract.storage import (
    EXPORT_LISTING,
    ArtifactLayout,
    Location,
    as_location,
    export_listing,
    is_file,
    read_bytes,
)
from trainyard_runtime.store import Keys, StateStore

from trainyard_api.schemas import ArtifactView, ExportFile

EXPORTABLE = ("checkpoint", "model")
NOT_FOUND = ("no artifact {id!r} for your tenant; GET /v1/registry/artifacts?jobId=<job> lists a job's artifacts "
             "(ids like <job>/checkpoint/step-000000040-a1)")


def job_of(artifact_id: str) -> str | None:
    """The job an artifact id names (``<job>/<kind>/<name>…``); None when it names none."""
    job_id, sep, rest = artifact_id.partition("/")
    return job_id if sep and job_id and rest else None


# ----------------------------------------------------------------------------- pure decisions


@dataclass(frozen=True)
class Existing:
    """The same checkpoint and format was asked for before and is requested or ready: answer with it."""

    record: ExportRecord


@dataclass(frozen=True)
class New:
    """Store ``record`` (requested) and stage ``event``."""

    record: ExportRecord
    event: ExportRequested


def export_request(
    token: TenantToken, artifact_id: str, artifact: ArtifactRecord | None, record: ExportRecord | None,
    fmt: str, *, now: datetime,
) -> Existing | New:
    """What ``POST /v1/registry/artifacts/{artifact_id}/export`` does: NotFoundError for an artifact that is
    not the caller's tenant's; ConflictError (with what to do instead) for one that cannot be exported;
    the existing export while it is requested or ready; else a new request (also after a failure: a
    retry)."""
    if artifact is None or artifact.tenant != token.tenant:
        raise NotFoundError(NOT_FOUND.format(id=artifact_id))
    if artifact.type not in EXPORTABLE:
        raise ConflictError(f"{artifact_id} is an {artifact.type} artifact; only checkpoints and models are "
                            f"exported: POST /v1/registry/artifacts/<job>/checkpoint/<step>/export")
    if artifact.retired_at is not None:
        raise ConflictError(f"retired: {artifact.retired_reason or 'its checkpoint is gone'}; export a READY "
                            f"checkpoint: trainyard export {artifact.job_id} --step N")
    if record is not None and record.state in ("requested", "ready"):
        return Existing(record)
    eid = export_id(artifact_id, fmt)
    event = ExportRequested(
        occurred_at=now, export_id=eid, checkpoint_artifact_id=artifact_id, job_id=artifact.job_id,
        tenant=artifact.tenant, format=fmt, requested_by=token.token_id or token.name,
    )
    return New(ExportRecord(export_id=eid, checkpoint_artifact_id=artifact_id, job_id=artifact.job_id,
                            tenant=artifact.tenant, format=fmt, state="requested", requested_by=event.requested_by,
                            requested_at=now), event)


def export_view(record: ExportRecord, artifact: ArtifactRecord | None, files: list[ExportFile] | None
                ) -> ArtifactView:
    return ArtifactView(artifact_id=record.export_id, type="export", state=record.state, artifact=artifact,
                        export=record, files=files)


# ----------------------------------------------------------------------------- the shell


class ExportService:
    def __init__(self, store: StateStore, outbox: Outbox, layout: ArtifactLayout, *,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.redis = store.redis
        self.outbox = outbox
        self.layout = layout
        self.clock = clock

    async def request(self, token: TenantToken, artifact_id: str, fmt: str) -> tuple[ArtifactView, bool]:
        """Ask for the export of a checkpoint or model artifact; the view and whether this call asked."""
        job_id = job_of(artifact_id)
        artifact = await self.store.get_artifact(job_id, artifact_id) if job_id else None
        if artifact is None or artifact.tenant != token.tenant:
            raise NotFoundError(NOT_FOUND.format(id=artifact_id))
        key = Keys.export(export_id(artifact_id, fmt))
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    record = ExportRecord.model_validate_json(raw) if raw else None
                    decision = export_request(token, artifact_id, artifact, record, fmt, now=self.clock())
                    if isinstance(decision, Existing):
                        await pipe.reset()
                        return await self._view(decision.record), False
                    pipe.multi()
                    pipe.set(key, decision.record.dumps())
                    self.outbox.stage(pipe, decision.event)
                    await pipe.execute()
                    return export_view(decision.record, None, None), True
                except WatchError:
                    continue

    async def get(self, token: TenantToken, artifact_id: str) -> ArtifactView:
        """One artifact of the caller's tenant, or an export's state (requested, ready, failed with why)."""
        job_id = job_of(artifact_id)
        if job_id is None:
            raise NotFoundError(NOT_FOUND.format(id=artifact_id))
        record = await self.store.get_export(artifact_id)
        if record is not None and record.tenant == token.tenant:
            return await self._view(record)
        artifact = await self.store.get_artifact(job_id, artifact_id)
        if artifact is None or artifact.tenant != token.tenant:
            raise NotFoundError(NOT_FOUND.format(id=artifact_id))
        return ArtifactView(artifact_id=artifact.artifact_id, type=artifact.type,
                            state="retired" if artifact.retired_at else "ready", artifact=artifact,
                            evaluations=await self._evaluations(artifact) if artifact.type == "checkpoint" else None)

    async def _evaluations(self, checkpoint: ArtifactRecord) -> list[EvaluationResult]:
        """The evaluations attached to a checkpoint (the registry's ``ty:evals:<job>``), by when they finished."""
        found = [EvaluationResult.model_validate_json(raw) for raw in
                 await self.redis.hvals(Keys.evaluations(checkpoint.job_id))]
        return sorted((e for e in found if e.checkpoint_id == checkpoint.artifact_id), key=lambda e: e.finished_at)

    async def _view(self, record: ExportRecord) -> ArtifactView:
        if record.state != "ready":
            return export_view(record, None, None)
        artifact = await self.store.get_artifact(record.job_id, record.export_id)
        directory = as_location(record.uri) if record.uri else None
        files = await asyncio.to_thread(_files, directory) if directory is not None else None
        return export_view(record, artifact, files)

    async def file(self, token: TenantToken, eid: str, name: str) -> Location:
        """The path of one file of a ready export of the caller's tenant (an object under an object-store
        root): only names its listing has."""
        record = await self.store.get_export(eid)
        if record is None or record.tenant != token.tenant:
            raise NotFoundError(f"no export {eid!r} for your tenant; POST /v1/registry/artifacts/<checkpoint>/export "
                                "asks for one")
        if record.state != "ready" or not record.uri:
            raise ConflictError(f"export {eid} is {record.state}"
                                + (f": {record.reason}" if record.reason else "; GET it until it is ready"))
        directory = as_location(record.uri)
        names = {f.name for f in await asyncio.to_thread(_files, directory) or []}
        if name not in names:
            raise NotFoundError(f"export {eid} has no file {name!r}; GET /v1/registry/artifacts/{eid} lists them")
        path = directory / name
        if not await asyncio.to_thread(is_file, path):
            raise NotFoundError(f"export {eid}: {name} is gone from its directory")
        return path


def _files(directory: Location) -> list[ExportFile] | None:
    """The files an export's listing names, with the listing itself first (None: no readable listing)."""
    listing = directory / EXPORT_LISTING
    try:
        raw = read_bytes(listing)
        listed = export_listing(raw)
    except (OSError, ValueError):
        return None
    own = ExportFile(name=EXPORT_LISTING, size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    return [own, *(ExportFile(name=f.name, size=f.size, sha256=f.sha256) for f in listed)]
