"""Who may do what: the roles of API tokens and the pure decisions over them (no I/O, clock injected).

    viewer          read its tenant's jobs, checkpoints, artifacts, metrics, goodput, datasets, plans, code, triggers
    submitter       viewer + submit, pause, resume, cancel its tenant's jobs, upload code, create/delete triggers
    tenant-admin    submitter + manage its tenant's tokens, read its tenant's audit log and settings
    platform-admin  everything, for every tenant: tenants, quotas, nodes, every tenant's goodput, the audit log

A token acts for one tenant; only a platform-admin acts on another tenant's resources.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Literal

from trainyard_contract.errors import AuthError
from trainyard_contract.records import TenantToken, TokenRole

ROLES: tuple[TokenRole, ...] = ("viewer", "submitter", "tenant-admin", "platform-admin")
"""Weakest first; each role has every right of the roles before it."""


class ForbiddenError(AuthError):
    """A valid token whose role (or tenant) lacks the right the route needs (HTTP 403)."""


class Right(str, Enum):
    READ = "read"                    # jobs, checkpoints, artifacts, datasets, code metadata, plans, own goodput
    SUBMIT = "submit"                # submit jobs, upload code
    CONTROL = "control"              # pause, resume, cancel jobs
    MANAGE_TOKENS = "manage-tokens"  # create, list, revoke the tenant's tokens
    READ_AUDIT = "read-audit"        # the tenant's audit log
    READ_TENANT = "read-tenant"      # the tenant's settings (quotas, priority)
    MANAGE_TENANTS = "manage-tenants"  # create, change, delete tenants (their quotas and priority)
    NODES = "nodes"                  # /v1/admin/nodes…
    ALL_TENANTS = "all-tenants"      # every tenant's goodput, the whole audit log, every tenant's tokens


_GRANTS: Mapping[TokenRole, frozenset[Right]] = {
    "viewer": frozenset({Right.READ}),
    "submitter": frozenset({Right.READ, Right.SUBMIT, Right.CONTROL}),
    "tenant-admin": frozenset({Right.READ, Right.SUBMIT, Right.CONTROL, Right.MANAGE_TOKENS, Right.READ_AUDIT,
                               Right.READ_TENANT}),
    "platform-admin": frozenset(Right),
}


def rights(role: TokenRole) -> frozenset[Right]:
    return _GRANTS[role]


def weakest_role_with(right: Right) -> TokenRole:
    """The least role that has ``right`` (named in a 403)."""
    return next(role for role in ROLES if right in _GRANTS[role])


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: ``status`` 401 (the token) or 403 (the role, or another tenant)."""

    status: Literal[401, 403]
    reason: Literal["unknown", "revoked", "expired", "role", "tenant"]
    message: str


def token_state(token: TenantToken, now: datetime) -> Literal["active", "revoked", "expired"]:
    if token.revoked_at is not None:
        return "revoked"
    if token.expires_at is not None and token.expires_at <= now:
        return "expired"
    return "active"


def check_token(token: TenantToken | None, now: datetime, how_to: str) -> Refusal | None:
    """None when ``token`` may be used at ``now``; a 401 Refusal saying why not and what to do otherwise."""
    if token is None:
        return Refusal(401, "unknown", f"unknown token: {how_to}")
    state = token_state(token, now)
    if state == "revoked":
        assert token.revoked_at is not None
        return Refusal(401, "revoked", f"token {token.name!r} of tenant {token.tenant!r} was revoked at "
                                       f"{token.revoked_at.isoformat()}: ask an admin of the tenant for a new one")
    if state == "expired":
        assert token.expires_at is not None
        return Refusal(401, "expired", f"token {token.name!r} of tenant {token.tenant!r} expired at "
                                       f"{token.expires_at.isoformat()}: ask an admin of the tenant for a new one")
    return None


def authorize(token: TenantToken, right: Right, tenant: str | None = None) -> Refusal | None:
    """None when ``token`` has ``right`` on ``tenant`` (default: its own); a 403 Refusal naming the role needed."""
    role = token.effective_role
    if right not in _GRANTS[role]:
        need = weakest_role_with(right)
        return Refusal(403, "role", f"token {token.name!r} has role {role}; this needs {need} or above "
                                    f"({right.value})")
    if tenant is not None and tenant != token.tenant and Right.ALL_TENANTS not in _GRANTS[role]:
        return Refusal(403, "tenant", f"token {token.name!r} acts for tenant {token.tenant!r}, not {tenant!r}; "
                                      "only a platform-admin acts on another tenant")
    return None


def may_grant(token: TenantToken, role: TokenRole) -> Refusal | None:
    """A tenant-admin issues tokens up to its own role; only a platform-admin issues platform-admin tokens."""
    if ROLES.index(role) > ROLES.index(token.effective_role):
        return Refusal(403, "role", f"token {token.name!r} has role {token.effective_role} and cannot issue a "
                                    f"{role} token; that needs {role}")
    return None
