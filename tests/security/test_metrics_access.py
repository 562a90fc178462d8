"""The API's ``GET /metrics`` labels tenants and jobs (goodput per tenant, queue reasons, …): a caller without a
token gets a 401 and no metric, a tenant's token a 403; the metrics token a scraper is given
(``TRAINYARD_API_METRICS_TOKEN``) or a platform-admin token reads them. ``TRAINYARD_API_PUBLIC_METRICS`` opens
them again where only operators reach the API's port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx
import pytest
from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import StateStore

from tests.support.api import TOKEN_A, TOKEN_ADMIN, client_for, seed

pytestmark = [pytest.mark.integration, pytest.mark.security]

METRICS_TOKEN = "scrape-me-0123456789abcdef"
Api = Callable[..., AbstractAsyncContextManager[httpx.ASGITransport]]


@pytest.fixture
def api(env: dict, redis) -> Api:
    """The bare app over the real Redis (two tenants and an operator), with the settings a test gives."""

    @asynccontextmanager
    async def start(**settings: object) -> AsyncIterator[httpx.ASGITransport]:
        store = StateStore(redis)
        await seed(store, admin=True)
        app = create_app(ApiContext(ApiSettings(**{**env, **settings}), store, Outbox(redis, "api")))
        async with client_for("http://api", TOKEN_A, transport=httpx.ASGITransport(app=app)) as a:
            await a.get("/v1/training-jobs")  # a request of tenant-a: the request metrics now carry a label set
        yield httpx.ASGITransport(app=app)

    return start


async def test_metrics_without_a_token_or_with_a_tenants_token_are_refused(api: Api) -> None:
    async with api(api_metrics_token=METRICS_TOKEN) as transport:
        for token, status in ((None, 401), ("wrong-token", 401), (METRICS_TOKEN[:-1], 401), (TOKEN_A, 403)):
            async with client_for("http://api", token, transport=transport) as c:
                refused = await c.get("/metrics")
            assert refused.status_code == status, (token, refused.text)
            assert "trainyard_" not in refused.text and "tenant-a" not in refused.text, refused.text
        async with client_for("http://api", None, transport=transport) as c:
            missing = await c.get("/metrics")
        assert missing.headers["www-authenticate"] == "Bearer"
        assert "TRAINYARD_API_METRICS_TOKEN" in missing.json()["detail"], missing.text


async def test_the_metrics_token_or_a_platform_admin_token_reads_the_metrics(api: Api) -> None:
    async with api(api_metrics_token=METRICS_TOKEN) as transport:
        for token in (METRICS_TOKEN, TOKEN_ADMIN):
            async with client_for("http://api", token, transport=transport) as c:
                served = await c.get("/metrics")
            assert served.status_code == 200, (token, served.text)
            assert "trainyard_api_requests_total" in served.text
    async with api() as transport:  # no metrics token configured: a platform-admin token still reads them
        async with client_for("http://api", TOKEN_ADMIN, transport=transport) as c:
            assert (await c.get("/metrics")).status_code == 200
        async with client_for("http://api", "", transport=transport) as c:
            assert (await c.get("/metrics")).status_code == 401


async def test_public_metrics_are_a_setting(api: Api) -> None:
    async with api(api_public_metrics=True) as transport, client_for("http://api", None, transport=transport) as c:
        served = await c.get("/metrics")
    assert served.status_code == 200 and "trainyard_api_requests_total" in served.text
