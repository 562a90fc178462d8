"""HTTP telemetry: one OpenTelemetry SERVER span per request, and Prometheus request metrics.

A small pure-ASGI middleware (no BaseHTTPMiddleware: the handler runs in the same context,
so ``current_traceparent()`` inside a route is this span's). An incoming ``traceparent``
header is continued; otherwise the request starts a new trace (a submission starts the
job's trace).
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("trainyard.api.http")

REQUESTS = Counter("trainyard_api_requests_total", "HTTP requests", ["method", "route", "status"])
LATENCY = Histogram(
    "trainyard_api_request_seconds", "HTTP request latency", ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def route_template(scope: Scope) -> str:
    """``/v1/training-jobs/{job_id}`` rather than the concrete path (bounded label values)."""
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return str(path) if path else "unmatched"


class TelemetryMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = _PROPAGATOR.extract(headers)
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        started = time.perf_counter()
        with _tracer.start_as_current_span(
            f"{method} {scope.get('path', '')}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope.get("path", "")},
        ) as span:
            try:
                await self.app(scope, receive, send_wrapper)
            finally:
                route = route_template(scope)
                span.update_name(f"{method} {route}")
                _set_response_attributes(span, route, status["code"])
                REQUESTS.labels(method, route, str(status["code"])).inc()
                LATENCY.labels(method, route).observe(time.perf_counter() - started)


def _set_response_attributes(span: Any, route: str, status: int) -> None:
    span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR))
