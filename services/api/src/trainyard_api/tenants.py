"""Tenants and their tokens, administered through the API: the thin I/O shell behind /v1/admin/tenants….

* A tenant is a ``TenantRecord`` in ``ty:tenants``; a tenant that only has tokens (created before tenants
  were records) is listed too, and becomes a record when a platform admin creates it.
* Its queue settings (cohort, weight, maxPriority, quotas) are the scheduler's ``TenantConfig`` JSON in
  ``ty:sched:tenant-config``, which the scheduler re-reads every reconcile interval (no restart).
* Tokens are ``TenantToken`` records in ``ty:tokens`` under the sha256 of their secret; revoking one stamps
  ``revokedAt`` (kept, so a refused token is told it was revoked). Every request reads the record again:
  revocation and expiry take effect at the next request on every API process.
* :func:`bootstrap_admin` creates the first platform-admin token at start-up and writes it to a file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from redis.exceptions import WatchError

from trainyard_contract.errors import ConflictError, NotFoundError, SpecError
from trainyard_contract.events import TERMINAL_STATES, utcnow
from trainyard_contract.records import DELETED_TENANT_SETTINGS, TenantRecord, TenantToken, is_deleted_tenant
from trainyard_runtime.replication import execute_confirmed, write_confirmed
from trainyard_runtime.store import Keys, StateStore, hash_token, token_id_of

from trainyard_api.bodies import TenantCreateBody, TenantSettingsBody, TokenCreateBody
from trainyard_api.roles import ForbiddenError, may_grant, token_state
from trainyard_api.schemas import IssuedToken, TenantList, TenantSettingsView, TenantView, TokenList, TokenView

log = logging.getLogger(__name__)

BOOTSTRAP_LOCK = Keys.tenants_bootstrap_lock
BOOTSTRAP_TOKEN_NAME = "bootstrap-admin"


# ----------------------------------------------------------------------------- pure decisions


def merged_settings(current: Mapping[str, Any] | None, change: TenantSettingsBody) -> dict[str, Any]:
    """``current`` (the stored TenantConfig JSON, or nothing) with the fields ``change`` sets; a quota set to
    null is removed. The result is what the scheduler's TenantConfig reads (camelCase, no other keys)."""
    base = TenantSettingsView.model_validate(dict(current or {}))
    result = base.model_dump(by_alias=True, mode="json")
    sent = change.model_fields_set
    for field in ("cohort", "weight", "max_priority"):
        if field in sent:
            value = getattr(change, field)
            default = TenantSettingsView.model_fields[field].default
            result[TenantSettingsView.model_fields[field].alias or field] = default if value is None else value
    if "quotas" in sent:
        quotas = dict(result["quotas"])
        for kind, quota in (change.quotas or {}).items():
            if quota is None:
                quotas.pop(kind, None)
            else:
                quotas[kind] = quota.model_dump(by_alias=True, mode="json")
        result["quotas"] = quotas
    return result


def expiry_of(body: TokenCreateBody, now: datetime) -> datetime | None:
    if body.ttl_seconds is not None:
        return now + timedelta(seconds=body.ttl_seconds)
    return body.expires_at


def token_view(digest: str, token: TenantToken, now: datetime) -> TokenView:
    return TokenView(token_id=token_id_of(digest, token), tenant=token.tenant, name=token.name,
                     role=token.effective_role, state=token_state(token, now), created_at=token.created_at,
                     expires_at=token.expires_at, revoked_at=token.revoked_at, created_by=token.created_by)


def new_secret() -> str:
    """A fresh random API token (shown once; only its sha256 is kept)."""
    return "ty_" + secrets.token_urlsafe(32)


# ----------------------------------------------------------------------------- the shell


