"""Each route module is one OpenAPI tag's ``APIRouter``, importable and servable alone."""

from __future__ import annotations

from types import ModuleType

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from trainyard_api.context import ApiContext
from trainyard_api.routes import audit, cluster, code, dashboard, datasets, goodput, jobs, lab, nodes, operations, plan
from trainyard_api.routes import registry, tenants, triggers, whoami
from trainyard_api.settings import ApiSettings
from trainyard_runtime.store import StateStore


@pytest.mark.parametrize(("module", "tag"), [
    (jobs, "jobs"), (plan, "planning"), (lab, "lab"), (goodput, "goodput"), (nodes, "admin"), (code, "code"),
    (triggers, "triggers"), (tenants, "admin"), (audit, "admin"), (whoami, "admin"), (registry, "registry"),
    (datasets, "datasets"), (operations, "operations"), (dashboard, "jobs"), (cluster, "admin"),
])
def test_a_route_module_documents_one_tag(module: ModuleType, tag: str) -> None:
    documented = [route for route in module.router.routes if isinstance(route, APIRoute) and route.include_in_schema]
    assert documented and all(route.tags == [tag] for route in documented)


class TokenOnlyRedis:
    async def hget(self, *_: object) -> str:
        return '{"tenant": "tenant-a", "name": "alice", "role": "viewer"}'


async def test_a_router_serves_on_a_bare_app() -> None:
    app = FastAPI()
    app.state.context = ApiContext(ApiSettings(), StateStore(TokenOnlyRedis()), None)  # type: ignore[arg-type]  # a test double
    app.include_router(whoami.router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                 headers={"Authorization": "Bearer t"}) as client:
        resp = await client.get("/v1/whoami")
    assert resp.status_code == 200 and resp.json()["role"] == "viewer", resp.text
