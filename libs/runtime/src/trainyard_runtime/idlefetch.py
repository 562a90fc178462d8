"""Idle consumers stop fetching until there is something to fetch (``TRAINYARD_CONSUMER_IDLE_PAUSE_S``).

The embedded local broker (tansu) answers a fetch only when its wait is over, so a consumer that is to hear
of an event within ``consumer_fetch_max_wait_ms`` (20 ms on the local stack) asks 50 times a second, whether
anything comes or not: on an idle local stack the broker and the fetch loops kept a quarter of a core busy.
Apache Kafka answers a waiting fetch as soon as a record arrives, so this is off by default.

When on, a consumer group that has seen no record for ``idle_pause_s`` pauses its partitions (aiokafka sends
no fetch for a paused partition and waits on its resume, costing nothing). It resumes them

* when a **doorbell** rings for one of its topics: every trainyard producer that has a doorbell (the
  :class:`~trainyard_runtime.bus.Bus` of a service) ``PUBLISH``es the topic's name on the Redis channel
  :data:`CHANNEL` after it publishes a record there (at most once per :data:`RING_EVERY_S` per topic: so
  ``idle_pause_s`` must outlast that), and each service listens on it; then it stays awake for
  ``idle_pause_s`` again, and for that long after each record it handles;
* and every ``idle_poll_s`` anyway, for one short round of fetches (:data:`POLL_AWAKE_S`): a record from a
  producer without a doorbell (a plain Kafka client) waits at most that long.

Partitions paused by the bus's retry back-off are left to it. :func:`next_action` is the decision, pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from trainyard_runtime.retry import Backoff, RetryPolicy

log = logging.getLogger(__name__)

CHANNEL = "ty:bus:doorbell"
RING_EVERY_S = 0.25  # far below any idle_pause_s: a consumer that saw a ring this recently is still awake
POLL_AWAKE_S = 0.05  # how long a poll's resume lasts when nothing rang: one or two fetch rounds
#: The doorbell listener, when Redis is away: again after 0.5 s, doubling up to 10 s (the consumers poll meanwhile).
LISTENER_RETRY = RetryPolicy(initial_interval_s=0.5, maximum_interval_s=10.0)


@dataclass(frozen=True)
class IdlePolicy:
    """When an idle consumer pauses (``pause_s`` without a record) and how often it looks anyway."""

    pause_s: float = 0.5
    poll_s: float = 5.0


@dataclass
class IdleState:
    """One consumer group's fetching: awake until ``awake_until``, or paused since ``paused_at``."""

    awake_until: float
    paused_at: float | None = None
    rung: bool = False  # a doorbell rang for one of its topics since the last decision


Action = Literal["pause", "resume", "wait"]


def next_action(state: IdleState, now: float, policy: IdlePolicy) -> tuple[Action, float]:
    """What to do now, and how many seconds until it is worth deciding again. Pure.

    Awake: pause once ``awake_until`` has passed (a record or a ring moves it on). Paused: resume on a ring,
    or once ``poll_s`` has passed since the pause."""
    if state.paused_at is None:
        if now >= state.awake_until:
            return "pause", policy.poll_s
        return "wait", state.awake_until - now
    if state.rung or now - state.paused_at >= policy.poll_s:
        return "resume", POLL_AWAKE_S
    return "wait", state.paused_at + policy.poll_s - now


@dataclass
class IdleFetching:
    """Pauses one consumer group's partitions while it is idle (see the module docstring).

    ``consumer`` returns the group's aiokafka consumer once started (None before); ``retry_paused`` is the set
    of partitions the retry back-off paused (never resumed here)."""

    topics: frozenset[str]  # physical names
    consumer: Callable[[], Any]
    policy: IdlePolicy = field(default_factory=IdlePolicy)
    retry_paused: set[Any] = field(default_factory=set)
    clock: Callable[[], float] = time.monotonic
    state: IdleState = field(init=False)
    _paused: set[Any] = field(default_factory=set, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        self.state = IdleState(awake_until=self.clock() + self.policy.pause_s)

    def saw_record(self) -> None:
        """A record was handled: stay awake for another ``pause_s``."""
        self.state.awake_until = max(self.state.awake_until, self.clock() + self.policy.pause_s)

    def ring(self, topic: str) -> None:
        """The doorbell rang for ``topic``: a group that reads it wakes now."""
        if topic in self.topics:
            self.state.rung = True
            self.state.awake_until = max(self.state.awake_until, self.clock() + self.policy.pause_s)
            self._wake.set()

    @property
    def paused(self) -> bool:
        return self.state.paused_at is not None

    async def run(self) -> None:
        while True:
            action, wait_s = next_action(self.state, self.clock(), self.policy)
            if action == "pause":
                self._pause()
            elif action == "resume":
                self._resume(rung=self.state.rung)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait_s, 0.01)):
                    await self._wake.wait()

    def _pause(self) -> None:
        consumer = self.consumer()
        if consumer is None:
            self.state.awake_until = self.clock() + self.policy.pause_s
            return
        tps = set(consumer.assignment()) - self.retry_paused
        if tps:
            consumer.pause(*tps)
        self._paused = tps
        self.state.paused_at, self.state.rung = self.clock(), False

    def _resume(self, *, rung: bool) -> None:
        consumer = self.consumer()
        if consumer is not None:
            assigned = set(consumer.assignment())
            tps = [tp for tp in self._paused if tp in assigned and tp not in self.retry_paused]
            with contextlib.suppress(Exception):  # revoked meanwhile: nothing to resume
                if tps:
                    consumer.resume(*tps)
        self._paused = set()
        now = self.clock()
        self.state = IdleState(awake_until=now + (self.policy.pause_s if rung else POLL_AWAKE_S))


class Doorbell:
    """Rings (Redis ``PUBLISH``) after a record is published, and hears the rings for the local consumers."""

    def __init__(self, redis: Redis, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.clock = clock
        self._last_rung: dict[str, float] = {}
        self._listeners: list[IdleFetching] = []

    def add(self, listener: IdleFetching) -> None:
        self._listeners.append(listener)

    async def ring(self, topic: str) -> None:
        """Say that ``topic`` (its physical name) has a new record; never fails the publish it follows."""
        now = self.clock()
        if now - self._last_rung.get(topic, -1e9) < RING_EVERY_S:
            return
        self._last_rung[topic] = now
        for listener in self._listeners:  # this process's own consumers need no round trip
            listener.ring(topic)
        try:
            await self.redis.publish(CHANNEL, topic)
        except (RedisError, OSError) as exc:  # the consumers poll anyway
            log.debug("doorbell for %s not rung: %r", topic, exc)

    def hear(self, topics: Iterable[str]) -> None:
        for topic in topics:
            for listener in self._listeners:
                listener.ring(topic)

    async def listen_forever(self) -> None:
        """Hear every ring on :data:`CHANNEL` (again after a Redis outage or failover; polls cover the gap)."""
        backoff = Backoff(LISTENER_RETRY)
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    backoff.succeeded()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            data = message["data"]
                            self.hear([data.decode() if isinstance(data, bytes) else str(data)])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the listener never dies; the consumers poll meanwhile
                delay = backoff.failed()
                log.warning("doorbell listener: %r; again in %.1fs", exc, delay)
                for listener in self._listeners:  # a ring may have been missed: look now
                    listener.state.rung = True
                await asyncio.sleep(delay)
