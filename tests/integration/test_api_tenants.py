"""Tenants, tokens and roles through the real API process (uvicorn + runtime over the suite's broker and
Redis): each role can do exactly what it should on every kind of route; a revoked or an expired token is
refused everywhere, saying which; one tenant's admin cannot touch another tenant; the audit log records who
did what and how it ended; the first platform-admin token is bootstrapped into a 0600 file; tokens from
before roles keep working."""

from __future__ import annotations

import hashlib
import stat
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from trainyard_api import ApiServer, ApiSettings
from trainyard_runtime.controlrecords import (
    CONTROL_REQUEST_TTL_S,
    MAX_CONTROL_REQUESTS,
    parse_control_request,
    stage_control_record,
)
from trainyard_contract.events import JobControlRequested, utcnow
from trainyard_contract.records import is_deleted_tenant
from trainyard_runtime.store import Keys
from tests.support.api import client_for, seed, spec_with

JUNK = b"not a gzip archive"
JUNK_ID = "sha256:" + hashlib.sha256(JUNK).hexdigest()
NO_JOB = "job-000000000000"
NO_TOKEN = "tok_000000000000"

# (role that may, method, path, json body) -- the role and every stronger one may, every weaker one gets 403
ROUTES: list[tuple[str, str, str, Any]] = [
    ("viewer", "GET", "/v1/training-jobs", None),
    ("viewer", "GET", f"/v1/training-jobs/{NO_JOB}", None),
    ("viewer", "GET", f"/v1/training-jobs/{NO_JOB}/checkpoints", None),
    ("viewer", "GET", f"/v1/registry/artifacts?jobId={NO_JOB}", None),
    ("viewer", "GET", "/v1/datasets", None),
    ("viewer", "GET", "/v1/datasets/tinycorpus@v1", None),
    ("viewer", "GET", "/v1/goodput", None),
    ("viewer", "GET", "/v1/goodput/history", None),
    ("viewer", "GET", f"/v1/code/{JUNK_ID}", None),
    ("submitter", "POST", "/v1/training-jobs", spec_with(name="table")),
    ("submitter", "POST", f"/v1/training-jobs/{NO_JOB}/pause", None),
    ("submitter", "POST", f"/v1/training-jobs/{NO_JOB}/resume", None),
    ("submitter", "POST", f"/v1/training-jobs/{NO_JOB}/cancel", None),
    ("submitter", "PUT", f"/v1/code/{JUNK_ID}", JUNK),
    ("submitter", "POST", "/v1/datasets", {"name": "made-in-table", "version": "v1", "sha256": "0" * 64}),
    ("tenant-admin", "GET", "/v1/admin/tenants/tenant-a", None),
    ("tenant-admin", "GET", "/v1/admin/tenants/tenant-a/tokens", None),
    ("tenant-admin", "POST", "/v1/admin/tenants/tenant-a/tokens", {"name": "made-in-table", "role": "viewer"}),
    ("tenant-admin", "DELETE", f"/v1/admin/tenants/tenant-a/tokens/{NO_TOKEN}", None),
    ("tenant-admin", "GET", "/v1/admin/audit", None),
    ("platform-admin", "GET", "/v1/admin/tenants", None),
    ("platform-admin", "POST", "/v1/admin/tenants", {"tenant": "made-in-table"}),
    ("platform-admin", "PATCH", "/v1/admin/tenants/tenant-a", {"weight": 2}),
    ("platform-admin", "DELETE", "/v1/admin/tenants/no-such-tenant", None),
    ("platform-admin", "GET", "/v1/admin/nodes", None),
    ("platform-admin", "POST", "/v1/admin/nodes/node-x/drain", None),
    ("platform-admin", "GET", "/v1/goodput?all=true", None),
    ("platform-admin", "GET", "/v1/goodput/history?all=true", None),
    ("platform-admin", "GET", "/v1/admin/audit?tenant=tenant-b", None),
]
ROLES = ("viewer", "submitter", "tenant-admin", "platform-admin")


async def call(client: Any, method: str, path: str, body: Any) -> Any:
    if isinstance(body, bytes):
        return await client.request(method, path, content=body, headers={"Content-Type": "application/gzip"})
    return await client.request(method, path, json=body)


@pytest.fixture
async def api(env: dict, tmp_path: Path) -> AsyncIterator[ApiServer]:
    settings = ApiSettings(**env, api_port=0, api_bootstrap_admin_token_file=tmp_path / "admin-token")
    async with ApiServer(settings) as server:
        await seed(server.runtime.store)
        yield server


