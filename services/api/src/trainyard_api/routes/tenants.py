"""The ``admin`` routes over tenants and their tokens: create, read, change and delete tenants (their
quotas and priority); issue, list and revoke their tokens; read and set their tracking targets."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from trainyard_contract.records import TenantToken
from trainyard_contract.tracking import TenantTracking

from trainyard_api.auth import ForbiddenError
from trainyard_api.bodies import TENANT_PATTERN, TenantCreateBody, TenantSettingsBody, TokenCreateBody
from trainyard_api.deps import Ctx, may, strict_body
from trainyard_api.http_errors import ADMIN_ERRORS, NOT_JSON, error, invalid
from trainyard_api.roles import Right, may_grant
from trainyard_api.schemas import IssuedToken, TenantList, TenantView, TokenList, TokenView
from trainyard_api.tracking import TenantTrackingBody, TenantTrackingService

_TENANT_CREATE = may(Right.MANAGE_TENANTS, "tenant.create")
_TENANT_UPDATE = may(Right.MANAGE_TENANTS, "tenant.update")
_TOKEN_CREATE = may(Right.MANAGE_TOKENS, "token.create")
_TRACKING_SET = may(Right.MANAGE_TENANTS, "tenant.tracking")
TenantCreator = Annotated[TenantToken, _TENANT_CREATE]
TenantUpdater = Annotated[TenantToken, _TENANT_UPDATE]
TenantDeleter = Annotated[TenantToken, may(Right.MANAGE_TENANTS, "tenant.delete")]
TenantManager = Annotated[TenantToken, may(Right.MANAGE_TENANTS)]
TenantReader = Annotated[TenantToken, may(Right.READ_TENANT)]
TrackingSetter = Annotated[TenantToken, _TRACKING_SET]
TokenCreator = Annotated[TenantToken, _TOKEN_CREATE]
TokenRevoker = Annotated[TenantToken, may(Right.MANAGE_TOKENS, "token.revoke")]
TokenManager = Annotated[TenantToken, may(Right.MANAGE_TOKENS)]
TenantName = Annotated[str, Path(pattern=TENANT_PATTERN, max_length=63, description="the tenant",
                                 examples=["research"])]
TokenId = Annotated[str, Path(pattern=r"^tok_[0-9a-f]{12}$", description="the token's id (never its secret)",
                              examples=["tok_3f2a9c1b7e4d"])]
_NO_TENANT = error(404, "no such tenant")
_ERRORS = {**ADMIN_ERRORS, **invalid()}

router = APIRouter()


@router.post("/v1/admin/tenants", status_code=201, response_model=TenantView, tags=["admin"],
             summary="Create a tenant", dependencies=[strict_body(TenantCreateBody, _TENANT_CREATE)],
             responses={**_ERRORS, **NOT_JSON, **error(409, "the tenant exists already")})
async def create_tenant(ctx: Ctx, admin: TenantCreator, request: Request,
                        body: TenantCreateBody) -> TenantView:
    """Create a tenant with optional queue settings (quotas per device type, fair-share weight, cohort,
    maxPriority); then issue its tokens with `POST /v1/admin/tenants/{tenant}/tokens`. The scheduler
    applies the settings at its next reconcile, without a restart. Platform-admin."""
    request.state.audit_target, request.state.audit_tenant = f"tenant/{body.tenant}", body.tenant
    return await ctx.tenants.create(admin, body)


@router.get("/v1/admin/tenants", response_model=TenantList, tags=["admin"], summary="List tenants",
            responses=ADMIN_ERRORS)
async def list_tenants(ctx: Ctx, _: TenantManager) -> TenantList:
    """Every tenant created through the API, and every tenant that has active tokens (created before
    tenants were records: `createdAt` null), with its settings and number of active tokens. Platform-admin."""
    return await ctx.tenants.list()


@router.get("/v1/admin/tenants/{tenant}", response_model=TenantView, tags=["admin"], summary="Get a tenant",
            responses={**_ERRORS, **_NO_TENANT})
async def get_tenant(ctx: Ctx, _: TenantReader, tenant: TenantName) -> TenantView:
    """The tenant's queue settings as the scheduler applies them. Platform-admin, or its own tenant-admin."""
    return await ctx.tenants.get(tenant)


@router.patch("/v1/admin/tenants/{tenant}", response_model=TenantView, tags=["admin"],
              summary="Change a tenant's quotas and priority",
              dependencies=[strict_body(TenantSettingsBody, _TENANT_UPDATE)],
              responses={**_ERRORS, **NOT_JSON, **_NO_TENANT})
