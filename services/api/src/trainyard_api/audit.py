"""The audit log: every administrative action and every control action on a job, who did it, on what,
when, and how it ended — durable in Redis streams written by the API.

``ty:audit`` holds every entry; ``ty:audit:tenant:{tenant}`` the entries whose target is in that tenant
(what a tenant-admin reads). Both are capped at about ``max_entries`` (XADD MAXLEN ~), newest kept.
An entry's id is its stream id (``<ms>-<seq>``), the cursor of the next page.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainyard_contract.errors import (
    AuthError,
    ConflictError,
    NotFoundError,
    SpecError,
)
from trainyard_contract.events import utcnow
from trainyard_contract.records import TenantToken
from trainyard_runtime.store import Keys, token_id_of

from trainyard_api.schemas import AuditEntry, AuditPage

log = logging.getLogger(__name__)

Outcome = Literal["ok", "denied", "not-found", "conflict", "invalid", "failed"]


def outcome_of(exc: BaseException) -> Outcome:
    """How a request that raised ``exc`` ended, for the log (pure)."""
    from fastapi.exceptions import RequestValidationError

    if isinstance(exc, AuthError):
        return "denied"
    if isinstance(exc, NotFoundError):
        return "not-found"
    if isinstance(exc, ConflictError):
        return "conflict"
    if isinstance(exc, (SpecError, RequestValidationError)):
        return "invalid"
    if isinstance(exc, StarletteHTTPException) and 400 <= exc.status_code < 500:
        return "invalid"  # a body that is not JSON (415), not gzip, too large
    return "failed"


def entry_fields(token: TenantToken, action: str, target: str, tenant: str | None, outcome: Outcome,
                 detail: str | None, at: datetime) -> dict[str, str]:
    """One entry as the stream's flat string fields (pure)."""
    fields = {"at": at.isoformat(), "action": action, "target": target, "tenant": tenant or "", "outcome": outcome,
              "actorTokenId": token.token_id or "", "actorName": token.name, "actorTenant": token.tenant,
              "actorRole": token.effective_role}
    if detail:
        fields["detail"] = detail[:500]
    return fields


def entry_view(entry_id: str, fields: Mapping[str, str]) -> AuditEntry:
    return AuditEntry(
        id=entry_id, at=fields.get("at", ""), action=fields.get("action", ""), target=fields.get("target", ""),
        tenant=fields.get("tenant") or None, outcome=fields.get("outcome", ""),
        actor_token_id=fields.get("actorTokenId") or None, actor_name=fields.get("actorName", ""),
        actor_tenant=fields.get("actorTenant", ""), actor_role=fields.get("actorRole", ""),
        detail=fields.get("detail") or None)


class AuditLog:
    def __init__(self, redis: Redis, *, max_entries: int) -> None:
        self.redis = redis
        self.max_entries = max_entries

    async def record(self, token: TenantToken, action: str, target: str, *, tenant: str | None, outcome: Outcome,
                     detail: str | None = None, digest: str | None = None) -> None:
        """Append one entry (to the tenant's stream too). An entry that cannot be written is logged, not
        raised: the action itself already happened."""
        if token.token_id is None and digest is not None:
            token = token.model_copy(update={"token_id": token_id_of(digest, token)})
        fields = entry_fields(token, action, target, tenant, outcome, detail, utcnow())
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xadd(Keys.audit, fields, maxlen=self.max_entries, approximate=True)  # type: ignore[arg-type]  # str fields
                if tenant:
                    pipe.xadd(Keys.tenant_audit(tenant), fields, maxlen=self.max_entries,  # type: ignore[arg-type]  # str fields
                              approximate=True)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the action happened: its answer must not become a 500
            level = logging.ERROR if isinstance(exc, RedisError) else logging.CRITICAL
            log.log(level, "audit entry not written (%s %s by %s: %s): %r", action, target, token.name, outcome, exc)

    async def page(self, tenant: str | None, *, limit: int, before: str | None) -> AuditPage:
        """Newest first; ``before`` is the ``nextBefore`` of the previous page (exclusive)."""
        key = Keys.tenant_audit(tenant) if tenant else Keys.audit
        if before is not None and all(int(part) == 0 for part in before.split("-")):
            return AuditPage(entries=[])  # nothing is older than the first possible id
        rows: list[tuple[str, dict[str, str]]] = await self.redis.xrevrange(  # type: ignore[assignment]  # decoded
            key, max=f"({before}" if before else "+", min="-", count=limit + 1)
        entries = [entry_view(entry_id, fields) for entry_id, fields in rows[:limit]]
        return AuditPage(entries=entries, next_before=entries[-1].id if len(rows) > limit else None)