@pytest.fixture
async def tokens(api: ApiServer, tmp_path: Path) -> dict[str, str]:
    """role → secret: tenant-a's viewer, submitter and tenant-admin (issued through the API), the bootstrap
    platform-admin, and tenant-b's tenant-admin as ``b-admin``."""
    admin = (tmp_path / "admin-token").read_text().strip()
    out = {"platform-admin": admin}
    async with client_for(api.url, admin) as client:
        for tenant in ("tenant-a", "tenant-b"):
            resp = await client.post("/v1/admin/tenants", json={"tenant": tenant, "quotas": {"cpu": {"guaranteed": 4}}})
            assert resp.status_code == 201, resp.text
        for role in ROLES[:3]:
            resp = await client.post("/v1/admin/tenants/tenant-a/tokens", json={"name": f"a-{role}", "role": role})
            assert resp.status_code == 201 and resp.json()["role"] == role, resp.text
            out[role] = resp.json()["token"]
        resp = await client.post("/v1/admin/tenants/tenant-b/tokens", json={"name": "b-admin", "role": "tenant-admin"})
        out["b-admin"] = resp.json()["token"]
    return out


@pytest.mark.parametrize("role", ROLES)
async def test_each_role_can_do_exactly_what_it_should(api: ApiServer, tokens: dict[str, str], role: str) -> None:
    async with client_for(api.url, tokens[role]) as client:
        for needed, method, path, body in ROUTES:
            resp = await call(client, method, path, body)
            if ROLES.index(role) >= ROLES.index(needed):
                assert resp.status_code not in (401, 403), (role, method, path, resp.status_code, resp.text)
                assert resp.status_code < 500, (method, path, resp.text)
            else:
                assert resp.status_code == 403, (role, method, path, resp.status_code, resp.text)
                detail = resp.json()["detail"]  # the caller's role and a stronger one it needs, or the tenant's
                assert (f"role {role}" in detail and any(f"needs {r}" in detail for r in ROLES[ROLES.index(role) + 1:])
                        or "only a platform-admin acts on another tenant" in detail), detail


async def test_a_revoked_or_expired_token_is_refused_on_every_kind_of_route(api: ApiServer,
                                                                             tokens: dict[str, str]) -> None:
    async with client_for(api.url, tokens["platform-admin"]) as admin:
        soon = await admin.post("/v1/admin/tenants/tenant-a/tokens", json={"name": "short", "role": "platform-admin",
                                                                          "ttlSeconds": 1})
        revoked = await admin.post("/v1/admin/tenants/tenant-a/tokens", json={"name": "gone", "role": "platform-admin"})
        assert soon.status_code == revoked.status_code == 201
        resp = await admin.delete(f"/v1/admin/tenants/tenant-a/tokens/{revoked.json()['tokenId']}")
        assert resp.status_code == 200 and resp.json()["state"] == "revoked"
    # expiry is the record's own instant: move it into the past rather than waiting for it
    store = api.runtime.store
    digest = hashlib.sha256(soon.json()["token"].encode()).hexdigest()
    record = (await store.token_records())[digest]
    await api.runtime.redis.hset(Keys.tokens, digest,
                                 record.model_copy(update={"expires_at": utcnow() - timedelta(seconds=1)}).dumps())
    for secret, word in ((revoked.json()["token"], "revoked"), (soon.json()["token"], "expired")):
        async with client_for(api.url, secret) as client:
            for _, method, path, body in ROUTES:
                resp = await call(client, method, path, body)
                assert resp.status_code == 401, (word, method, path, resp.status_code, resp.text)
                assert word in resp.json()["detail"] and "new one" in resp.json()["detail"], resp.text
    async with client_for(api.url, "never-issued") as client:
        resp = await client.get("/v1/training-jobs")
        assert resp.status_code == 401 and "unknown token" in resp.json()["detail"]


async def test_revocation_is_effective_at_once_at_every_api_process(api: ApiServer, tokens: dict[str, str],
                                                                    env: dict) -> None:
    async with ApiServer(ApiSettings(**env, api_port=0)) as other:
        async with client_for(other.url, tokens["viewer"]) as client:
            assert (await client.get("/v1/training-jobs")).status_code == 200
            async with client_for(api.url, tokens["tenant-admin"]) as admin:
                listed = (await admin.get("/v1/admin/tenants/tenant-a/tokens")).json()["tokens"]
                viewer = next(t for t in listed if t["name"] == "a-viewer")
                assert "token" not in viewer and viewer["state"] == "active"
                assert (await admin.delete(f"/v1/admin/tenants/tenant-a/tokens/{viewer['tokenId']}")).status_code == 200
            resp = await client.get("/v1/training-jobs")
            assert resp.status_code == 401 and "revoked" in resp.json()["detail"]


