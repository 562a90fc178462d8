"""`trainyard admin tenants set-tracking` / `tracking` against a real API: a platform-admin sets a tenant's MLflow
server and TensorBoard switch, a refused URI is the API's one-line 422, a tenant's token is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from typer.testing import CliRunner

from trainyard_api import ApiServer, ApiSettings
from trainyard_cli.main import app

ADMIN, TENANT = "cli-tracking-admin", "cli-tracking-tenant"


@pytest.fixture
async def server(env: dict) -> AsyncIterator[ApiServer]:
    async with ApiServer(ApiSettings(**env, api_port=0)) as api:
        await api.runtime.store.add_token(ADMIN, "ops", "olga", role="platform-admin")
        await api.runtime.store.add_token(TENANT, "research", "ann", role="tenant-admin")
        yield api


async def cli(server: ApiServer, token: str, *args: str) -> tuple[int, str]:
    result = await asyncio.to_thread(CliRunner().invoke, app, ["--api-url", server.url, "--token", token, *args])
    return result.exit_code, result.output


async def test_a_platform_admin_sets_a_tenants_tracking_targets_from_the_cli(server: ApiServer) -> None:
    code, out = await cli(server, ADMIN, "admin", "tenants", "set-tracking", "research",
                          "--mlflow-uri", "http://mlflow.internal:5000", "--tensorboard")
    assert code == 0 and "MLflow http://mlflow.internal:5000, TensorBoard on" in out, out
    code, out = await cli(server, TENANT, "admin", "tenants", "tracking", "research", "--json")
    assert code == 0 and json.loads(out)["mlflowUri"] == "http://mlflow.internal:5000", out
    code, out = await cli(server, ADMIN, "admin", "tenants", "set-tracking", "research",
                          "--mlflow-uri", "http://169.254.169.254/")
    assert code != 0 and "mlflowUri" in out and "link-local" in out, out
    code, out = await cli(server, TENANT, "admin", "tenants", "set-tracking", "research", "--mlflow-uri", "none")
    assert code != 0 and "platform-admin" in out, out
    code, out = await cli(server, ADMIN, "admin", "tenants", "set-tracking", "research")
    assert code == 0 and "MLflow off, TensorBoard off" in out, out
