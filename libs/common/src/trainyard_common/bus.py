"""The event bus: one faststream ``KafkaBroker`` wiring shared by every service.

* publish: typed events as camelCase JSON, key = job id (or node id), the W3C trace
  context of the current span in the Kafka headers;
* subscribe: a handler per event class; at-least-once (offsets are committed only after
  the handler returns); duplicates by ``eventId`` are skipped when a Redis de-duplicator
  is given; a message that cannot be decoded, or whose handler fails for good, goes to
  ``trainyard.deadletter`` with its topic, partition, offset, raw bytes and the error, and
  the consumer carries on; infrastructure errors are retried with back-off (the message
  is re-delivered, never skipped);
* topics are created explicitly at start-up (:func:`ensure_topics`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from faststream import AckPolicy
from faststream.exceptions import NackMessage
from faststream.kafka import KafkaBroker, KafkaMessage
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from trainyard_common import events as ev
from trainyard_common.errors import BusError, TrainyardError
from trainyard_common.tracing import inject_headers

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class KafkaAuth:
    """How a client authenticates to the broker (``TRAINYARD_KAFKA_SECURITY_PROTOCOL`` and friends).

    PLAINTEXT (the default, and all the local tansu broker speaks) or SASL with a user per service
    (SCRAM-SHA-512 by default), over TLS or not; see docs/security.md."""

    protocol: str = "PLAINTEXT"
    mechanism: str = "SCRAM-SHA-512"
    username: str | None = None
    password: str | None = None
    cafile: str | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> KafkaAuth:
        password = settings.kafka_sasl_password
        return cls(protocol=settings.kafka_security_protocol, mechanism=settings.kafka_sasl_mechanism,
                   username=settings.kafka_sasl_username,
                   password=password.get_secret_value() if password is not None else None,
                   cafile=str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None)

    def _ssl_context(self) -> Any:
        if not self.protocol.endswith("SSL"):
            return None
        import ssl

        return ssl.create_default_context(cafile=self.cafile)

    def security(self) -> Any:
        """The faststream security object (None: plaintext)."""
        from faststream import security as fs

        if self.protocol == "PLAINTEXT":
            return None
        if self.protocol == "SSL":
            return fs.BaseSecurity(ssl_context=self._ssl_context(), use_ssl=True)
        kinds = {"PLAIN": fs.SASLPlaintext, "SCRAM-SHA-256": fs.SASLScram256, "SCRAM-SHA-512": fs.SASLScram512}
        return kinds[self.mechanism](username=self.username or "", password=self.password or "",
                                     ssl_context=self._ssl_context(), use_ssl=self.protocol == "SASL_SSL")

    def client_options(self) -> dict[str, Any]:
        """The same for a plain aiokafka client (the admin client that creates topics)."""
        if self.protocol == "PLAINTEXT":
            return {}
        options: dict[str, Any] = {"security_protocol": self.protocol, "ssl_context": self._ssl_context()}
        if self.protocol.startswith("SASL"):
            options |= {"sasl_mechanism": self.mechanism, "sasl_plain_username": self.username,
                        "sasl_plain_password": self.password}
        return options


PLAINTEXT = KafkaAuth()
_tracer = trace.get_tracer("trainyard.bus")

Handler = Callable[[Any], Awaitable[None]]  # called with an instance of the event class it is routed for
SEEN_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class RetryPolicy:
    """How a message whose handler failed with a retryable error is tried again: after ``first_s``,
    doubling per failure of the same message up to ``max_s``. Its partition waits meanwhile (paused,
    so nothing after it on that partition is handled out of order); the group's other partitions and
    topics go on."""

    first_s: float = 0.4
    max_s: float = 10.0

    def delay(self, failures: int) -> float:
        """Seconds before try ``failures + 1`` (``failures`` >= 1). Pure."""
        return min(self.max_s, self.first_s * 2 ** min(max(failures - 1, 0), 16))


async def ensure_topics(
    bootstrap: str,
    *,
    partitions: int,
    replication: int = 1,
    topics: Iterable[str] = ev.ALL_TOPICS,
    namespace: str = "",
    timeout_s: float = 30.0,
    auth: KafkaAuth = PLAINTEXT,
) -> list[str]:
    """Create the missing topics; returns those created. Existing topics are left alone."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **auth.client_options())
    created: list[str] = []
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        existing = set(await admin.list_topics())
        missing = [f"{namespace}{t}" for t in topics if f"{namespace}{t}" not in existing]
        for topic in missing:  # one at a time: a concurrent creator only costs us one topic
            try:
                await admin.create_topics(
                    [NewTopic(topic, num_partitions=partitions, replication_factor=replication)]
                )
                created.append(topic)
            except TopicAlreadyExistsError:
                pass
    except (KafkaError, OSError, asyncio.TimeoutError) as exc:
        raise BusError(f"cannot create topics on {bootstrap}: {exc!r}") from exc
    finally:
        await admin.close()
    return created


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, TrainyardError):
        return exc.retryable
    return isinstance(exc, (RedisError, KafkaError, OSError, asyncio.TimeoutError))