async def test_one_tenants_admin_cannot_touch_another_tenant(api: ApiServer, tokens: dict[str, str]) -> None:
    async with client_for(api.url, tokens["platform-admin"]) as admin:
        a_tokens = (await admin.get("/v1/admin/tenants/tenant-a/tokens")).json()["tokens"]
    a_token_id = a_tokens[0]["tokenId"]
    async with client_for(api.url, tokens["b-admin"]) as b_admin:
        for method, path, body in [
            ("GET", "/v1/admin/tenants/tenant-a", None),
            ("GET", "/v1/admin/tenants/tenant-a/tokens", None),
            ("POST", "/v1/admin/tenants/tenant-a/tokens", {"name": "intruder", "role": "viewer"}),
            ("DELETE", f"/v1/admin/tenants/tenant-a/tokens/{a_token_id}", None),
            ("GET", "/v1/admin/audit?tenant=tenant-a", None),
            ("PATCH", "/v1/admin/tenants/tenant-b", {"weight": 5}),  # not even its own quotas
            ("POST", "/v1/admin/tenants/tenant-b/tokens", {"name": "escalate", "role": "platform-admin"}),
        ]:
            resp = await call(b_admin, method, path, body)
            assert resp.status_code == 403, (method, path, resp.status_code, resp.text)
        assert (await b_admin.get("/v1/admin/tenants/tenant-b")).status_code == 200
    async with client_for(api.url, tokens["platform-admin"]) as admin:
        still = (await admin.get("/v1/admin/tenants/tenant-a/tokens")).json()["tokens"]
        assert [t["state"] for t in still] == [t["state"] for t in a_tokens]
        assert "intruder" not in {t["name"] for t in still}


async def test_tenants_settings_round_trip_and_bad_input_names_the_field(api: ApiServer,
                                                                         tokens: dict[str, str]) -> None:
    async with client_for(api.url, tokens["platform-admin"]) as admin:
        resp = await admin.patch("/v1/admin/tenants/tenant-a", json={
            "quotas": {"cpu": None, "h100-80gb": {"guaranteed": 8, "borrowLimit": 4}}, "maxPriority": 100})
        assert resp.status_code == 200, resp.text
        settings = resp.json()["settings"]
        assert settings["quotas"] == {"h100-80gb": {"guaranteed": 8, "borrowLimit": 4}}
        assert settings["maxPriority"] == 100 and settings["weight"] == 1.0
        stored = await api.runtime.redis.hget(Keys.tenant_config, "tenant-a")
        assert '"h100-80gb"' in stored
        for method, path, body, field in [
            ("PATCH", "/v1/admin/tenants/tenant-a", {"weight": -1}, "weight"),
            ("PATCH", "/v1/admin/tenants/tenant-a", {"quotas": {"cpu": {"guaranteed": "8"}}}, "quotas.cpu.guaranteed"),
            ("POST", "/v1/admin/tenants", {"tenant": "Not A Name"}, "tenant"),
            ("POST", "/v1/admin/tenants/tenant-a/tokens", {"name": "x", "role": "root"}, "role"),
            ("POST", "/v1/admin/tenants/tenant-a/tokens", {"name": "x", "ttlSeconds": 5,
                                                           "expiresAt": "2030-01-01T00:00:00Z"}, "ttlSeconds"),
            ("POST", "/v1/admin/tenants/tenant-a/tokens", {"name": "x", "expiresAt": "2001-01-01T00:00:00Z"},
             "expiresAt"),
        ]:
            resp = await call(admin, method, path, body)
            assert resp.status_code == 422, (path, body, resp.text)
            fields = [d["field"] for d in resp.json()["detail"]]
            assert any(f.endswith(field) for f in fields), (body, fields)
        assert (await admin.post("/v1/admin/tenants", json={"tenant": "tenant-a"})).status_code == 409
        assert (await admin.get("/v1/admin/tenants/nobody")).status_code == 404
        # deleting a tenant revokes its tokens; refused while it has unfinished jobs
        assert (await admin.post("/v1/admin/tenants", json={"tenant": "short-lived"})).status_code == 201
        made = (await admin.post("/v1/admin/tenants/short-lived/tokens", json={"name": "s"})).json()
        async with client_for(api.url, made["token"]) as member:
            job = (await member.post("/v1/training-jobs", json=spec_with())).json()["jobId"]
            refused = await admin.delete("/v1/admin/tenants/short-lived")
            assert refused.status_code == 409 and job in refused.text
            assert (await member.post(f"/v1/training-jobs/{job}/cancel")).status_code == 202
            await _mark_cancelled(api, job)
            assert (await admin.delete("/v1/admin/tenants/short-lived")).status_code == 200
            resp = await member.get("/v1/training-jobs")
            assert resp.status_code == 401 and "revoked" in resp.json()["detail"]
        listed = {t["tenant"] for t in (await admin.get("/v1/admin/tenants")).json()["tenants"]}
        assert {"tenant-a", "tenant-b", "platform"} <= listed and "short-lived" not in listed
        assert (await admin.get("/v1/admin/tenants/short-lived")).status_code == 404
        # the scheduler's queue file must not bring a deleted tenant's settings back: a tombstone stays
        assert is_deleted_tenant(await api.runtime.redis.hget(Keys.tenant_config, "short-lived"))
        assert (await admin.post("/v1/admin/tenants", json={"tenant": "short-lived"})).status_code == 201
        assert not is_deleted_tenant(await api.runtime.redis.hget(Keys.tenant_config, "short-lived"))


