"""The role table and the token checks (pure): each role has exactly its rights, on its own tenant only
unless it is a platform-admin; old records keep their meaning; refused tokens say why."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from trainyard_api.roles import ROLES, Right, authorize, check_token, may_grant, rights, token_state, weakest_role_with
from trainyard_contract.records import TenantToken

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
R = Right
EXPECTED = {
    "viewer": {R.READ},
    "submitter": {R.READ, R.SUBMIT, R.CONTROL},
    "tenant-admin": {R.READ, R.SUBMIT, R.CONTROL, R.MANAGE_TOKENS, R.READ_AUDIT, R.READ_TENANT},
    "platform-admin": set(Right),
}


def token(role: str | None = None, *, admin: bool = False, tenant: str = "a", **fields: object) -> TenantToken:
    return TenantToken(tenant=tenant, name="t", role=role, admin=admin, **fields)  # type: ignore[arg-type]  # a str for a Literal field


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("right", list(Right))
def test_each_role_has_exactly_its_rights_on_its_own_tenant(role: str, right: Right) -> None:
    refusal = authorize(token(role), right)
    assert (refusal is None) == (right in EXPECTED[role])
    if refusal is not None:
        assert refusal.status == 403 and refusal.reason == "role"
        assert f"needs {weakest_role_with(right)}" in refusal.message and role in refusal.message


@pytest.mark.parametrize("role", ROLES)
def test_only_a_platform_admin_acts_on_another_tenant(role: str) -> None:
    for right in rights(role):  # type: ignore[arg-type]  # a str for a Literal field
        refusal = authorize(token(role), right, "b")
        if role == "platform-admin":
            assert refusal is None
        else:
            assert refusal is not None and refusal.reason == "tenant" and "'b'" in refusal.message
        assert authorize(token(role), right, "a") is None


def test_roles_are_cumulative() -> None:
    for weaker, stronger in zip(ROLES, ROLES[1:]):
        assert rights(weaker) < rights(stronger)  # type: ignore[arg-type]  # a str for a Literal role


@pytest.mark.parametrize(("admin", "role"), [(True, "platform-admin"), (False, "submitter")])
def test_records_from_before_roles_read_as_they_meant(admin: bool, role: str) -> None:
    assert token(admin=admin).effective_role == role
    assert token("viewer", admin=True).effective_role == "viewer"  # an explicit role wins


@pytest.mark.parametrize(("actor", "grant", "allowed"), [
    ("tenant-admin", "viewer", True), ("tenant-admin", "tenant-admin", True),
    ("tenant-admin", "platform-admin", False), ("submitter", "tenant-admin", False),
    ("platform-admin", "platform-admin", True),
])
def test_nobody_issues_a_role_above_its_own(actor: str, grant: str, allowed: bool) -> None:
    assert (may_grant(token(actor), grant) is None) == allowed  # type: ignore[arg-type]  # a test double


@pytest.mark.parametrize(("fields", "state", "word"), [
    ({}, "active", None),
    ({"expires_at": NOW + timedelta(seconds=1)}, "active", None),
    ({"expires_at": NOW}, "expired", "expired"),
    ({"revoked_at": NOW - timedelta(days=1)}, "revoked", "revoked"),
    ({"revoked_at": NOW, "expires_at": NOW - timedelta(days=1)}, "revoked", "revoked"),
])
def test_a_token_is_refused_once_revoked_or_expired_saying_which(fields: dict, state: str, word: str | None) -> None:
    t = token("viewer", **fields)
    assert token_state(t, NOW) == state
    refusal = check_token(t, NOW, "ask")
    if word is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.status == 401 and refusal.reason == word and word in refusal.message


def test_an_unknown_token_is_refused_with_what_to_do() -> None:
    refusal = check_token(None, NOW, "run make up")
    assert refusal is not None and refusal.status == 401 and refusal.reason == "unknown"
    assert "run make up" in refusal.message
