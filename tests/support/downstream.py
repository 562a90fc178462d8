"""A downstream service that is not trainyard code: it follows ``trainyard.registry`` (artifacts registered
and retired, exports that failed) with a plain aiokafka consumer in a group of its own and decodes the JSON
itself. Nothing from trainyard is imported here, so
what it sees is what the public contract (docs/asyncapi.yaml) promises, not what trainyard's models accept.

It runs in a thread of its own (an event loop there), beside a synchronous end-to-end test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer

Events = list[dict[str, Any]]


class RegistryFollower:
    """Collects the feed's events once each (deduplicated by ``eventId``), committing after each batch."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        self.bootstrap, self.topic, self.group = bootstrap, topic, group
        self._events: Events = []
        self._seen: set[str] = set()
        self.redelivered = 0  # events seen again under an eventId already handled
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="downstream", daemon=True)

    def __enter__(self) -> RegistryFollower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def _run(self) -> None:
        consumer = AIOKafkaConsumer(
            self.topic, bootstrap_servers=self.bootstrap, group_id=self.group, enable_auto_commit=False,
            auto_offset_reset="earliest", session_timeout_ms=6000,
        )
        try:
            await consumer.start()
            try:
                while not self._stop.is_set():
                    batches = await consumer.getmany(timeout_ms=500)
                    for records in batches.values():
                        for record in records:
                            self._handle(json.loads(record.value))
                    if batches:
                        await consumer.commit()
            finally:
                await consumer.stop()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test by wait()
            self._error = exc

    def _handle(self, event: dict[str, Any]) -> None:
        if event.get("eventType") not in ("ArtifactRegistered", "ArtifactRetired", "ExportFailed"):
            return  # ignore what it does not know
        with self._lock:
            if event["eventId"] in self._seen:
                self.redelivered += 1
                return
            self._seen.add(event["eventId"])
            self._events.append(event)

    def events(self, **match: Any) -> Events:
        """The events handled so far whose fields equal ``match`` (camelCase names), in arrival order."""
        with self._lock:
            return [e for e in self._events if all(e.get(k) == v for k, v in match.items())]

    def wait(self, probe: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
        """Poll ``probe`` until it returns something truthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._error is not None:
                raise AssertionError(f"the downstream consumer failed: {self._error!r}") from self._error
            if value := probe():
                return value
            time.sleep(0.5)
        raise AssertionError(f"{what}: not on the feed after {timeout_s}s; it has {json.dumps(self.events())[:3000]}")