async def _mark_cancelled(api: ApiServer, job_id: str) -> None:
    """What the scheduler does on a recorded JobControlRequested(cancel) (no scheduler runs here)."""
    job = await api.runtime.store.get_job(job_id)
    assert job is not None
    await api.runtime.redis.set(Keys.job(job_id), job.model_copy(update={"state": "cancelled"}).dumps())


async def test_the_audit_log_records_who_did_what_and_how_it_ended(api: ApiServer, tokens: dict[str, str]) -> None:
    async with client_for(api.url, tokens["submitter"]) as submitter:
        job = (await submitter.post("/v1/training-jobs", json=spec_with())).json()["jobId"]
        assert (await submitter.post(f"/v1/training-jobs/{job}/pause")).status_code == 202
        assert (await submitter.post(f"/v1/training-jobs/{NO_JOB}/cancel")).status_code == 404
    async with client_for(api.url, tokens["viewer"]) as viewer:
        assert (await viewer.post(f"/v1/training-jobs/{job}/cancel")).status_code == 403
    async with client_for(api.url, tokens["b-admin"]) as b_admin:
        assert (await b_admin.post("/v1/admin/tenants/tenant-b/tokens", json={"name": "b-ci"})).status_code == 201
        b_log = (await b_admin.get("/v1/admin/audit")).json()["entries"]
    assert b_log and {e["tenant"] for e in b_log} == {"tenant-b"}
    async with client_for(api.url, tokens["platform-admin"]) as admin:
        entries = (await admin.get("/v1/admin/audit", params={"limit": 1000})).json()["entries"]
        first = (await admin.get("/v1/admin/audit", params={"limit": 2})).json()
        second = (await admin.get("/v1/admin/audit", params={"limit": 2, "before": first["nextBefore"]})).json()
        # a cursor is a stream id, two unsigned 64-bit numbers: the largest reads from the newest entry, one past
        # it is a 422 naming the field (it was a Redis error, a 500)
        newest = (await admin.get("/v1/admin/audit", params={"limit": 1, "before": f"{2**64 - 1}-{2**64 - 1}"}))
        assert newest.status_code == 200 and newest.json()["entries"][0]["id"] == entries[0]["id"]
        for cursor in (f"{2**64}-0", f"0-{2**64}", "99999999999999999999-0"):
            past = await admin.get("/v1/admin/audit", params={"before": cursor})
            assert past.status_code == 422 and [p["field"] for p in past.json()["detail"]] == ["query.before"], cursor
            assert str(2**64 - 1) in past.json()["detail"][0]["message"]
    seen = {(e["action"], e["target"], e["outcome"], e["actorName"]) for e in entries}
    assert ("job.submit", f"job/{job}", "ok", "a-submitter") in seen
    assert ("job.pause", f"job/{job}", "ok", "a-submitter") in seen
    # the pause is recorded for the scheduler (which acts on no JobControlRequested without its record); the
    # refused requests (not found, denied) recorded nothing
    (recorded,) = [parse_control_request(raw) for raw in
                   (await api.runtime.redis.hgetall(Keys.control_requests(job))).values()]
    assert recorded is not None and (recorded.job_id, recorded.tenant, recorded.action, recorded.requested_by) == \
        (job, "tenant-a", "pause", "a-submitter")
    assert not await api.runtime.redis.exists(Keys.control_requests(NO_JOB))
    assert ("job.cancel", f"job/{NO_JOB}", "not-found", "a-submitter") in seen
    assert ("job.cancel", f"job/{job}", "denied", "a-viewer") in seen
    assert ("tenant.create", "tenant/tenant-a", "ok", "bootstrap-admin") in seen
    assert any(a == "token.create" and t.startswith("tenant/tenant-b/token/tok_") and who == "b-admin"
               for a, t, _, who in seen)
    submit = next(e for e in entries if e["action"] == "job.submit")
    assert submit["actorRole"] == "submitter" and submit["actorTenant"] == "tenant-a"
    assert submit["actorTokenId"].startswith("tok_") and submit["at"]
    assert [e["id"] for e in first["entries"] + second["entries"]] == [e["id"] for e in entries[:4]]


