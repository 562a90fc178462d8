"""The ``code`` routes: upload a tenant's training-code archive (named by its sha256) and read its metadata."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainyard_contract.records import TenantToken
from trainyard_contract.spec import ARCHIVE_PATTERN

from trainyard_api.code import ArchiveTooLargeError, too_large_message
from trainyard_api.deps import Ctx, Tenant, may
from trainyard_api.http_errors import AUTH_ERRORS, error, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import CodeArchiveView

Uploader = Annotated[TenantToken, may(Right.SUBMIT, "code.upload")]
ArchiveId = Annotated[str, Path(pattern=ARCHIVE_PATTERN, description="`sha256:` + the 64-hex sha256 of the archive",
                               examples=["sha256:" + "0" * 64])]
GZIP = "application/gzip"

router = APIRouter()


async def _body_within(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ArchiveTooLargeError("body", too_large_message(int(declared), limit))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ArchiveTooLargeError("body", too_large_message(size, limit))
        chunks.append(chunk)
    return b"".join(chunks)


@router.put(
    "/v1/code/{archive}", response_model=CodeArchiveView, tags=["code"], summary="Upload a code archive",
    openapi_extra={"requestBody": {"required": True, "description": "the archive's bytes (`.tar.gz`)",
                                   "content": {GZIP: {"schema": {"type": "string", "format": "binary"}}}}},
    responses={
        200: {"description": "already stored (nothing changed)"},
        201: {"model": CodeArchiveView, "description": "stored"},
        **AUTH_ERRORS,
        **error(413, "the archive is over the API's limit (`TRAINYARD_API_MAX_CODE_BYTES`)"),
        **error(415, f"the body is not sent as `{GZIP}`"),
        **invalid("the body's sha256 is not the one the path names (`path.archive`), or the body is not a "
                  "code archive the platform will unpack (`body`: a path outside the tree, a device, …)"),
    },
)
async def put_code(ctx: Ctx, tenant: Uploader, request: Request, response: Response,
                   archive: ArchiveId) -> CodeArchiveView:
    """Store the tenant's code archive (what `trainyard submit --code DIR` packs): a deterministic
    `.tar.gz` named by the sha256 of its bytes. The API checks the hash, the size and that it unpacks
    safely; a job names it in `code.archive`. Uploading an archive again answers 200 and changes
    nothing."""
    media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media != GZIP:
        raise StarletteHTTPException(415, f"send the archive as Content-Type: {GZIP}")
    data = await _body_within(request, ctx.settings.api_max_code_bytes)
    info, created = await ctx.code.upload(tenant.tenant, archive, data)
    response.status_code = 201 if created else 200
    return CodeArchiveView(archive=info.archive, size=info.size, files=info.files, uploaded_at=info.uploaded_at)


@router.get("/v1/code/{archive}", response_model=CodeArchiveView, tags=["code"],
            summary="Get a code archive's metadata",
            responses={**AUTH_ERRORS, **error(404, "not uploaded for this tenant"), **invalid()})
async def get_code(ctx: Ctx, tenant: Tenant, archive: ArchiveId) -> CodeArchiveView:
    """Size, number of files and upload time of one of the tenant's archives (404: upload it)."""
    info = await ctx.code.info(tenant.tenant, archive)
    return CodeArchiveView(archive=info.archive, size=info.size, files=info.files, uploaded_at=info.uploaded_at)
