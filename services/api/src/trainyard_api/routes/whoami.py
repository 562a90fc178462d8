"""The ``admin`` route every token may call: what the caller's token acts as and may do."""

from __future__ import annotations

from fastapi import APIRouter

from trainyard_api.deps import Tenant
from trainyard_api.http_errors import AUTH_ERRORS
from trainyard_api.roles import rights
from trainyard_api.schemas import WhoAmI

router = APIRouter()


@router.get("/v1/whoami", response_model=WhoAmI, tags=["admin"], summary="The caller's token: tenant, name, role",
            responses=AUTH_ERRORS)
async def whoami(tenant: Tenant) -> WhoAmI:
    """What the token acts as and may do (the dashboard shows the admin views only to platform-admins)."""
    role = tenant.effective_role
    return WhoAmI(tenant=tenant.tenant, name=tenant.name, token_id=tenant.token_id, role=role,
                  rights=sorted(r.value for r in rights(role)))
