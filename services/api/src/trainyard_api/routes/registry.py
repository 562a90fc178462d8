"""The ``registry`` routes: a job's artifacts with their lineage, one artifact or export, exporting a
checkpoint as a Hugging Face model directory, and downloading an export's files.

An artifact id holds slashes: the ``artifact`` and ``export`` path convertors (registered on import, before
the routes name them) take an id and nothing more, so ``…/{id}/export`` and ``…/{id}/files/{name}`` are
never also a plain ``GET …/{id}``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from starlette.convertors import Convertor, register_url_convertor

from trainyard_contract.records import TenantToken
from trainyard_contract.storage import ObjectPath, iter_chunks

from trainyard_api.bodies import ExportBody
from trainyard_api.deps import Ctx, Tenant, may, strict_body
from trainyard_api.http_errors import AUTH_ERRORS, JOB_ERRORS, NOT_JSON, error, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import ArtifactList, ArtifactView

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_ARTIFACT_ID = rf"{_NAME}/(?:(?:checkpoint|model)/{_NAME}|export/{_NAME}/{_NAME})"
_EXPORT_ID = rf"{_NAME}/export/{_NAME}/{_NAME}"
ARTIFACT_ID_PATTERN = rf"^{_ARTIFACT_ID}$"
"""An artifact id: ``<job>/checkpoint|model/<name>``, an export's ``<job>/export/<checkpoint>/<format>``."""
EXPORT_ID_PATTERN = rf"^{_EXPORT_ID}$"


class _IdConvertor(Convertor[str]):
    """A path parameter holding an id with slashes, and nothing more: ``…/{id}/export`` and
    ``…/{id}/files/{name}`` are then never also a plain ``GET …/{id}``."""

    def __init__(self, regex: str) -> None:
        self.regex = regex  # type: ignore[misc]  # starlette declares it on the class; each instance has its own

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("artifact", _IdConvertor(_ARTIFACT_ID))
register_url_convertor("export", _IdConvertor(_EXPORT_ID))

_EXPORT = may(Right.SUBMIT, "artifact.export")
ExportRequester = Annotated[TenantToken, _EXPORT]
ArtifactId = Annotated[str, Path(min_length=1, max_length=512, pattern=ARTIFACT_ID_PATTERN,
                                 description="`<job>/<kind>/<name>` (see GET /v1/registry/artifacts?jobId=)",
                                 examples=["job-3f2a9c1b7e4d/checkpoint/step-000000040-a1"])]
ExportId = Annotated[str, Path(min_length=1, max_length=512, pattern=EXPORT_ID_PATTERN,
                               description="an export's id, `<job>/export/<checkpoint>/<format>`",
                               examples=["job-3f2a9c1b7e4d/export/step-000000040-a1/hf"])]
ExportFileName = Annotated[str, Path(max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                     description="a file the export's listing names",
                                     examples=["model.safetensors"])]
_ARTIFACT_404 = error(404, "no such artifact (or export) for this tenant")

router = APIRouter()


@router.get("/v1/registry/artifacts", response_model=ArtifactList, tags=["registry"],
            summary="List a job's artifacts with lineage", responses=JOB_ERRORS)
async def list_artifacts(
    ctx: Ctx, tenant: Tenant,
    job_id: Annotated[str, Query(alias="jobId", max_length=128, description="the job whose artifacts to list")],
) -> ArtifactList:
    """Checkpoint, final-model and export artifacts: spec hash, code revision, dataset manifest and hash,
    tokenizer, producing attempt, content hash (an export's: the sha256 of its trainyard-export.json;
    its lineage's `parentCheckpoint` the checkpoint it was converted from)."""
    return ArtifactList(job_id=job_id, artifacts=await ctx.jobs.artifacts(tenant, job_id))


@router.get("/v1/registry/artifacts/{export_id:export}/files/{name}", tags=["registry"],
            summary="Download a file of a ready export", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}},
                             "description": "the file's bytes"},
                       **AUTH_ERRORS, **_ARTIFACT_404, **error(409, "the export is not ready (or failed)"),
                       **invalid()})
async def get_export_file(ctx: Ctx, tenant: Tenant, export_id: ExportId, name: ExportFileName) -> Response:
    """One file of the caller's tenant's ready export, streamed: only the names its
    `trainyard-export.json` lists (and that listing itself); `GET` the export for their sizes and
    sha256. `trainyard export <job> --out DIR` downloads them all and checks each."""
    path = await ctx.exports.file(tenant, export_id, name)
    if isinstance(path, ObjectPath):  # streamed from the object store, chunk by chunk (in a thread)
        return StreamingResponse(iter_chunks(path), media_type="application/octet-stream",
                                 headers={"Content-Disposition": f'attachment; filename="{name}"'})
    return FileResponse(path, media_type="application/octet-stream", filename=name)


@router.post("/v1/registry/artifacts/{artifact_id:artifact}/export", status_code=202, response_model=ArtifactView,
             tags=["registry"], summary="Export a checkpoint (a Hugging Face model directory)",
             dependencies=[strict_body(ExportBody, _EXPORT)],
             responses={
                 200: {"model": ArtifactView, "description": "that export is ready already"},
                 202: {"headers": {"Location": {"description": "the export: GET it until it is ready or failed",
                                                "required": True, "schema": {"type": "string"}}}},
                 **AUTH_ERRORS, **NOT_JSON, **_ARTIFACT_404,
                 **error(409, "the artifact cannot be exported: retired (its checkpoint deleted by retention or "
                              "refused at restore; the message says why and what to export instead), or not a "
                              "checkpoint or model"),
                 **invalid("an unknown `format` (only `hf`), or another body field")})
async def export_artifact(ctx: Ctx, tenant: ExportRequester, request: Request, response: Response,
                          artifact_id: ArtifactId, body: ExportBody) -> ArtifactView:
    """Convert a READY checkpoint (or a job's model) into `format` (`hf`: config.json,
    model.safetensors, generation_config.json, tokenizer.json + tokenizer_config.json, which
    transformers' `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load). The
    registry verifies every shard against the checkpoint's manifest first, gathers the full state
    whatever the layout (DDP, FSDP, TP, PP) and records the directory as an `export` artifact
    (`<job>/export/<checkpoint>/<format>`) with the checkpoint's lineage. The same checkpoint and
    format is the same export: while it is requested this answers `202` with it, once ready `200`; after
    it failed a new request retries. `GET` the `Location` to follow it. Submitter or above."""
    view, asked = await ctx.exports.request(tenant, artifact_id, body.format)
    request.state.audit_target = f"artifact/{artifact_id}"
    request.state.audit_detail = f"export {view.artifact_id}" + ("" if asked else f" ({view.state} already)")
    response.headers["Location"] = f"{ctx.settings.public_url}/v1/registry/artifacts/{view.artifact_id}"
    if view.state == "ready":
        response.status_code = 200
    return view


@router.get("/v1/registry/artifacts/{artifact_id:artifact}", response_model=ArtifactView, tags=["registry"],
            summary="Get an artifact or an export", responses={**AUTH_ERRORS, **_ARTIFACT_404, **invalid()})
async def get_artifact(ctx: Ctx, tenant: Tenant, artifact_id: ArtifactId) -> ArtifactView:
    """One artifact of the caller's tenant (checkpoint, model or export, with lineage), or an export's
    state: `requested`, `ready` (with its `files`), or `failed` with the `reason` and `problems`."""
    return await ctx.exports.get(tenant, artifact_id)