async def test_the_bootstrap_token_file_is_written_once_with_mode_0600(api: ApiServer, env: dict,
                                                                        tmp_path: Path) -> None:
    path = tmp_path / "admin-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_text().strip()
    async with client_for(api.url, secret) as admin:
        assert (await admin.get("/v1/admin/tenants")).status_code == 200
        tokens = (await admin.get("/v1/admin/tenants/platform/tokens")).json()["tokens"]
        assert [(t["name"], t["role"]) for t in tokens] == [("bootstrap-admin", "platform-admin")]
    async with ApiServer(ApiSettings(**env, api_port=0, api_bootstrap_admin_token_file=path)):
        pass  # an admin exists: a restart leaves the file alone
    assert path.read_text().strip() == secret


async def test_tokens_from_before_roles_keep_their_meaning(env: dict) -> None:
    async with ApiServer(ApiSettings(**env, api_port=0)) as api:
        await seed(api.runtime.store, admin=True)  # tenant-a's plain token, and ops' admin=True token
        async with client_for(api.url, "token-tenant-a") as plain:
            assert (await plain.post("/v1/training-jobs", json=spec_with())).status_code == 202
            resp = await plain.get("/v1/admin/tenants/tenant-a/tokens")
            assert resp.status_code == 403 and "submitter" in resp.json()["detail"]
        async with client_for(api.url, "token-admin") as admin:
            listed = (await admin.get("/v1/admin/tenants")).json()["tenants"]
            assert {"tenant-a", "tenant-b", "ops"} <= {t["tenant"] for t in listed}
            roles = {t["name"]: t["role"] for t in (await admin.get("/v1/admin/tenants/ops/tokens")).json()["tokens"]}
            assert roles == {"olga": "platform-admin"}


async def test_whoami_says_each_tokens_tenant_role_and_rights_and_refuses_an_unknown_one(
        api: ApiServer, tokens: dict[str, str]) -> None:
    for role in ROLES:
        async with client_for(api.url, tokens[role]) as client:
            resp = await client.get("/v1/whoami")
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["role"] == role
        assert body["tenant"] == ("tenant-a" if role != "platform-admin" else body["tenant"])
        assert ("nodes" in body["rights"]) == (role == "platform-admin")
        assert ("submit" in body["rights"]) == (role != "viewer")
        assert tokens[role] not in resp.text  # never the secret
    async with client_for(api.url, "not-a-token") as client:
        resp = await client.get("/v1/whoami")
    assert resp.status_code == 401 and "token" in resp.json()["detail"]


async def test_a_job_takes_a_bounded_number_of_control_requests(api: ApiServer, tokens: dict[str, str]) -> None:
    """Each accepted request is recorded for the scheduler; records older than their TTL are pruned at the next
    request, and at MAX_CONTROL_REQUESTS live ones the API refuses the next (409) rather than drop one."""
    redis = api.runtime.redis
    async with client_for(api.url, tokens["submitter"]) as submitter:
        job = (await submitter.post("/v1/training-jobs", json=spec_with())).json()["jobId"]
        now = utcnow()
        old = now - timedelta(seconds=CONTROL_REQUEST_TTL_S + 60)
        async with redis.pipeline(transaction=True) as pipe:
            for i in range(MAX_CONTROL_REQUESTS):
                event = JobControlRequested(job_id=job, tenant="tenant-a", action="pause", reason=str(i))
                stage_control_record(pipe, event, requested_by="a-submitter", at=old if i == 0 else now)
            await pipe.execute()
        assert (await submitter.post(f"/v1/training-jobs/{job}/pause")).status_code == 202  # the old one pruned
        assert await redis.hlen(Keys.control_requests(job)) == MAX_CONTROL_REQUESTS
        refused = await submitter.post(f"/v1/training-jobs/{job}/pause")
        assert refused.status_code == 409 and "control requests" in refused.json()["detail"]
        assert await redis.hlen(Keys.control_requests(job)) == MAX_CONTROL_REQUESTS
        assert 0 < await redis.ttl(Keys.control_requests(job)) <= CONTROL_REQUEST_TTL_S
