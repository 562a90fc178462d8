"""Bearer-token authentication and authorization: a token maps to a tenant and a role (see ``roles.py``);
only its sha256 is stored. Every request reads the token's record again, so revocation and expiry take
effect at the next request on every API process."""

from __future__ import annotations

from datetime import datetime

from trainyard_contract.errors import AuthError
from trainyard_contract.events import utcnow
from trainyard_contract.records import TenantToken, TokenRole
from trainyard_runtime.store import StateStore, hash_token, token_id_of

from trainyard_api.roles import ForbiddenError, Right, authorize, check_token
from trainyard_api.tenants import new_secret

HOW_TO_GET_A_TOKEN = (
    "send `Authorization: Bearer <token>`. The local stack (`make up`) writes a development "
    "token to .trainyard/dev-token; an admin of your tenant issues one with "
    "`trainyard admin tokens create --tenant <tenant>`"
)


NotAdminError = ForbiddenError
"""The name this error had when the only right was admin."""


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer …`` header; AuthError when absent or malformed."""
    if not authorization:
        raise AuthError(f"missing credentials: {HOW_TO_GET_A_TOKEN}")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError(f"malformed Authorization header: {HOW_TO_GET_A_TOKEN}")
    return token.strip()


async def authenticate(store: StateStore, authorization: str | None, now: datetime | None = None) -> TenantToken:
    """The active token behind the request's bearer token (with its id); AuthError (401) saying why not."""
    secret = bearer_token(authorization)
    digest = hash_token(secret)
    token = await store.tenant_for_token(secret)
    if refusal := check_token(token, now or utcnow(), HOW_TO_GET_A_TOKEN):
        raise AuthError(refusal.message)
    assert token is not None
    return token if token.token_id else token.model_copy(update={"token_id": token_id_of(digest, token)})


async def recheck(store: StateStore, authorization: str | None, now: datetime | None = None) -> dict[str, str] | None:
    """None while the request's token is still active (its record read again); else why not, as the data of a
    live stream's ``closed`` event: ``reason`` (the 401's message) and ``kind`` (revoked, expired, unknown)."""
    try:
        secret = bearer_token(authorization)
    except AuthError as exc:
        return {"reason": exc.message, "kind": "unknown"}
    refusal = check_token(await store.tenant_for_token(secret), now or utcnow(), HOW_TO_GET_A_TOKEN)
    return {"reason": refusal.message, "kind": refusal.reason} if refusal else None


def require(token: TenantToken, right: Right, tenant: str | None = None) -> TenantToken:
    """``token`` when it has ``right`` on ``tenant`` (default its own); ForbiddenError naming the role needed."""
    if refusal := authorize(token, right, tenant):
        raise ForbiddenError(refusal.message)
    return token


async def issue_token(store: StateStore, tenant: str, name: str = "default", token: str | None = None,
                      *, admin: bool = False, role: TokenRole | None = None) -> str:
    """Register ``token`` (or a new random one) for ``tenant``; returns the plain token."""
    token = token or new_secret()
    await store.add_token(token, tenant, name, admin=admin, role=role)
    return token
