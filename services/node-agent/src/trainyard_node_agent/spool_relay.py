"""The spool relay: publishes what each rank appends to its events file, in order, as the agent renders it.

Every line goes through :func:`~trainyard_node_agent.relay.check_line` (what a rank may say, about
itself) and, for a ShardWritten, a look at where its files really are (a symlink out of the job's
prefix is a forgery too). A refused line is dead-lettered with the reason; a forgery is handed to the
``violation`` callback (the agent stops the allocation's ranks and reports SecurityViolation).

Order only matters within a topic (docs/design.md §4.1). A line the broker refuses holds up the lines
behind it, except checkpoint reports: those are published ahead of it (once; the in-order pass skips
them when it gets there), so a partition that refuses StepMetrics for a while (seen for 30 s after the
embedded broker restarted empty) never keeps a durable checkpoint from becoming READY. The saved
offset stays at the first unpublished line, so a restarted agent publishes the ones sent ahead again
(same event ids: deduplicated).

What a rank writes never wedges the relay: a line that is not UTF-8 JSON is dead-lettered (the reader
yields it as corrupt), and so is a line whose handling raises an error that retrying could not cure
(:data:`UNRELAYABLE`: the same bytes would fail the same way); the lines after it are relayed. Only
the broker or Redis being away holds a spool up. The spool is read in a worker thread, as a rank's
file (a FIFO or symlink in its place is refused: :class:`~trainyard_contract.rankfiles.RankFileRefused`),
and :meth:`SpoolRelay.drain` gives up on such a spool at once, with the reason, instead of retrying.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import Counter

from trainyard_runtime.bus import Bus
from trainyard_contract.events import CHECKPOINTS, DeadLetter, ShardWritten, StepMetrics
from trainyard_contract.rankfiles import RankFileRefused
from trainyard_contract.spool import SpoolReader
from trainyard_contract.storage import ArtifactLayout, uri_to_path

from trainyard_node_agent import backoff
from trainyard_node_agent.announcements import Announcements
from trainyard_node_agent.clock import Clock
from trainyard_node_agent.confirmation import Announcement
from trainyard_node_agent.ranks import RankProcess
from trainyard_node_agent.relay import RankIdentity, Refusal, check_line

log = logging.getLogger(__name__)
RELAY_REFUSED = Counter("trainyard_node_agent_spool_refused_total",
                        "spool lines not relayed: kind=violation (a claim a rank may not make: the job fails) "
                        "or malformed (unreadable; dead-lettered)", ["kind"])

# Errors the same spool line raises every time: retrying cannot help, so the line is dead-lettered.
UNRELAYABLE = (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError)

Persist = Callable[[RankProcess], Awaitable[None]]
Violation = Callable[[RankProcess, Refusal], Awaitable[None]]


def _event_id(record: Mapping[str, Any]) -> str | None:
    payload = record.get("payload")
    return str(payload["eventId"]) if isinstance(payload, dict) and "eventId" in payload else None


async def _read_new(spool: SpoolReader) -> list[tuple[int, dict[str, Any]]]:
    """The spool's new lines, read in a worker thread (bounded: SpoolReader.READ_BYTES a call)."""
    return await asyncio.to_thread(lambda: list(spool.read_new()))


