"""Bearer-token authentication: a token maps to a tenant; only its sha256 is stored."""

from __future__ import annotations

import secrets

from trainyard_common.errors import AuthError
from trainyard_common.records import TenantToken
from trainyard_common.store import StateStore

HOW_TO_GET_A_TOKEN = (
    "send `Authorization: Bearer <token>`. The local stack (`make up`) writes a development "
    "token to .trainyard/dev-token; an operator issues one with "
    "`trainyard admin create-token --tenant <tenant>`"
)


class NotAdminError(AuthError):
    """A valid token without admin rights on an admin route (HTTP 403)."""


def require_admin(token: TenantToken) -> TenantToken:
    """``token`` when it is an admin token; NotAdminError otherwise."""
    if not token.admin:
        raise NotAdminError(
            f"token {token.name!r} of tenant {token.tenant!r} is not an admin token; an operator issues one "
            "with `trainyard admin create-token --tenant <tenant> --admin`"
        )
    return token


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer …`` header; AuthError when absent or malformed."""
    if not authorization:
        raise AuthError(f"missing credentials: {HOW_TO_GET_A_TOKEN}")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError(f"malformed Authorization header: {HOW_TO_GET_A_TOKEN}")
    return token.strip()


async def authenticate(store: StateStore, authorization: str | None) -> TenantToken:
    """The tenant behind the request's bearer token; AuthError (401) otherwise."""
    token = bearer_token(authorization)
    tenant = await store.tenant_for_token(token)
    if tenant is None:
        raise AuthError(f"unknown or revoked token: {HOW_TO_GET_A_TOKEN}")
    return tenant


def new_token() -> str:
    """A fresh random API token (shown once; only its hash is kept)."""
    return "ty_" + secrets.token_urlsafe(32)


async def issue_token(store: StateStore, tenant: str, name: str = "default", token: str | None = None,
                      *, admin: bool = False) -> str:
    """Register ``token`` (or a new random one) for ``tenant``; returns the plain token."""
    token = token or new_token()
    await store.add_token(token, tenant, name, admin=admin)
    return token