class TenantService:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.redis = store.redis

    async def _record(self, tenant: str) -> TenantRecord | None:
        raw = await self.redis.hget(Keys.tenants, tenant)
        return TenantRecord.model_validate_json(raw) if raw else None

    async def _settings(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        configs: dict[str, str] = await self.redis.hgetall(Keys.tenant_config)  # type: ignore[assignment]  # decoded
        for tenant, raw in configs.items():
            if is_deleted_tenant(raw):
                continue
            with contextlib.suppress(ValueError):
                value = json.loads(raw)
                if isinstance(value, dict):
                    out[tenant] = value
        return out

    def _view(self, tenant: str, record: TenantRecord | None, settings: Mapping[str, Any] | None,
              tokens: Mapping[str, TenantToken], now: datetime) -> TenantView:
        active = sum(1 for t in tokens.values() if t.tenant == tenant and token_state(t, now) == "active")
        return TenantView(tenant=tenant, created_at=record.created_at if record else None,
                          created_by=record.created_by if record else None,
                          settings=TenantSettingsView.model_validate(dict(settings or {})),
                          settings_stored=settings is not None, active_tokens=active)

    async def list(self) -> TenantList:
        now = utcnow()
        raw_records: dict[str, str] = await self.redis.hgetall(Keys.tenants)  # type: ignore[assignment]  # decoded
        records = {t: TenantRecord.model_validate_json(raw) for t, raw in raw_records.items()}
        tokens, settings = await self.store.token_records(), await self._settings()
        names = sorted(set(records) | {t.tenant for t in tokens.values() if token_state(t, now) == "active"})
        return TenantList(tenants=[self._view(n, records.get(n), settings.get(n), tokens, now) for n in names])

    async def get(self, tenant: str) -> TenantView:
        now = utcnow()
        record, tokens = await self._record(tenant), await self.store.token_records()
        if record is None and not any(t.tenant == tenant and token_state(t, now) == "active" for t in tokens.values()):
            raise NotFoundError(f"no tenant {tenant!r}: create it with POST /v1/admin/tenants "
                                "(`trainyard admin tenants create`)")
        return self._view(tenant, record, (await self._settings()).get(tenant), tokens, now)

    async def create(self, actor: TenantToken, body: TenantCreateBody) -> TenantView:
        record = TenantRecord(tenant=body.tenant, created_by=actor.token_id)
        [created] = await write_confirmed(self.redis, lambda p: p.hsetnx(Keys.tenants, body.tenant, record.dumps()))
        if not created:
            raise ConflictError(f"tenant {body.tenant!r} exists already: change it with PATCH "
                                f"/v1/admin/tenants/{body.tenant}")
        settings_sent = body.model_fields_set - {"tenant"}
        if settings_sent:
            change = TenantSettingsBody.model_validate(body.model_dump(include=settings_sent))
            settings = json.dumps(merged_settings(None, change))
            await write_confirmed(self.redis, lambda p: p.hset(Keys.tenant_config, body.tenant, settings))
        elif is_deleted_tenant(await self.redis.hget(Keys.tenant_config, body.tenant)):
            # created again: the queue file seeds it again
            await write_confirmed(self.redis, lambda p: p.hdel(Keys.tenant_config, body.tenant))
        return await self.get(body.tenant)

    async def update(self, tenant: str, change: TenantSettingsBody) -> TenantView:
        await self.get(tenant)  # 404 for an unknown tenant
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(Keys.tenant_config)
                    raw = await pipe.hget(Keys.tenant_config, tenant)
                    current = json.loads(raw) if raw else None
                    pipe.multi()
                    pipe.hset(Keys.tenant_config, tenant, json.dumps(merged_settings(current, change)))
                    await execute_confirmed(self.redis, pipe)
                    break
                except WatchError:  # changed meanwhile: read it again
                    continue
        return await self.get(tenant)

    async def delete(self, actor: TenantToken, tenant: str) -> TenantView:
        """Revoke every token of ``tenant`` and forget it and its settings; 409 while it has unfinished jobs
        or when it is the caller's own tenant (that would revoke the caller's token)."""
        view = await self.get(tenant)
        if tenant == actor.tenant:
            raise ConflictError(f"tenant {tenant!r} holds your own token; delete it with a platform-admin token "
                                "of another tenant")
        ids: list[str] = await self.redis.zrange(Keys.tenant_jobs(tenant), 0, -1)  # type: ignore[assignment]  # decoded
        live = [j.job_id for j in await self.store.get_jobs(list(ids)) if j.state not in TERMINAL_STATES] if ids else []
        if live:
            raise ConflictError(f"tenant {tenant!r} has {len(live)} unfinished job(s) ({', '.join(live[:5])}): "
                                "cancel them first")
        now = utcnow()
        for digest, token in (await self.store.token_records()).items():
            if token.tenant == tenant and token.revoked_at is None:
                await self._put_token(digest, token.model_copy(update={"revoked_at": now}))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(Keys.tenants, tenant)
            # a tombstone, not a deletion: the scheduler's queue file would seed the tenant's settings again
            pipe.hset(Keys.tenant_config, tenant, DELETED_TENANT_SETTINGS)
            await execute_confirmed(self.redis, pipe)
        return view.model_copy(update={"active_tokens": 0})

    # ------------------------------------------------------------------ tokens
    async def _put_token(self, digest: str, token: TenantToken) -> None:
        """Write a token record; returns once a replica holds it (a revocation is answered only then)."""
        await write_confirmed(self.redis, lambda p: p.hset(Keys.tokens, digest, token.dumps()))

    async def issue(self, actor: TenantToken, tenant: str, body: TokenCreateBody) -> IssuedToken:
        await self.get(tenant)  # 404 for an unknown tenant
        now = utcnow()
        expires = expiry_of(body, now)
        if expires is not None and expires <= now:
            raise SpecError("expiresAt", f"{expires.isoformat()} is in the past; give a later instant")
        secret = new_secret()
        record = await self.store.add_token(secret, tenant, body.name, role=body.role, expires_at=expires,
                                            created_by=actor.token_id)
        view = token_view(hash_token(secret), record, now)
        return IssuedToken(**view.model_dump(), token=secret)

    async def tokens(self, tenant: str) -> TokenList:
        await self.get(tenant)
        now = utcnow()
        found = [token_view(d, t, now) for d, t in (await self.store.token_records()).items() if t.tenant == tenant]
        return TokenList(tokens=sorted(found, key=lambda v: (v.created_at, v.token_id)))

    async def revoke(self, actor: TenantToken, tenant: str, token_id: str) -> TokenView:
        """Stamp ``revokedAt`` (idempotent: a revoked token stays revoked at its first time). A tenant-admin
        cannot revoke a token of a higher role (a platform-admin token in its tenant)."""
        now = utcnow()
        for digest, token in (await self.store.token_records()).items():
            if token.tenant == tenant and token_id_of(digest, token) == token_id:
                if refusal := may_grant(actor, token.effective_role):
                    raise ForbiddenError(refusal.message.replace("issue", "revoke"))
                if token.revoked_at is None:
                    token = token.model_copy(update={"revoked_at": now})
                    await self._put_token(digest, token)
                return token_view(digest, token, now)
        raise NotFoundError(f"no token {token_id!r} in tenant {tenant!r}: "
                            f"GET /v1/admin/tenants/{tenant}/tokens lists them")


# ----------------------------------------------------------------------------- bootstrap


def write_secret_file(path: Path, secret: str) -> None:
    """``secret`` into ``path`` (mode 0600 from its creation, replaced atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secret + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


async def bootstrap_admin(store: StateStore, path: Path, tenant: str) -> str | None:
    """When no active platform-admin token exists, create one in ``tenant`` (and the tenant) and write it to
    ``path``; returns its token id (None when one existed). One API process does it at a time (a lock)."""
    redis = store.redis
    if not await redis.set(BOOTSTRAP_LOCK, "1", nx=True, ex=30):
        return None  # another API process is bootstrapping now
    try:
        now = utcnow()
        tokens = await store.token_records()
        if any(t.effective_role == "platform-admin" and token_state(t, now) == "active" for t in tokens.values()):
            return None
        await redis.hsetnx(Keys.tenants, tenant, TenantRecord(tenant=tenant, created_by="bootstrap").dumps())
        secret = new_secret()
        write_secret_file(path, secret)  # first: a token registered but never written would block the next try
        record = await store.add_token(secret, tenant, BOOTSTRAP_TOKEN_NAME, role="platform-admin",
                                       created_by="bootstrap")
        log.warning("no platform-admin token existed: created %s (tenant %s) and wrote it to %s", record.token_id,
                    tenant, path)
        return record.token_id
    finally:
        await redis.delete(BOOTSTRAP_LOCK)
