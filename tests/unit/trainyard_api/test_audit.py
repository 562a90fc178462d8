"""Audit entries (pure): how a request ended, and the fields an entry carries."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from trainyard_api.audit import entry_fields, entry_view, outcome_of
from trainyard_api.roles import ForbiddenError
from trainyard_contract.errors import ConflictError, NotFoundError, SpecError, StateStoreError
from trainyard_contract.records import TenantToken


@pytest.mark.parametrize(("exc", "outcome"), [
    (ForbiddenError("no"), "denied"), (NotFoundError("no job"), "not-found"), (ConflictError("done"), "conflict"),
    (SpecError("weight", "bad"), "invalid"), (RequestValidationError([]), "invalid"),
    (HTTPException(415, "not json"), "invalid"), (StateStoreError("down"), "failed"), (RuntimeError("bug"), "failed"),
])
def test_how_a_refused_or_failed_request_ended(exc: BaseException, outcome: str) -> None:
    assert outcome_of(exc) == outcome


def test_an_entry_names_the_actor_the_action_the_target_and_when() -> None:
    at = datetime(2026, 12, 1, tzinfo=timezone.utc)
    actor = TenantToken(tenant="a", name="ann", role="tenant-admin", token_id="tok_0123456789ab")
    fields = entry_fields(actor, "token.revoke", "tenant/a/token/tok_x", "a", "ok", "x" * 600, at)
    assert fields["actorTokenId"] == "tok_0123456789ab" and fields["actorRole"] == "tenant-admin"
    assert fields["at"] == at.isoformat() and len(fields["detail"]) == 500
    view = entry_view("1-0", fields)
    assert (view.action, view.target, view.tenant, view.outcome, view.actor_name) == (
        "token.revoke", "tenant/a/token/tok_x", "a", "ok", "ann")
    legacy = entry_fields(TenantToken(tenant="ops", name="olga", admin=True), "node.drain", "node/n", None, "ok",
                          None, at)
    assert legacy["actorRole"] == "platform-admin" and legacy["tenant"] == "" and "detail" not in legacy