class Deduper:
    """Remembers handled ``eventId``s per consumer group in Redis (idempotent consumers)."""

    def __init__(self, redis: Redis, group: str, ttl_s: int = SEEN_TTL_S) -> None:
        self._redis = redis
        self._group = group
        self._ttl_s = ttl_s

    def _key(self, event_id: str) -> str:
        return f"ty:seen:{self._group}:{event_id}"

    async def seen(self, event_id: str) -> bool:
        return bool(await self._redis.exists(self._key(event_id)))

    async def mark(self, event_id: str) -> None:
        await self._redis.set(self._key(event_id), 1, ex=self._ttl_s)


class Bus:
    """Owns the broker connection. ``start()`` after subscribing; ``aclose()`` is idempotent."""

    def __init__(
        self,
        bootstrap: str,
        *,
        service_name: str,
        group_prefix: str = "trainyard",
        topic_namespace: str = "",
        session_timeout_ms: int = 6000,
        fetch_max_wait_ms: int = 500,
        background_fetch_max_wait_ms: int = 500,
        auth: KafkaAuth = PLAINTEXT,
    ) -> None:
        self.session_timeout_ms = session_timeout_ms
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.background_fetch_max_wait_ms = background_fetch_max_wait_ms
        self.service_name = service_name
        self.group_prefix = group_prefix
        self.bootstrap = bootstrap
        # A namespace prefixes every topic name (test isolation, several stacks on one broker).
        self.namespace = topic_namespace
        # No idempotent producer and no transactions: the embedded broker rejects both.
        self.broker = KafkaBroker(
            bootstrap,
            client_id=service_name,
            enable_idempotence=False,
            acks="all",
            graceful_timeout=10.0,
            logger=logging.getLogger(f"faststream.{service_name}"),
            # faststream logs "Received" / "Processed" for every message at this level: DEBUG, so a service's
            # INFO log says what its handlers decided, not two lines per StepMetrics (and no I/O per message)
            log_level=logging.DEBUG,
            security=auth.security(),
        )
        self._started = False
        self.stopping = False  # set while closing: retryable failures are not retried in-process then
        self._groups: dict[str, _GroupRoute] = {}
        self.dead_lettered = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._started

    async def start(self) -> None:
        if self._started:
            return
        self._register_subscribers()
        try:
            await self.broker.start()
        except (KafkaError, OSError) as exc:
            raise BusError(f"cannot connect to the broker at {self.bootstrap}: {exc!r}") from exc
        self._started = True

    async def aclose(self) -> None:
        self.stopping = True
        if self._started:
            self._started = False
            await self.broker.stop()

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ publish
    async def publish(self, event: ev.Event, *, traceparent: str | None = None) -> None:
        """Publish ``event`` to its topic. ``traceparent`` overrides the current span as parent."""
        await self.publish_raw_traced(event.topic, event.to_bytes(), key=event.key(), traceparent=traceparent)

    def physical(self, topic: str) -> str:
        """The broker's name for a logical topic (``trainyard.jobs`` → ``<namespace>trainyard.jobs``)."""
        return f"{self.namespace}{topic}"

    async def publish_raw_traced(
        self, topic: str, payload: bytes, *, key: str | None, traceparent: str | None = None
    ) -> None:
        """Publish bytes inside a PRODUCER span; its context goes into the Kafka headers."""
        ctx = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        with _tracer.start_as_current_span(
            f"{topic} publish",
            context=ctx,
            kind=trace.SpanKind.PRODUCER,
            attributes={"messaging.system": "kafka", "messaging.destination.name": topic,
                        "trainyard.key": key or ""},
        ):
            headers = inject_headers({"content-type": "application/json"})
            await self.publish_raw(topic, payload, key=key, headers=headers)

    async def publish_raw(
        self, topic: str, payload: bytes, *, key: str | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        try:
            await self.broker.publish(
                payload, topic=self.physical(topic), key=key.encode() if key else None, headers=dict(headers or {})
            )
        except (KafkaError, OSError) as exc:
            raise BusError(f"publish to {topic} failed: {exc!r}") from exc

    # ------------------------------------------------------------------ subscribe
    def subscribe(
        self,
        topic: str,
        handlers: Mapping[type[ev.Event], Handler],
        *,
        group: str | None = None,
        deduper_factory: Callable[[str], Deduper] | None = None,
        max_backoff_s: float = 10.0,
        retry: RetryPolicy | None = None,
        offset_reset: Literal["earliest", "latest"] = "earliest",
        background: bool = False,
    ) -> str:
        """Route each event of ``topic`` to the handler of its class; returns the group id.

        Events of classes without a handler are acknowledged and ignored: several event
        types share a topic and each consumer takes the ones it needs. All topics of one
        group are read by one consumer (one group join at start-up, not one per topic), so
        call this before :meth:`start`.

        ``retry`` (or ``max_backoff_s``, the cap of the default policy): how a retryable failure of this
        topic's handlers is tried again (:class:`RetryPolicy`); each subscription keeps its own.

        ``background``: nobody waits on this group's events (metrics, the registry's records), so its
        consumer fetches with the longer ``background_fetch_max_wait_ms``; a group is background only if
        every subscription to it says so.
        """
        if self._started:
            raise RuntimeError("subscribe before Bus.start()")
        group_id = group or f"{self.group_prefix}.{self.service_name}"
        route = self._groups.setdefault(group_id, _GroupRoute())
        if topic in route.handlers:
            raise ValueError(f"{topic} is already routed for group {group_id}")
        route.handlers[topic] = dict(handlers)
        if deduper_factory is not None:
            route.dedupers[topic] = deduper_factory(group_id)
        route.retry[topic] = retry or RetryPolicy(first_s=min(0.4, max_backoff_s), max_s=max_backoff_s)
        route.offset_reset = offset_reset
        route.background = background if len(route.handlers) == 1 else route.background and background
        return group_id

    def _register_subscribers(self) -> None:
        for group_id, route in self._groups.items():
            self.broker.subscriber(
                *[self.physical(t) for t in route.handlers],
                group_id=group_id,
                auto_offset_reset=route.offset_reset,
                ack_policy=AckPolicy.NACK_ON_ERROR,
                max_poll_interval_ms=600_000,
                # A group join takes about half the session timeout on the embedded broker.
                session_timeout_ms=self.session_timeout_ms,
                heartbeat_interval_ms=max(self.session_timeout_ms // 3, 500),
                fetch_max_wait_ms=self.background_fetch_max_wait_ms if route.background else self.fetch_max_wait_ms,
            )(_entry_point(_Dispatcher(self, group_id, route)))


def _entry_point(dispatcher: _Dispatcher) -> Callable[[KafkaMessage], Awaitable[None]]:
    """A faststream handler whose only parameter is the raw message (decoding is ours)."""

    async def _on_message(message: KafkaMessage) -> None:
        await dispatcher(message)

    return _on_message


@dataclass
class _GroupRoute:
    handlers: dict[str, dict[type[ev.Event], Handler]] = field(default_factory=dict)
    dedupers: dict[str, Deduper] = field(default_factory=dict)
    retry: dict[str, RetryPolicy] = field(default_factory=dict)  # per topic: each subscription's own
    offset_reset: Literal["earliest", "latest"] = "earliest"
    background: bool = False


@dataclass(frozen=True)
class _Delivery:
    """One record as the dispatcher sees it: where it came from, and the event it decoded to."""

    topic: str  # logical (without the namespace)
    partition: int
    offset: int
    record: Any
    event: ev.Event
    parent: Any  # the producer's trace context

    @property
    def where(self) -> tuple[str, int, int]:
        return self.topic, self.partition, self.offset


class _Dispatcher:
    """Each record, in separate steps: decode (a record that is no event of ours is dead-lettered) →
    handle once (dedupe, the handler of its class, mark seen) → on failure, retry per message
    (:class:`RetryPolicy`: its partition is paused for the back-off, the rest of the group goes on) or
    dead-letter."""

    def __init__(self, bus: Bus, group: str, route: _GroupRoute) -> None:
        self.bus, self.group, self.route = bus, group, route
        self._failures: dict[tuple[str, int, int], int] = {}

    def logical(self, physical: str) -> str:
        ns = self.bus.namespace
        return physical[len(ns):] if ns and physical.startswith(ns) else physical

    async def __call__(self, message: KafkaMessage) -> None:
        delivery = await self._decode(message.raw_message)
        if delivery is None:
            return
        handler = self.route.handlers.get(delivery.topic, {}).get(type(delivery.event))
        if handler is None:
            return  # another consumer's event on a shared topic
        with self._span(delivery) as span:
            try:
                await self._handle_once(delivery, handler, span)
            except Exception as exc:  # noqa: BLE001 - classified in _on_failure, never lost
                span.record_exception(exc)
                await self._on_failure(message, delivery, exc)

    async def _decode(self, record: Any) -> _Delivery | None:
        """The record's event, or None once it is dead-lettered as not one."""
        topic = self.logical(record.topic)
        try:
            event = ev.decode_event(topic, record.value or b"")
        except (ValidationError, ValueError) as exc:
            await self._dead_letter(record, topic, f"invalid event: {_short(exc)}")
            return None
        headers = {k: (v.decode(errors="replace") if isinstance(v, bytes) else v) for k, v in (record.headers or [])}
        return _Delivery(topic, record.partition, record.offset, record, event, _PROPAGATOR.extract(headers))

    def _span(self, d: _Delivery) -> Any:
        return _tracer.start_as_current_span(
            f"{d.topic} process {d.event.event_type}", context=d.parent, kind=trace.SpanKind.CONSUMER,
            attributes={
                "messaging.system": "kafka", "messaging.destination.name": d.topic,
                "messaging.consumer.group.name": self.group, "messaging.kafka.offset": d.offset,
                "trainyard.event_type": d.event.event_type, "trainyard.event_id": str(d.event.event_id),
            },
        )

    async def _handle_once(self, d: _Delivery, handler: Handler, span: Any) -> None:
        deduper = self.route.dedupers.get(d.topic)
        if deduper and await deduper.seen(str(d.event.event_id)):
            span.set_attribute("trainyard.duplicate", True)
            return
        await handler(d.event)
        if deduper:
            await deduper.mark(str(d.event.event_id))
        self._failures.pop(d.where, None)

    async def _on_failure(self, message: KafkaMessage, d: _Delivery, exc: Exception) -> None:
        """Retry a retryable error (the message again after its back-off); dead-letter anything else."""
        if not is_retryable(exc):
            log.error("%s: handler failed for %s@%s/%s; dead-lettering", self.group, d.topic, d.partition,
                      d.offset, exc_info=exc)
            await self._dead_letter(d.record, d.topic, f"handler error: {type(exc).__name__}: {_short(exc)}")
            return
        if self.bus.stopping:  # do not hold up shutdown: uncommitted, the group delivers it again
            raise NackMessage() from exc
        n = self._failures.get(d.where, 0) + 1
        self._failures[d.where] = n
        delay = self.route.retry.get(d.topic, RetryPolicy()).delay(n)
        log.warning("%s: retryable error on %s@%s/%s (try %d, again in %.1fs): %r",
                    self.group, d.topic, d.partition, d.offset, n, delay, exc)
        await self._pause(message, d.record, delay)
        raise NackMessage() from exc  # faststream seeks the partition back to this record

    @staticmethod
    async def _pause(message: KafkaMessage, record: Any, delay: float) -> None:
        """Stop fetching the record's partition for ``delay`` seconds (only it: the group's other partitions
        and topics are read meanwhile). Without a consumer to pause, wait here instead (the old way)."""
        consumer = getattr(message, "consumer", None)
        if consumer is None or not hasattr(consumer, "pause"):  # pragma: no cover - faststream gives its consumer
            await asyncio.sleep(delay)
            return
        tp = TopicPartition(record.topic, record.partition)
        consumer.pause(tp)

        def resume() -> None:
            with contextlib.suppress(Exception):  # revoked meanwhile, or the consumer stopped: nothing to resume
                consumer.resume(tp)

        asyncio.get_running_loop().call_later(delay, resume)

    async def _dead_letter(self, record: Any, topic: str, error: str) -> None:
        letter = ev.DeadLetter(
            source_topic=topic,
            partition=record.partition,
            offset=record.offset,
            consumer_group=self.group,
            key_b64=base64.b64encode(record.key).decode() if record.key else None,
            raw_b64=base64.b64encode(record.value or b"").decode(),
            error=error,
        )
        log.warning("%s: dead-letter %s@%s/%s: %s", self.group, record.topic, record.partition,
                    record.offset, error)
        # If this publish fails, the exception propagates and the message is re-delivered.
        await self.bus.publish(letter)
        self.bus.dead_lettered += 1


def _short(exc: BaseException, limit: int = 2000) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "…"
