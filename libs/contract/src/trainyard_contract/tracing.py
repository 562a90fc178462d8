"""OpenTelemetry wiring: one tracer provider per process, OTLP export by the standard
``OTEL_*`` variables, and helpers to carry a W3C ``traceparent`` across hops.

Export is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``…_TRACES_ENDPOINT``) is set and
``OTEL_TRACES_EXPORTER`` is not ``none``; otherwise spans are created but not exported, so
a developer machine without a collector does not log export errors.

A job is one trace: the API starts it and stores the ``traceparent`` with the job; any
service that acts for a job later (e.g. the scheduler placing it on a timer tick) runs
inside :func:`job_context` so its spans and published events join that trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: trace.TracerProvider | None = None
_log = logging.getLogger(__name__)


def _private_id_generator() -> Any:
    """Span and trace ids from the OS, never from Python's global ``random``.

    The SDK's default draws from ``random``: a trainer that seeds it for reproducibility
    would then repeat span ids across attempts, and tracing would disturb its random stream.
    Built on first use: the SDK is the ``tracing`` extra's, not the contract's.
    """
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    system = random.SystemRandom()

    class _PrivateIdGenerator(IdGenerator):
        def generate_span_id(self) -> int:
            return system.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return system.getrandbits(128) or 1

    return _PrivateIdGenerator()


def exporter_configured(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str, *, instance_id: str | None = None) -> trace.TracerProvider:
    """Install the process-wide tracer provider (idempotent).

    Without the OpenTelemetry SDK installed (a rank environment that took the contract without its
    ``tracing`` extra) spans stay no-ops and the trace context still propagates through events."""
    global _provider
    if _provider is not None:
        return _provider
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        _log.info("opentelemetry-sdk is not installed: %s records no spans (pip install 'trainyard-contract[tracing]')",
                  service_name)
        _provider = trace.get_tracer_provider()
        return _provider
    attrs = {"service.name": service_name}
    if instance_id:
        attrs["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attrs), id_generator=_private_id_generator())
    if exporter_configured():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop export; safe to call more than once."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None and hasattr(provider, "shutdown"):  # the API's no-op provider has neither
        provider.force_flush(timeout_millis=5000)  # type: ignore[attr-defined]  # the SDK's provider: it has shutdown
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def current_traceparent() -> str | None:
    """The W3C traceparent of the active span, or None outside any span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    carrier = dict(headers or {})
    _PROPAGATOR.inject(carrier)
    return carrier


@contextlib.contextmanager
def job_context(traceparent: str | None) -> Iterator[None]:
    """Make ``traceparent`` the parent of spans started inside (no-op when None)."""
    if not traceparent:
        yield
        return
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)
