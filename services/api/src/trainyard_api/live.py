"""Live updates: one fan-out hub per API process behind ``GET /v1/events`` (server-sent events).

    bus (own group per process) ──> LiveHub.touch(job) ──> flush ≤ every ``min_interval_s`` ──>
        JobSummary of each changed job ──> every subscriber that may see it (bounded queue each)

The process consumes ``trainyard.jobs``, ``trainyard.checkpoints``, ``trainyard.workers`` and
``trainyard.metrics`` in a consumer group of its own (``trainyard.api-live.<uuid>``), from the newest
offset: every API process sees every change, and a new one does not replay history. An event only
names a job; the summary sent is read from Redis at flush time, so a burst of events (progress of every
rank, every step) becomes one summary per job per interval (at most ``1 / min_interval_s`` per second).

A slow client never blocks the hub: its queue is bounded and, when full, is emptied and given one
``resync`` (the client re-reads what it shows). :meth:`LiveHub.aclose` ends every stream.

A stream is only as good as its token: given a ``check`` (the route reads the token's record again),
:meth:`LiveHub.stream` runs it before each event it sends and at least every ``recheck_s`` while idle;
once it refuses (revoked, expired, unknown), the stream sends one ``closed`` event with the reason and
ends, so nothing reaches a revoked viewer after the revocation.
Pure: :func:`visible` (tenant filtering), :func:`sse` (framing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from trainyard_runtime.bus import Bus
from trainyard_contract.events import (
    CHECKPOINTS,
    JOBS,
    METRICS,
    WORKERS,
    AttemptEnded,
    CheckpointFailed,
    CheckpointReady,
    Event,
    JobControlRequested,
    JobStateChanged,
    JobSubmitted,
    StepMetrics,
    WorkerExited,
    WorkerStarted,
)

log = logging.getLogger(__name__)

KEEPALIVE = b": keepalive\n\n"
RESYNC = "resync"
CLOSED = "closed"
_CLOSED = object()


def sse(event: str, data: str) -> bytes:
    """One server-sent event (``data`` is one line of JSON)."""
    return f"event: {event}\ndata: {data}\n\n".encode()


def visible(summary_tenant: str, job_id: str, viewer_tenant: str, only_job: str | None) -> bool:
    """Whether a viewer of ``viewer_tenant`` (optionally following one job) is sent this job's change."""
    return summary_tenant == viewer_tenant and (only_job is None or only_job == job_id)


@dataclass(eq=False)
class Subscriber:
    tenant: str
    job_id: str | None
    queue: asyncio.Queue[object] = field(default_factory=lambda: asyncio.Queue(maxsize=256))
    dropped: int = 0

    def offer(self, item: object) -> None:
        """Queue ``item``; a full queue is emptied and gets a ``resync`` instead (never blocks)."""
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.dropped += 1
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(RESYNC)


Summaries = Callable[[Sequence[str]], Awaitable[dict[str, tuple[str, str]]]]
"""job ids → {job id: (tenant, JobSummary JSON)} for those that exist."""

Check = Callable[[], Awaitable[dict[str, str] | None]]
"""None while the stream may go on; else the ``closed`` event's data (``reason``, ``kind``)."""


class LiveHub:
    def __init__(self, summaries: Summaries, *, min_interval_s: float = 0.5, keepalive_s: float = 15.0,
                 recheck_s: float = 1.0) -> None:
        self.summaries = summaries
        self.min_interval_s = min_interval_s
        self.keepalive_s = keepalive_s
        self.recheck_s = recheck_s
        self.subscribers: set[Subscriber] = set()
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ inputs
    def install(self, bus: Bus) -> str:
        """Subscribe (before ``bus.start()``) in this process's own group; returns the group id."""
        group = f"{bus.group_prefix}.api-live.{uuid.uuid4().hex[:12]}"

        async def on(event: Event) -> None:
            self.on_event(event)

        bus.subscribe(JOBS, {JobSubmitted: on, JobStateChanged: on, JobControlRequested: on}, group=group,
                      offset_reset="latest", background=True)
        bus.subscribe(CHECKPOINTS, {CheckpointReady: on, CheckpointFailed: on}, group=group, offset_reset="latest",
                      background=True)
        bus.subscribe(WORKERS, {WorkerStarted: on, WorkerExited: on, AttemptEnded: on}, group=group,
                      offset_reset="latest", background=True)
        async def on_steps(batch: list[StepMetrics]) -> None:
            for event in batch:
                self.on_event(event)

        bus.subscribe_batch(METRICS, StepMetrics, on_steps, group=f"{group}-metrics", offset_reset="latest",
                            background=True)
        return group

    def on_event(self, event: Event) -> None:
        if isinstance(event, StepMetrics) and event.rank != 0:
            return
        job_id = getattr(event, "job_id", None)
        if job_id:
            self.touch(job_id)

    def touch(self, job_id: str) -> None:
        """The job changed: its summary goes out at the next flush."""
        if not self.subscribers:
            return
        self._dirty.add(job_id)
        self._wake.set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="api:live")

    async def _run(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            try:
                await self.flush(dirty)
            except Exception:  # noqa: BLE001 - a background loop logs and carries on
                log.exception("live updates: cannot send the summaries of %d jobs", len(dirty))
            await asyncio.sleep(self.min_interval_s)

    async def flush(self, job_ids: set[str]) -> None:
        if not job_ids or not self.subscribers:
            return
        found = await self.summaries(sorted(job_ids))
        for job_id, (tenant, body) in found.items():
            frame = sse("job", body)
            for sub in list(self.subscribers):
                if visible(tenant, job_id, sub.tenant, sub.job_id):
                    sub.offer(frame)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in list(self.subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait(_CLOSED)
            if sub.queue.full():
                sub.queue.get_nowait()
                sub.queue.put_nowait(_CLOSED)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------------ outputs
    async def stream(self, tenant: str, job_id: str | None, initial: Sequence[bytes] = (),
                     check: Check | None = None) -> AsyncIterator[bytes]:
        """The byte stream of one client: ``initial`` frames, then changes, keepalives, until closed; with
        ``check``, it is asked before every frame and at least every ``recheck_s`` while idle, and a refusal
        ends the stream with one ``closed`` event carrying it."""
        sub = Subscriber(tenant, job_id)
        self.subscribers.add(sub)
        clock = asyncio.get_running_loop().time
        try:
            yield b"retry: 2000\n\n"
            for frame in initial:
                yield frame
            beat = clock()
            while not self._closed:
                wait = max(0.0, self.keepalive_s - (clock() - beat))
                if check is not None:
                    wait = min(wait, self.recheck_s)
                try:
                    item: object = await asyncio.wait_for(sub.queue.get(), timeout=wait)
                except TimeoutError:
                    item = None
                if item is _CLOSED:
                    return
                if check is not None and (refusal := await check()) is not None:
                    yield sse(CLOSED, json.dumps(refusal))
                    return
                if item is None:
                    if clock() - beat >= self.keepalive_s:
                        beat = clock()
                        yield KEEPALIVE
                    continue
                yield sse(RESYNC, json.dumps({"dropped": sub.dropped})) if item == RESYNC else item  # type: ignore[misc]  # queued items are SSE frames
        finally:
            self.subscribers.discard(sub)
