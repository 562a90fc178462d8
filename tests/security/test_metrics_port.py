"""The metrics port (``TRAINYARD_METRICS_PORT``, 9400 in deploy/) serves series that name tenants and jobs. With
``TRAINYARD_METRICS_TOKEN`` set, a scrape without the bearer token gets a 401 and no metric; the scraper's token
reads them. Through a real service runtime (real broker and Redis) and a real HTTP connection."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from trainyard_runtime import metrics_server
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.settings import ServiceSettings

pytestmark = [pytest.mark.integration, pytest.mark.security]

TOKEN = "scraper-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("header", "allowed"), [
    (None, False), ("", False), ("Bearer", False), (f"Basic {TOKEN}", False), ("Bearer wrong", False),
    (f"Bearer {TOKEN}x", False), (f"Bearer {TOKEN}", True), (f"bearer {TOKEN}", True),
])
def test_only_the_scrapers_token_is_authorised(header: str | None, allowed: bool) -> None:
    assert metrics_server.authorised(header, TOKEN) is allowed
    assert metrics_server.authorised(header, None) is True  # no token configured: open (and said at start-up)


async def test_a_services_metrics_port_answers_only_the_scraper(env: dict) -> None:
    port = _free_port()
    settings = ServiceSettings(**env, metrics_port=port, metrics_addr="127.0.0.1", metrics_token=TOKEN)
    probe = Counter("trainyard_test_jobs_seen_total", "a series that names a tenant", ["tenant", "job"])
    probe.labels("victim-tenant", "victim-job").inc()
    runtime = ServiceRuntime("metrics-probe", settings)
    async with runtime:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            anonymous = await client.get("/metrics")
            wrong = await client.get("/metrics", headers={"Authorization": "Bearer not-the-token"})
            scraper = await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert anonymous.status_code == 401 and wrong.status_code == 401
    for refused in (anonymous, wrong):
        assert "victim" not in refused.text and "trainyard_" not in refused.text
        assert "TRAINYARD_METRICS_TOKEN" in refused.text  # says what is needed
    assert scraper.status_code == 200
    assert 'trainyard_test_jobs_seen_total{job="victim-job",tenant="victim-tenant"} 1.0' in scraper.text
    with pytest.raises(httpx.TransportError):  # closed with the runtime
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_without_a_token_the_port_is_open_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    Counter("trainyard_open_total", "x", registry=registry).inc()
    port = _free_port()
    server = metrics_server.serve(port, addr="127.0.0.1", registry=registry)
    try:
        assert "trainyard_open_total 1.0" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        server.shutdown()
        server.server_close()
    assert any("answers without a token" in r.getMessage() for r in caplog.records)
