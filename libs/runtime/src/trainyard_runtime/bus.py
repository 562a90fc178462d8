"""The event bus: one faststream ``KafkaBroker`` wiring shared by every service.

* publish: typed events as camelCase JSON, key = job id (or node id), the W3C trace
  context of the current span in the Kafka headers;
* subscribe: a handler per event class; at-least-once (offsets are committed only after
  the handler returns); duplicates by ``eventId`` are skipped when a Redis de-duplicator
  is given; a message that cannot be decoded, or whose handler fails for good, goes to
  ``trainyard.deadletter`` with its topic, partition, offset, raw bytes and the error, and
  the consumer carries on; infrastructure errors are retried with back-off (the message
  is re-delivered, never skipped), and a partition held on one record for
  :attr:`Redelivery.stuck_after` tries is reported (:meth:`Bus.stuck`, a metric, the health beacon);
* decoding is ours, whatever the record's headers say: faststream's own parser decodes every header
  as UTF-8 and its decoder parses the body by ``content-type`` *before* a handler runs, so a record
  with a non-JSON body under ``content-type: application/json`` (the header our producers set) or a
  header of other bytes failed there, was nacked, and was fetched again forever. Both are replaced
  (:func:`_parse_leniently`, :func:`_body_bytes`): the dispatcher sees every record's bytes;
* topics are created explicitly at start-up (:func:`ensure_topics`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from faststream import AckPolicy
from faststream.exceptions import NackMessage
from faststream.kafka import KafkaBroker, KafkaMessage
from opentelemetry import trace
from prometheus_client import Counter, Gauge
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from trainyard_contract import events as ev
from trainyard_contract.errors import BusError, TrainyardError
from trainyard_runtime.idlefetch import Doorbell, IdleFetching, IdlePolicy
from trainyard_runtime.retry import RetryPolicy
from trainyard_runtime.store import Keys
from trainyard_contract.tracing import inject_headers

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
# called with the events of one fetched batch, in the order of each partition; must be idempotent (a batch is
# handled again whole after a retryable failure, and event by event after any other)
BatchHandler = Callable[[list[Any]], Awaitable[None]]
SEEN_TTL_S = 7 * 24 * 3600


#: A message whose handler failed retryably is tried again after 0.4 s, doubling per failure up to 10 s.
REDELIVERY_RETRY = RetryPolicy(initial_interval_s=0.4, maximum_interval_s=10.0)
#: A record tried this often without success is reported: its partition is stuck.
STUCK_AFTER = 5


@dataclass(frozen=True)
class Redelivery:
    """How a message whose handler failed with a retryable error is tried again (``retry``, never giving up),
    and after how many tries its partition is reported stuck. Its partition waits meanwhile (paused, so
    nothing after it on that partition is handled out of order); the group's other partitions and topics go
    on."""

    retry: RetryPolicy = REDELIVERY_RETRY
    stuck_after: int = STUCK_AFTER

    def forgotten_after_s(self) -> float:
        """A failure older than this (no retry of it seen since) is a partition that moved to another
        consumer or a record handled elsewhere: no longer ours to report."""
        return 3 * self.retry.maximum_interval_s + 30.0


@dataclass(frozen=True)
class StuckPartition:
    """A consumed partition that has not moved past one record: it failed ``tries`` times, the first at
    ``since`` (epoch seconds)."""

    group: str
    topic: str
    partition: int
    offset: int
    tries: int
    since: float
    error: str

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "topic": self.topic, "partition": self.partition, "offset": self.offset,
                "tries": self.tries, "since": self.since, "error": self.error}


@dataclass
class _Failing:
    """How often one record has failed so far (retryably), first and last when."""

    tries: int
    first_at: float
    last_at: float
    error: str


def stuck_partitions(group: str, failing: Mapping[tuple[str, int, int], _Failing], policies: Mapping[str, Redelivery],
                     now: float) -> list[StuckPartition]:
    """The partitions among ``failing`` held on one record for at least their policy's ``stuck_after`` tries,
    whose last try is recent (:meth:`Redelivery.forgotten_after_s`). Pure."""
    out = []
    for (topic, partition, offset), f in sorted(failing.items()):
        policy = policies.get(topic, Redelivery())
        if f.tries >= policy.stuck_after and now - f.last_at <= policy.forgotten_after_s():
            out.append(StuckPartition(group, topic, partition, offset, f.tries, f.first_at, f.error))
    return out


_STUCK = Gauge("trainyard_consumer_stuck_partitions",
               "Partitions a consumer group has not moved past one record on (retried stuck_after times or more)",
               ["service", "group"])
_REDELIVERIES = Counter("trainyard_consumer_retries_total",
                        "Records handed back to be fetched again after a retryable handler error",
                        ["service", "group", "topic"])
_DEAD_LETTERS = Counter("trainyard_consumer_dead_letters_total",
                        "Records a consumer group dead-lettered (undecodable, or its handler failed for good)",
                        ["service", "group", "topic"])


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
    """Remembers handled ``eventId``s per consumer group in Redis (idempotent consumers). The keys carry the
    service's name (:meth:`Keys.seen`): each service may write only its own, so no other service (a node
    agent least of all) can mark an event as handled for it."""

    def __init__(self, redis: Redis, service: str, group: str, ttl_s: int = SEEN_TTL_S) -> None:
        self._redis = redis
        self._service = service
        self._group = group
        self._ttl_s = ttl_s

    def _key(self, event_id: str) -> str:
        return Keys.seen(self._service, self._group, event_id)

    async def seen(self, event_id: str) -> bool:
        return bool(await self._redis.exists(self._key(event_id)))

    async def mark(self, event_id: str) -> None:
        await self._redis.set(self._key(event_id), 1, ex=self._ttl_s)

    async def unseen(self, event_ids: list[str]) -> list[bool]:
        """For each id, whether it is not handled yet: one round trip for a batch."""
        if not event_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for event_id in event_ids:
            pipe.exists(self._key(event_id))
        return [not found for found in await pipe.execute()]

    async def mark_all(self, event_ids: list[str]) -> None:
        """:meth:`mark` each id, in one round trip."""
        if not event_ids:
            return
        pipe = self._redis.pipeline(transaction=False)
        for event_id in event_ids:
            pipe.set(self._key(event_id), 1, ex=self._ttl_s)
        await pipe.execute()


async def start_concurrently(broker: KafkaBroker) -> None:
    """``broker.start()``, with the subscribers started side by side (faststream starts them one after another,
    and stops them side by side). A consumer's start waits for its group's first assignment: about half the
    session timeout on the embedded broker, and on Kafka a new group's ``group.initial.rebalance.delay.ms`` (3 s
    by default), so a service of N groups took N of those to start, or to come back after a restart. If one
    fails, the ones that started are stopped and the first failure is raised."""
    await broker.connect()
    results = await asyncio.gather(*(sub.start() for sub in broker.subscribers), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        with contextlib.suppress(Exception):
            await broker.stop()
        raise failures[0]
    for publisher in broker.publishers:
        await publisher.start()
    broker.running = True


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
        idle: IdlePolicy | None = None,
        doorbell: Doorbell | None = None,
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
        self._batches: dict[str, _BatchRoute] = {}
        self._dispatchers: list[_Dispatcher] = []
        self.dead_lettered = 0
        # idle consumers pause fetching until a doorbell rings or their poll comes (trainyard_runtime.idlefetch)
        self.idle, self.doorbell = idle, doorbell
        self._idle: list[IdleFetching] = []
        self._idle_tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._started

    async def start(self) -> None:
        if self._started:
            return
        self._register_subscribers()
        try:
            await start_concurrently(self.broker)
        except (KafkaError, OSError) as exc:
            raise BusError(f"cannot connect to the broker at {self.bootstrap}: {exc!r}") from exc
        self._started = True
        self._idle_tasks = [asyncio.create_task(i.run(), name=f"{self.service_name}:idle-fetch") for i in self._idle]
        if self._idle and self.doorbell is not None:
            self._idle_tasks.append(asyncio.create_task(self.doorbell.listen_forever(),
                                                        name=f"{self.service_name}:doorbell"))

    async def aclose(self) -> None:
        self.stopping = True
        for task in self._idle_tasks:
            task.cancel()
        await asyncio.gather(*self._idle_tasks, return_exceptions=True)
        self._idle_tasks = []
        if self._started:
            self._started = False
            await self.broker.stop()

    def stuck(self, now: float | None = None) -> list[StuckPartition]:
        """The partitions this bus's consumers have not moved past one record on (see :class:`StuckPartition`);
        also kept in the ``trainyard_consumer_stuck_partitions`` gauge."""
        now = time.time() if now is None else now
        out: list[StuckPartition] = []
        for d in self._dispatchers:
            found = d.stuck(now)
            _STUCK.labels(self.service_name, d.group).set(len(found))
            out += found
        return out

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
        if self.doorbell is not None:
            await self.doorbell.ring(self.physical(topic))

    # ------------------------------------------------------------------ subscribe
    def subscribe(
        self,
        topic: str,
        handlers: Mapping[type[ev.Event], Handler],
        *,
        group: str | None = None,
        deduper_factory: Callable[[str], Deduper] | None = None,
        retry: RetryPolicy = REDELIVERY_RETRY,
        stuck_after: int = STUCK_AFTER,
        offset_reset: Literal["earliest", "latest"] = "earliest",
        background: bool = False,
    ) -> str:
        """Route each event of ``topic`` to the handler of its class; returns the group id.

        Events of classes without a handler are acknowledged and ignored: several event
        types share a topic and each consumer takes the ones it needs. All topics of one
        group are read by one consumer (one group join at start-up, not one per topic), so
        call this before :meth:`start`.

        ``retry``: how a retryable failure of this topic's handlers is tried again (its ``maximum_attempts``
        is not used: an event is never skipped), ``stuck_after``: after how many tries of one record its
        partition is reported stuck (:class:`Redelivery`); each subscription keeps its own.

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
        route.retry[topic] = Redelivery(retry, stuck_after)
        route.offset_reset = offset_reset
        route.background = background if len(route.handlers) == 1 else route.background and background
        return group_id

    def subscribe_batch(
        self,
        topic: str,
        event_class: type[ev.Event] | tuple[type[ev.Event], ...],
        handler: BatchHandler,
        *,
        group: str,
        max_records: int = 500,
        retry: RetryPolicy = REDELIVERY_RETRY,
        stuck_after: int = STUCK_AFTER,
        offset_reset: Literal["earliest", "latest"] = "earliest",
        background: bool = False,
    ) -> str:
        """Route the ``event_class`` events of ``topic`` to ``handler`` a fetched batch at a time (up to
        ``max_records``): for the high-rate topics (StepMetrics from every rank), where one handler call, one span
        and one round trip per event would be the cost. The group is the subscription's own. Delivery is at least
        once, as for :meth:`subscribe`: offsets are committed after the handler returns; a retryable failure
        hands the whole batch back after its back-off; any other failure handles the batch event by event and
        dead-letters only the events that fail — so the handler must be idempotent. Records that are no event
        are dead-lettered; events of other classes than ``event_class`` (one, or a tuple: the handler gets
        them mixed, in each partition's order) are skipped. No de-duplication here: a handler that needs it
        asks its :class:`Deduper` for a batch's ids at once (:meth:`Deduper.unseen`)."""
        if self._started:
            raise RuntimeError("subscribe before Bus.start()")
        if group in self._groups or group in self._batches:
            raise ValueError(f"group {group} is already subscribed")
        classes = event_class if isinstance(event_class, tuple) else (event_class,)
        self._batches[group] = _BatchRoute(topic, classes, handler, max_records=max_records,
                                           retry=Redelivery(retry, stuck_after), offset_reset=offset_reset,
                                           background=background)
        return group

    def _register_subscribers(self) -> None:
        for group_id, batch in self._batches.items():
            batcher = _BatchDispatcher(self, group_id, batch)
            self._dispatchers.append(batcher)
            subscriber = self.broker.subscriber(  # type: ignore[call-overload]  # the optional timeout as **kwargs
                self.physical(batch.topic), group_id=group_id, batch=True, max_records=batch.max_records,
                auto_offset_reset=batch.offset_reset, ack_policy=AckPolicy.NACK_ON_ERROR,
                max_poll_interval_ms=600_000, session_timeout_ms=self.session_timeout_ms,
                heartbeat_interval_ms=max(self.session_timeout_ms // 3, 500),
                fetch_max_wait_ms=self.background_fetch_max_wait_ms if batch.background else self.fetch_max_wait_ms,
                parser=_parse_batch_leniently, decoder=_body_bytes,
                **({"consumer_timeout_ms": 1000} if self.idle is not None else {}),
            )
            subscriber(_entry_point(batcher))
            self._idle_fetching(batcher, frozenset({self.physical(batch.topic)}), subscriber)
        for group_id, route in self._groups.items():
            dispatcher = _Dispatcher(self, group_id, route)
            self._dispatchers.append(dispatcher)
            subscriber = self.broker.subscriber(  # type: ignore[call-overload]  # the optional timeout as **kwargs
                *[self.physical(t) for t in route.handlers],
                group_id=group_id,
                auto_offset_reset=route.offset_reset,
                ack_policy=AckPolicy.NACK_ON_ERROR,
                max_poll_interval_ms=600_000,
                # A group join takes about half the session timeout on the embedded broker.
                session_timeout_ms=self.session_timeout_ms,
                heartbeat_interval_ms=max(self.session_timeout_ms // 3, 500),
                fetch_max_wait_ms=self.background_fetch_max_wait_ms if route.background else self.fetch_max_wait_ms,
                parser=_parse_leniently,
                decoder=_body_bytes,
                # aiokafka's fetch routine wakes this often even with nothing to do (5 times a second by default):
                # where idle consumers sleep, once a second (a fetch's answer, a resume, a consume wake it anyway)
                **({"consumer_timeout_ms": 1000} if self.idle is not None else {}),
            )
            subscriber(_entry_point(dispatcher))
            self._idle_fetching(dispatcher, frozenset(self.physical(t) for t in route.handlers), subscriber)

    def _idle_fetching(self, dispatcher: _Dispatcher, topics: frozenset[str], subscriber: Any) -> None:
        if self.idle is not None:
            dispatcher.idle = IdleFetching(topics, consumer=functools.partial(getattr, subscriber, "consumer", None),
                                           policy=self.idle, retry_paused=dispatcher.retry_paused)
            self._idle.append(dispatcher.idle)
            if self.doorbell is not None:
                self.doorbell.add(dispatcher.idle)


async def _parse_leniently(record: Any, original: Callable[[Any], Awaitable[Any]]) -> Any:
    """faststream's parser, given headers it can read: it decodes every header value as UTF-8 (a value of
    other bytes, or a null one, raised before any handler ran: the record was fetched again forever). The
    dispatcher reads the record's own headers; faststream only needs something to carry."""
    headers = record.headers or ()
    if any(not isinstance(v, bytes) or not _is_utf8(v) for _, v in headers):
        clean = tuple((k, v.decode("utf-8", "replace").encode() if isinstance(v, bytes) else b"") for k, v in headers)
        record = dataclasses.replace(record, headers=clean)
    return await original(record)


async def _parse_batch_leniently(records: Any, original: Callable[[Any], Awaitable[Any]]) -> Any:
    """:func:`_parse_leniently` for a batch (a tuple of records)."""
    clean = []
    for record in records:
        headers = record.headers or ()
        if any(not isinstance(v, bytes) or not _is_utf8(v) for _, v in headers):
            fixed = tuple((k, v.decode("utf-8", "replace").encode() if isinstance(v, bytes) else b"")
                          for k, v in headers)
            record = dataclasses.replace(record, headers=fixed)
        clean.append(record)
    return await original(tuple(clean))


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _body_bytes(message: Any) -> bytes:
    """The decoder faststream calls before every handler: the body as it came (by ``content-type`` it would
    parse JSON or text and raise on anything else, before our dispatcher could dead-letter it)."""
    return message.body or b""


def _entry_point(dispatcher: _Dispatcher) -> Callable[[KafkaMessage], Awaitable[None]]:
    """A faststream handler whose only parameter is the raw message (decoding is ours: :func:`_body_bytes`)."""

    async def _on_message(message: KafkaMessage) -> None:
        await dispatcher(message)

    return _on_message


@dataclass
class _GroupRoute:
    handlers: dict[str, dict[type[ev.Event], Handler]] = field(default_factory=dict)
    dedupers: dict[str, Deduper] = field(default_factory=dict)
    retry: dict[str, Redelivery] = field(default_factory=dict)  # per topic: each subscription's own
    offset_reset: Literal["earliest", "latest"] = "earliest"
    background: bool = False


@dataclass
class _BatchRoute:
    topic: str
    event_classes: tuple[type[ev.Event], ...]
    handler: BatchHandler
    max_records: int = 500
    retry: Redelivery = field(default_factory=Redelivery)
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
    (:class:`Redelivery`: its partition is paused for the back-off, the rest of the group goes on) or
    dead-letter."""

    def __init__(self, bus: Bus, group: str, route: _GroupRoute) -> None:
        self.bus, self.group, self.route = bus, group, route
        self._failures: dict[tuple[str, int, int], _Failing] = {}
        self.idle: IdleFetching | None = None
        self.retry_paused: set[TopicPartition] = set()  # by the back-off: the idle pause leaves them alone

    def stuck(self, now: float) -> list[StuckPartition]:
        for where, f in list(self._failures.items()):  # forget what moved elsewhere long ago
            if now - f.last_at > 10 * self.route.retry.get(where[0], Redelivery()).forgotten_after_s():
                del self._failures[where]
        return stuck_partitions(self.group, self._failures, self.route.retry, now)

    def logical(self, physical: str) -> str:
        ns = self.bus.namespace
        return physical[len(ns):] if ns and physical.startswith(ns) else physical

    async def __call__(self, message: KafkaMessage) -> None:
        if self.idle is not None:
            self.idle.saw_record()
        record: Any = message.raw_message  # one ConsumerRecord: the subscriber is not a batch one
        try:
            delivery = await self._decode(record)
        except Exception as exc:  # noqa: BLE001 - the dead letter could not be published: again, after a back-off
            await self._retry_later(message, record, self.logical(record.topic), exc)
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
        except (ValidationError, ValueError, TypeError, RecursionError) as exc:  # whatever the bytes are
            await self._dead_letter(record, topic, f"invalid event: {_short(exc)}")
            return None
        headers = {k: v.decode(errors="replace") for k, v in (record.headers or []) if isinstance(v, bytes)}
        try:
            parent = _PROPAGATOR.extract(headers)
        except Exception:  # noqa: BLE001 - a malformed trace header costs the record its parent span, nothing more
            parent = None
        return _Delivery(topic, record.partition, record.offset, record, event, parent)

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
        await self._retry_later(message, d.record, d.topic, exc)

    async def _retry_later(self, message: KafkaMessage, record: Any, topic: str, exc: Exception) -> NoReturn:
        """Hand ``record`` back to be fetched again after its back-off (its partition paused meanwhile); count
        the try, so a partition held on it is reported once :attr:`Redelivery.stuck_after` tries failed."""
        if self.bus.stopping:  # do not hold up shutdown: uncommitted, the group delivers it again
            raise NackMessage() from exc
        where = (topic, record.partition, record.offset)
        now = time.time()
        failing = self._failures.get(where) or _Failing(0, now, now, "")
        failing.tries, failing.last_at = failing.tries + 1, now
        failing.error = f"{type(exc).__name__}: {_short(exc, 300)}"
        self._failures[where] = failing
        policy = self.route.retry.get(topic, Redelivery())
        delay = policy.retry.delay(failing.tries)
        _REDELIVERIES.labels(self.bus.service_name, self.group, topic).inc()
        level = logging.ERROR if failing.tries == policy.stuck_after else logging.WARNING
        log.log(level, "%s: retryable error on %s@%s/%s (try %d, again in %.1fs)%s: %r",
                self.group, topic, record.partition, record.offset, failing.tries, delay,
                "; the partition is stuck on this record" if failing.tries >= policy.stuck_after else "", exc)
        self._pause(message, record, delay)
        raise NackMessage() from exc  # faststream seeks the partition back to this record

    def _pause(self, message: KafkaMessage, record: Any, delay: float) -> None:
        """Stop fetching the record's partition for ``delay`` seconds (only it: the group's other partitions
        and topics are read meanwhile)."""
        consumer: Any = message.consumer  # aiokafka's consumer (faststream's protocol names no pause/resume)
        tp = TopicPartition(record.topic, record.partition)
        consumer.pause(tp)
        self.retry_paused.add(tp)

        def resume() -> None:
            self.retry_paused.discard(tp)
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
        _DEAD_LETTERS.labels(self.bus.service_name, self.group, topic).inc()
        self._failures.pop((topic, record.partition, record.offset), None)


class _BatchDispatcher(_Dispatcher):
    """A fetched batch: decode each record (dead-letter what is no event), hand the route's events to its
    handler in one call; on failure, the batch again after a back-off (retryable) or event by event."""

    def __init__(self, bus: Bus, group: str, batch: _BatchRoute) -> None:
        route = _GroupRoute(handlers={batch.topic: {}}, retry={batch.topic: batch.retry},
                            offset_reset=batch.offset_reset, background=batch.background)
        super().__init__(bus, group, route)
        self.batch = batch
        self._lettered: set[tuple[str, int, int]] = set()  # records dead-lettered already (a batch handed back)

    async def __call__(self, message: KafkaMessage) -> None:
        if self.idle is not None:
            self.idle.saw_record()
        records: tuple[Any, ...] = message.raw_message if isinstance(message.raw_message, tuple) else \
            (message.raw_message,)
        deliveries: list[_Delivery] = []
        try:
            for record in records:
                where = (record.topic, record.partition, record.offset)
                if where in self._lettered:
                    continue
                d = await self._decode(record)
                if d is None:
                    if len(self._lettered) > 10_000:
                        self._lettered.clear()
                    self._lettered.add(where)
                elif type(d.event) in self.batch.event_classes:
                    deliveries.append(d)
        except Exception as exc:  # noqa: BLE001 - a dead letter could not be published: the batch again, later
            await self._retry_batch(message, records, exc)
        if not deliveries:
            return
        with _tracer.start_as_current_span(
                f"{self.batch.topic} process batch", kind=trace.SpanKind.CONSUMER,
                attributes={"messaging.system": "kafka", "messaging.destination.name": self.batch.topic,
                            "messaging.consumer.group.name": self.group, "messaging.batch.message_count":
                            len(deliveries)}) as span:
            try:
                await self.batch.handler([d.event for d in deliveries])
            except Exception as exc:  # noqa: BLE001 - classified below, never lost
                span.record_exception(exc)
                if is_retryable(exc):
                    await self._retry_batch(message, records, exc)
                await self._one_by_one(message, records, deliveries)
        self._failures.pop((self.batch.topic, records[0].partition, records[0].offset), None)

    async def _one_by_one(self, message: KafkaMessage, records: tuple[Any, ...], deliveries: list[_Delivery]) -> None:
        """After a failure that is not retryable: each event alone; the ones that fail so are dead-lettered."""
        for d in deliveries:
            try:
                await self.batch.handler([d.event])
            except Exception as exc:  # noqa: BLE001 - classified: retried whole, or dead-lettered
                if is_retryable(exc):
                    await self._retry_batch(message, records, exc)
                log.error("%s: handler failed for %s@%s/%s; dead-lettering", self.group, d.topic, d.partition,
                          d.offset, exc_info=exc)
                await self._dead_letter(d.record, d.topic, f"handler error: {type(exc).__name__}: {_short(exc)}")

    async def _retry_batch(self, message: KafkaMessage, records: tuple[Any, ...], exc: Exception) -> NoReturn:
        """The batch again after its back-off: every partition in it paused meanwhile (faststream seeks each back
        to its earliest record of the batch)."""
        for tp in {TopicPartition(r.topic, r.partition) for r in records[1:]}:
            if tp != TopicPartition(records[0].topic, records[0].partition):
                self._pause_for(message, tp, self.batch.retry.retry.delay(1))
        await self._retry_later(message, records[0], self.batch.topic, exc)

    def _pause_for(self, message: KafkaMessage, tp: TopicPartition, delay: float) -> None:
        consumer: Any = message.consumer
        consumer.pause(tp)
        self.retry_paused.add(tp)

        def resume() -> None:
            self.retry_paused.discard(tp)
            with contextlib.suppress(Exception):
                consumer.resume(tp)

        asyncio.get_running_loop().call_later(delay, resume)


def _short(exc: BaseException, limit: int = 2000) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "…"
