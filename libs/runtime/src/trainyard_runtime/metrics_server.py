"""The metrics port (``TRAINYARD_METRICS_PORT``): Prometheus' text format of this process's registry, behind a
bearer token when one is configured.

The series name tenants and jobs (``trainyard_job_…{tenant=…,job=…}``), so the port is not for everyone who can
open a connection to the node: with ``TRAINYARD_METRICS_TOKEN`` set, a scrape without ``Authorization: Bearer
<token>`` gets a 401 and no metric (Prometheus sends it with ``authorization: {credentials_file: …}``). Without
a token the port answers anyone, and the process says so at start-up: that is for deployments where only the
scraper reaches the port (a NetworkPolicy; on the local stack, the rank network rules of the node agents).

Why not ``prometheus_client.start_http_server``: it has no authentication. This is the same WSGI app behind a
check, on the same threading WSGI server the client library uses.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from socketserver import ThreadingMixIn

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def authorised(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (always, when no token is configured)."""
    if token is None:
        return True
    scheme, _, presented = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode())


def guarded_app(token: str | None, registry: CollectorRegistry = REGISTRY) -> WsgiApp:
    """Prometheus' WSGI app, answering 401 (with no metric) to a request without the token."""
    inner = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not authorised(environ.get("HTTP_AUTHORIZATION"), token):
            body = b"401: this metrics port needs 'Authorization: Bearer <TRAINYARD_METRICS_TOKEN>'\n"
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Bearer realm="trainyard-metrics"'),
                                                ("Content-Length", str(len(body)))])
            return [body]
        return inner(environ, start_response)

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return  # one line per scrape is noise


def serve(port: int, *, addr: str = "0.0.0.0", token: str | None = None,  # noqa: S104 - the scraper is remote
          registry: CollectorRegistry = REGISTRY) -> WSGIServer:
    """Serve the metrics on ``addr:port`` in a daemon thread; the server (``shutdown()`` stops it)."""
    server = make_server(addr, port, guarded_app(token, registry), _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    if token is None:
        log.warning("the metrics port %s:%d answers without a token and its series name tenants and jobs: only "
                    "the scraper may reach it (set TRAINYARD_METRICS_TOKEN to require one)", addr, port)
    return server
