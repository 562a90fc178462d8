"""The transactional outbox: a state change and the events it causes are written to Redis
in one MULTI; a relay publishes them afterwards and deletes each once the broker has it.

A crash between publish and delete re-publishes on restart; consumers are idempotent by
``eventId``, so that is harmless. A broker outage only delays events, never loses them.

The relay is woken when a pipeline that staged events has executed (not when they are staged:
a relay woken then could look before the MULTI lands, find nothing and sleep a whole idle poll
with the events waiting; that lost wake-up cost every event hop up to ``idle_poll_s``).
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from trainyard_runtime.bus import Bus
from trainyard_contract.errors import WriteNotReplicatedError
from trainyard_contract.events import Event
from trainyard_runtime.replication import BARRIER_KEY, epoch_acks, execute_confirmed
from trainyard_runtime.retry import Backoff, RetryPolicy
from trainyard_runtime.store import Keys
from trainyard_contract.tracing import current_traceparent

#: The relay, when the broker or Redis is away: again after 0.2 s, doubling up to 10 s.
RELAY_RETRY = RetryPolicy(initial_interval_s=0.2, maximum_interval_s=10.0)

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, redis: Redis, service: str) -> None:
        self.redis = redis
        self.key = Keys.outbox(service)
        self._wake = asyncio.Event()

    def stage(self, pipe: Pipeline, event: Event, *, traceparent: str | None = None) -> None:
        """Queue ``event`` inside the caller's MULTI pipeline; the relay wakes once the pipeline executed."""
        pipe.xadd(
            self.key,
            {
                "topic": event.topic,
                "key": event.key(),
                "payload": event.to_bytes().decode(),
                "traceparent": traceparent or current_traceparent() or "",
            },
        )
        self._wake_after(pipe)

    def _wake_after(self, pipe: Pipeline) -> None:
        """Wrap this pipeline's ``execute`` (once): it returns once a replica holds the MULTI, where the client
        asks for one (:func:`replication.execute_confirmed`: a state change and its events are what the caller
        is about to acknowledge), and the relay is woken after it ran, whatever it returned."""
        if getattr(pipe, "_outbox_wakes", None) is self._wake:
            return
        execute = pipe.execute
        wake, redis = self._wake, self.redis

        async def execute_then_wake(raise_on_error: bool = True) -> object:
            try:
                return await execute_confirmed(redis, pipe, raise_on_error=raise_on_error, execute=execute)
            finally:
                wake.set()

        pipe.execute = execute_then_wake  # type: ignore[method-assign, assignment]  # wrapped: it wakes the relay
        pipe._outbox_wakes = wake  # type: ignore[attr-defined]  # our mark on redis-py's pipeline

    async def put(self, *events: Event, traceparent: str | None = None) -> None:
        """Stage events on their own (no other state change to pair them with)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for event in events:
                self.stage(pipe, event, traceparent=traceparent)
            await pipe.execute()

    async def pending(self) -> int:
        return int(await self.redis.xlen(self.key))

    async def relay_once(self, bus: Bus, *, batch: int = 200) -> int:
        """Publish what is staged, oldest first; returns how many were published. Behind Sentinel, only once a
        replica holds what was read (an event is an acknowledgement to another service: the write it
        announces must survive a failover)."""
        entries = await self._read_replicated(batch)
        for entry_id, fields in entries:
            await bus.publish_raw_traced(
                fields["topic"], fields["payload"].encode(), key=fields["key"],
                traceparent=fields.get("traceparent") or None,
            )
            await self.redis.xdel(self.key, entry_id)
        return len(entries)

    async def _read_replicated(self, batch: int) -> list[tuple[str, dict[str, str]]]:
        acks = epoch_acks(self.redis)
        entries: list[tuple[str, dict[str, str]]] = await self.redis.xrange(self.key, count=batch)  # type: ignore[assignment]  # decoded
        if acks.replicas == 0 or not entries:  # an idle relay writes nothing (no barrier every poll)
            return entries
        # read again, a barrier write and WAIT on one connection (one server): the barrier follows what was read
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(self.key, count=batch)
            pipe.incr(BARRIER_KEY)
            pipe.wait(acks.replicas, acks.timeout_ms)
            entries, _, acked = await pipe.execute()
        if entries and int(acked) < acks.replicas:
            raise WriteNotReplicatedError(f"outbox {self.key}: {len(entries)} staged event(s) not yet on "
                                          f"{acks.replicas} replica(s) ({acked} acknowledged); relayed later")
        return entries

    async def relay_forever(self, bus: Bus, *, idle_poll_s: float = 1.0) -> None:
        backoff = Backoff(RELAY_RETRY)
        while True:
            try:
                if await self.relay_once(bus):
                    backoff.succeeded()
                    continue
                self._wake.clear()
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation (gh-86296)
                try:
                    async with asyncio.timeout(idle_poll_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a relay never dies on one failure
                delay = backoff.failed()
                log.warning("outbox relay %s: %r; retrying in %.1fs", self.key, exc, delay)
                await asyncio.sleep(delay)
