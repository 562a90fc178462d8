"""Draining a node through the API and the CLI, over the real API, broker and Redis: `POST
/v1/admin/nodes/{node}/drain` publishes NodeDrained (by = the admin token's name) through the outbox and
`…/undrain` NodeUndrained; an unknown node is a 404 naming it; tenants get 403; `GET /v1/admin/nodes`
shows the drain; `trainyard admin nodes drain|undrain` do the same."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from typer.testing import CliRunner

from trainyard_api import ApiServer, ApiSettings
from trainyard_cli.main import app as cli
from trainyard_contract import events as ev
from trainyard_contract.records import NodeRecord
from trainyard_runtime.store import Keys
from tests.integration.test_api import event_of, find_record
from tests.support.api import TOKEN_A, TOKEN_ADMIN, client_for, seed


@pytest.fixture
async def api(env: dict) -> AsyncIterator[ApiServer]:
    async with ApiServer(ApiSettings(**env, api_port=0)) as server:
        await seed(server.runtime.store, admin=True)
        yield server


async def test_an_admin_drains_and_undrains_a_node(api: ApiServer, env: dict) -> None:
    store, redis = api.runtime.store, api.runtime.redis
    await store.put_node(NodeRecord(node_id="node-a", host="h-a", devices=[
        ev.DeviceInfo(index=0, type="cpu", memory_bytes=1 << 30)], drained="kernel upgrade"))
    await redis.hset(Keys.node_drain, "node-a", json.dumps({"reason": "kernel upgrade", "by": "olga",
                                                            "at": "2026-01-01T00:00:00+00:00"}))
    await store.put_node(NodeRecord(node_id="node-b", host="h-b", devices=[]))

    async with client_for(api.url, TOKEN_A) as tenant:
        assert (await tenant.post("/v1/admin/nodes/node-b/drain")).status_code == 403
        assert (await tenant.post("/v1/admin/nodes/node-b/undrain")).status_code == 403
    async with client_for(api.url, TOKEN_ADMIN) as admin:
        missing = await admin.post("/v1/admin/nodes/node-x/drain")
        assert missing.status_code == 404 and "node-x" in missing.text, missing.text
        assert (await admin.post("/v1/admin/nodes/node-x/undrain")).status_code == 404
        nodes = {n["nodeId"]: n for n in (await admin.get("/v1/admin/nodes")).json()["nodes"]}
        assert nodes["node-a"]["drained"] and nodes["node-a"]["drain"]["reason"] == "kernel upgrade"
        assert not nodes["node-b"]["drained"] and nodes["node-b"]["drain"] is None
        resp = await admin.post("/v1/admin/nodes/node-b/drain", params={"reason": "new NIC"})
        assert resp.status_code == 202 and resp.json() == {"nodeId": "node-b", "accepted": True, "by": "olga"}
        resp = await admin.post("/v1/admin/nodes/node-a/undrain")
        assert resp.status_code == 202 and resp.json()["by"] == "olga"
    drained = await find_record(env, ev.NODES, lambda r: event_of(r, ev.NodeDrained, node_id="node-b"))
    event = ev.decode_event(ev.NODES, drained.value)
    assert isinstance(event, ev.NodeDrained) and event.by == "olga" and event.reason == "new NIC"
    undrained = await find_record(env, ev.NODES, lambda r: event_of(r, ev.NodeUndrained, node_id="node-a"))
    assert ev.decode_event(ev.NODES, undrained.value).by == "olga"  # type: ignore[attr-defined]  # a NodeUndrained

    # the CLI: `trainyard admin nodes drain|undrain`
    def run(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, ["--api-url", api.url, "--token", TOKEN_ADMIN, "admin", "nodes", *args])
        return result.exit_code, result.output

    code, out = await asyncio.to_thread(run, "drain", "node-a", "--reason", "firmware")
    assert code == 0 and "node node-a drained by olga" in out and "undrain node-a" in out, out
    code, out = await asyncio.to_thread(run, "undrain", "node-b")
    assert code == 0 and "node node-b undrained by olga" in out, out
    code, out = await asyncio.to_thread(run, "drain", "node-x")
    assert code != 0 and "node-x" in out, out