async def update_tenant(ctx: Ctx, _: TenantUpdater, request: Request, tenant: TenantName,
                        body: TenantSettingsBody) -> TenantView:
    """Change only the fields sent: `quotas` merges by device type (a quota set to `null` is removed),
    `maxPriority` caps its jobs' priority (and so the priority class they reach; `null` removes the cap).
    The scheduler applies it at its next reconcile, without a restart. Platform-admin."""
    request.state.audit_detail = body.model_dump_json(by_alias=True, exclude_unset=True)
    return await ctx.tenants.update(tenant, body)


@router.delete("/v1/admin/tenants/{tenant}", response_model=TenantView, tags=["admin"], summary="Delete a tenant",
               responses={**_ERRORS, **_NO_TENANT,
                          **error(409, "the tenant has unfinished jobs, or holds the caller's own token")})
async def delete_tenant(ctx: Ctx, admin: TenantDeleter, tenant: TenantName) -> TenantView:
    """Revoke every token of the tenant and forget it and its settings (its finished jobs and artifacts
    stay). Refused while it has unfinished jobs: cancel them first. Platform-admin."""
    return await ctx.tenants.delete(admin, tenant)


@router.post("/v1/admin/tenants/{tenant}/tokens", status_code=201, response_model=IssuedToken, tags=["admin"],
             summary="Issue a token", dependencies=[strict_body(TokenCreateBody, _TOKEN_CREATE)],
             responses={**_ERRORS, **NOT_JSON, **_NO_TENANT})
async def create_token(ctx: Ctx, admin: TokenCreator, request: Request,
                       tenant: TenantName, body: TokenCreateBody) -> IssuedToken:
    """A new token of the tenant with a role and an optional expiry (`expiresAt` or `ttlSeconds`). The
    answer carries the secret (`token`) once; only its sha256 is stored. A tenant-admin issues tokens of
    its own tenant up to tenant-admin; a platform-admin any."""
    if refusal := may_grant(admin, body.role):
        raise ForbiddenError(refusal.message)
    issued = await ctx.tenants.issue(admin, tenant, body)
    request.state.audit_target = f"tenant/{tenant}/token/{issued.token_id}"
    request.state.audit_detail = f"role {issued.role}" + (
        f", expires {issued.expires_at.isoformat()}" if issued.expires_at else "")
    return issued


@router.get("/v1/admin/tenants/{tenant}/tokens", response_model=TokenList, tags=["admin"],
            summary="List a tenant's tokens", responses={**_ERRORS, **_NO_TENANT})
async def list_tokens(ctx: Ctx, _: TokenManager, tenant: TenantName) -> TokenList:
    """Every token of the tenant, without its secret: id, name, role, state (active, revoked,
    expired), when created, expiring, revoked, and by whom."""
    return await ctx.tenants.tokens(tenant)


@router.delete("/v1/admin/tenants/{tenant}/tokens/{token_id}", response_model=TokenView, tags=["admin"],
               summary="Revoke a token", responses={**_ERRORS, **error(404, "no such token in the tenant")})
async def revoke_token(ctx: Ctx, admin: TokenRevoker, tenant: TenantName, token_id: TokenId) -> TokenView:
    """Refused (401, "revoked") from the next request on, at every API process. Revoking a revoked
    token changes nothing."""
    return await ctx.tenants.revoke(admin, tenant, token_id)


@router.get("/v1/admin/tenants/{tenant}/tracking", response_model=TenantTracking, tags=["admin"],
            summary="Get a tenant's tracking targets", responses={**_ERRORS, **_NO_TENANT})
async def get_tracking(ctx: Ctx, _: TenantReader, tenant: TenantName) -> TenantTracking:
    """The MLflow server the tenant's jobs' curves go to and whether TensorBoard files are written
    (docs/tracking.md). Platform-admin, or its own tenant-admin."""
    await ctx.tenants.get(tenant)  # 404 for an unknown tenant
    return await TenantTrackingService(ctx.store).get(tenant)


@router.put("/v1/admin/tenants/{tenant}/tracking", response_model=TenantTracking, tags=["admin"],
            summary="Set a tenant's tracking targets", dependencies=[strict_body(TenantTrackingBody, _TRACKING_SET)],
            responses={**_ERRORS, **NOT_JSON, **_NO_TENANT})
async def put_tracking(ctx: Ctx, admin: TrackingSetter, request: Request, tenant: TenantName,
                       body: TenantTrackingBody) -> TenantTracking:
    """Replace the tenant's tracking targets: `mlflowUri` (http(s), no credentials, not a link-local or
    cloud-metadata address; null: no MLflow export) and `tensorboard`. The telemetry service applies them at
    its next pass; a job opts out with `spec.tracking`. Platform-admin only: the URI is egress from the
    control plane, which no tenant chooses."""
    await ctx.tenants.get(tenant)  # 404 for an unknown tenant
    request.state.audit_detail = body.model_dump_json(by_alias=True)
    return await TenantTrackingService(ctx.store).put(admin, tenant, body)
