"""The ``admin`` route over the audit log: every administrative and control action, who, what, when and
with what outcome."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from trainyard_contract.records import TenantToken

from trainyard_api.auth import require
from trainyard_api.bodies import TENANT_PATTERN
from trainyard_api.deps import Ctx, may
from trainyard_api.http_errors import ADMIN_ERRORS, invalid
from trainyard_api.roles import Right, rights
from trainyard_api.schemas import AuditPage
from trainyard_api.validation import STREAM_ID_PATTERN

AuditReader = Annotated[TenantToken, may(Right.READ_AUDIT)]

router = APIRouter()


@router.get("/v1/admin/audit", response_model=AuditPage, tags=["admin"], summary="Read the audit log",
            responses={**ADMIN_ERRORS, **invalid()})
async def read_audit(
    ctx: Ctx, reader: AuditReader,
    tenant: Annotated[str | None, Query(pattern=TENANT_PATTERN, max_length=63,
                                        description="only this tenant's entries (a tenant-admin: its own)")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="entries per page, newest first")] = 100,
    before: Annotated[str | None, Query(pattern=STREAM_ID_PATTERN, max_length=41,
                                        description="`nextBefore` of the previous page: a stream id "
                                                    "`<milliseconds>-<sequence>`, each at most 2^64-1")] = None,
) -> AuditPage:
    """Every administrative action and every control action on a job (submit, pause, resume, cancel,
    code upload, trigger create and delete): who (token id, name, tenant, role), what (action, target), when, and the outcome
    (ok, denied, not-found, conflict, invalid, failed). A platform-admin reads all of it (or one
    tenant's with `tenant`), a tenant-admin its own tenant's."""  # noqa: E501 - the OpenAPI description, as served
    if tenant is None and Right.ALL_TENANTS not in rights(reader.effective_role):
        tenant = reader.tenant
    if tenant is not None:
        require(reader, Right.READ_AUDIT, tenant)
    return await ctx.audit.page(tenant, limit=limit, before=before)