class SpoolRelay:
    """Relays the spools of this node's ranks onto ``bus``.

    ``persist`` records a rank (and its spool offset) after lines were published; ``violation`` is told
    of a line that is a forgery; ``closing`` bounds :meth:`drain`'s patience once the agent stops.
    """

    def __init__(self, bus: Bus, *, layout: ArtifactLayout, group: str, announcements: Announcements,
                 persist: Persist, violation: Violation, closing: Callable[[], bool], clock: Clock) -> None:
        self.bus, self.layout, self.group, self.announcements = bus, layout, group, announcements
        self.persist, self.violation, self.closing, self.clock = persist, violation, closing, clock
        self._sent_ahead: dict[str, set[str]] = {}  # rank key -> event ids relayed ahead of a held-up line
        self._failing: set[str] = set()  # rank keys whose spool the broker refuses now (logged once)

    async def relay(self, rank: RankProcess, *, quiet: bool = False) -> int:
        """Publish the spool lines written since the last call, in order; returns how many. ``quiet``: a
        failure is logged (once per outage) instead of raised; the lines wait in the spool."""
        published = 0
        ahead = self._sent_ahead.setdefault(rank.key, set())
        try:
            for offset, record in await _read_new(rank.spool):
                event_id = _event_id(record)
                if event_id is not None and event_id in ahead:
                    ahead.discard(event_id)  # published already, ahead of a line that was held up
                else:
                    try:
                        await self._publish_or_dead_letter(rank, offset, record)
                    except Exception:
                        if record.get("topic") != CHECKPOINTS:
                            published += await self._checkpoints_ahead(rank, ahead)
                        raise
                rank.spool.offset = offset
                published += 1
            if rank.key in self._failing:
                log.info("relaying the spool of rank %s works again", rank.key)
                self._failing.discard(rank.key)
        except Exception as exc:
            if not quiet:
                raise
            if rank.key not in self._failing:  # once per outage, not once per poll
                log.warning("relaying the spool of rank %s: %r (events wait in the spool; retrying)", rank.key, exc)
            self._failing.add(rank.key)
        if published:
            await self.persist(rank)
        return published

    async def drain(self, rank: RankProcess) -> str | None:
        """Relay until the spool is empty; retry while the broker is away (for 10 s more once closing).
        Returns why the rest of the spool was given up at once (a spool that is no regular file), else None."""
        refused: list[str] = []

        async def relay_all() -> None:
            try:
                while await self.relay(rank):
                    pass
            except RankFileRefused as exc:  # the same next time: never retried
                refused.append(str(exc))

        if not await backoff.retry(relay_all, policy=backoff.INFRASTRUCTURE, clock=self.clock,
                                   give_up=backoff.ClosingGrace(self.closing, self.clock, 10.0),
                                   what=f"draining the spool of {rank.key}"):
            log.error("the spool of %s stays unrelayed from offset %d", rank.key, rank.spool.offset)
        if refused:
            log.error("rank %s: %s; the rest of its spool is not relayed", rank.key, refused[0])
            return refused[0]
        return None

    def forget(self, key: str) -> None:
        """The rank ``key`` is gone from this node: drop what the relay kept about it."""
        self._sent_ahead.pop(key, None)
        self._failing.discard(key)

    async def _checkpoints_ahead(self, rank: RankProcess, ahead: set[str]) -> int:
        """Publish the checkpoint reports past the held-up line; returns how many (noted in ``ahead``)."""
        sent = 0
        for offset, record in await _read_new(SpoolReader(rank.spool.path, rank.spool.offset)):
            event_id = _event_id(record)
            if record.get("topic") != CHECKPOINTS or "corrupt" in record or event_id is None or event_id in ahead:
                continue
            try:
                await self._publish(rank, offset, record)
            except Exception:  # noqa: BLE001 - the checkpoints topic refuses too: everything waits in the spool
                break
            ahead.add(event_id)
            sent += 1
        if sent:
            log.warning("rank %s: published %d checkpoint report(s) ahead of a spool line the broker refuses",
                        rank.key, sent)
        return sent

    async def _publish_or_dead_letter(self, rank: RankProcess, offset: int, record: dict[str, Any]) -> None:
        """:meth:`_publish`; a line it fails on for good (:data:`UNRELAYABLE`) is dead-lettered, not retried."""
        try:
            await self._publish(rank, offset, record)
        except UNRELAYABLE as exc:
            log.warning("rank %s: spool line ending at %d cannot be relayed (%r): dead-lettered", rank.key, offset, exc)
            await self._refuse(rank, offset, record, Refusal(f"spool line that cannot be relayed: {exc!r}"[:500],
                                                             violation=False))

    async def _publish(self, rank: RankProcess, offset: int, record: dict[str, Any]) -> None:
        """Publish one spool line if the rank may say it (relay.check_line), as the agent renders it;
        else dead-letter it with the reason, and hand a forgery to ``violation``."""
        checked = check_line(record, self._identity(rank), offset=offset)
        if not isinstance(checked, Refusal) and isinstance(checked.event, ShardWritten):
            checked = self._shard_files_stay_inside(checked.event, rank) or checked
        if isinstance(checked, Refusal):
            await self._refuse(rank, offset, record, checked)
            return
        event = checked.event
        if isinstance(event, StepMetrics):
            rank.last_step = event.step
        await self.bus.publish_raw_traced(checked.topic, checked.body, key=checked.key,
                                          traceparent=checked.traceparent)
        if isinstance(event, ShardWritten):
            rank.saved_step = max(rank.saved_step or 0, event.global_step)
            await self.announcements.remember(Announcement(
                event_id=str(event.event_id), kind="shard", topic=checked.topic, key=checked.key,
                payload=checked.body.decode(), traceparent=checked.traceparent, job_id=rank.job_id,
                attempt=event.attempt, allocation_id=rank.allocation_id, rank=event.rank, step=event.global_step,
                epoch=event.epoch,
            ))

    async def _refuse(self, rank: RankProcess, offset: int, record: dict[str, Any], refusal: Refusal) -> None:
        """Dead-letter a refused line with the reason; a forgery goes on to ``violation``."""
        RELAY_REFUSED.labels(kind="violation" if refusal.violation else "malformed").inc()
        try:
            raw = record.get("corrupt") or json.dumps(record)
        except UNRELAYABLE:  # a record json cannot write back (nested too deep, …)
            raw = repr(record)[:4096]
        await self.bus.publish(DeadLetter(
            source_topic=f"spool:{rank.spool.path}", partition=rank.rank, offset=offset,
            consumer_group=self.group, raw_b64=base64.b64encode(str(raw).encode()).decode(),
            error=("security: " if refusal.violation else "") + refusal.reason,
        ), traceparent=rank.traceparent)
        if refusal.violation:
            await self.violation(rank, refusal)

    def _identity(self, rank: RankProcess) -> RankIdentity:
        return RankIdentity(
            job_id=rank.job_id, tenant=rank.tenant, attempt=rank.attempt, allocation_id=rank.allocation_id,
            epoch=rank.epoch, rank=rank.rank, checkpoints=str(self.layout.checkpoints_dir(rank.tenant, rank.job_id)),
            start_manifest_uri=rank.start_manifest_uri, traceparent=rank.traceparent,
        )

    def _shard_files_stay_inside(self, event: ShardWritten, rank: RankProcess) -> Refusal | None:
        """A shard under the job's prefix by name could still be a symlink out of it: resolve it. (An object
        store has no links: its keys were checked by name.)"""
        if self.layout.remote:
            return None
        prefix = os.path.realpath(self.layout.checkpoints_dir(rank.tenant, rank.job_id))
        for uri in (event.uri, *(f.uri for f in event.extra_files)):
            try:
                real = os.path.realpath(uri_to_path(uri))
            except Exception:  # noqa: BLE001 - an unsupported URI was refused by check_line already
                continue
            if not real.startswith(prefix.rstrip("/") + "/"):
                return Refusal(f"ShardWritten names {uri!r}, which resolves to {real}, outside the job's "
                               f"checkpoint prefix", violation=True, event_type="ShardWritten")
        return None
