"""End-to-end confirmation of what the agent announced (WorkerStarted, WorkerExited, a rank's
ShardWritten): each is remembered (in memory and in Redis, so a restarted agent keeps waiting) until the
state store shows it applied or moot (:func:`~trainyard_node_agent.confirmation.explain` decides), and
published again meanwhile: a broker that lost it (restarted empty) gets it once more."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from prometheus_client import Counter
from redis.exceptions import RedisError

from trainyard_contract.events import Event
from trainyard_contract.records import checkpoint_id
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import Keys

from trainyard_node_agent.clock import Clock
from trainyard_node_agent.confirmation import Announcement, Verdict, explain
from trainyard_node_agent.ranks import RankProcess
from trainyard_node_agent.settings import NodeAgentSettings

log = logging.getLogger(__name__)
DROPPED = Counter("trainyard_node_agent_announcements_dropped_total",
                  "announcements no longer waited for although never seen applied (moot, or given up)", ["kind"])


class Announcements:
    """The announcements not yet seen applied; ``key`` is their Redis hash (event id -> Announcement)."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, key: str, clock: Clock) -> None:
        self.runtime, self.settings, self.key, self.clock = runtime, settings, key, clock
        self.pending: dict[str, Announcement] = {}

    async def load(self) -> None:
        """What an earlier incarnation still waited for (its clocks start again now); nothing if Redis is away."""
        try:
            raw = await asyncio.wait_for(self.runtime.redis.hgetall(self.key), 5.0)
            now = self.clock.monotonic()
            for text in raw.values():
                a = Announcement(**json.loads(text))
                a.first_at, a.last_at = now, now
                self.pending[a.event_id] = a
        except (RedisError, OSError, asyncio.TimeoutError, TypeError, ValueError):
            pass

    async def track(self, event: Event, kind: str, rank: RankProcess, traceparent: str | None) -> None:
        await self.remember(Announcement(
            event_id=str(event.event_id), kind=kind, topic=event.topic, key=event.key(),  # type: ignore[arg-type]  # topic: every rank event has one
            payload=event.to_bytes().decode(), traceparent=traceparent, job_id=rank.job_id, attempt=rank.attempt,
            allocation_id=rank.allocation_id, rank=rank.rank, generation=rank.generation,
        ))

    async def remember(self, a: Announcement) -> None:
        a.first_at = a.last_at = self.clock.monotonic()
        self.pending[a.event_id] = a
        try:
            await self.runtime.redis.hset(self.key, a.event_id, json.dumps(a.__dict__))
        except (RedisError, OSError):
            pass  # kept in memory; only a restart during the same outage would forget it

    async def confirm(self) -> None:
        """Drop what Redis shows applied (or moot); publish the rest again."""
        now = self.clock.monotonic()
        due = [a for a in list(self.pending.values()) if now - a.last_at >= self.settings.confirm_after_s]
        jobs: dict[str, Any] = {}
        for a in due:
            if a.job_id not in jobs:
                jobs[a.job_id] = await self.runtime.store.get_job(a.job_id)
            outcome = await self._outcome(a, jobs[a.job_id], now)
            if outcome != "pending":
                self.pending.pop(a.event_id, None)
                await self.runtime.redis.hdel(self.key, a.event_id)
                continue
            await self.runtime.bus.publish_raw_traced(a.topic, a.payload.encode(), key=a.key,
                                                      traceparent=a.traceparent)
            a.last_at, a.republished = self.clock.monotonic(), a.republished + 1
            log.warning("published %s of job %s attempt %d rank %d%s again: not applied after %.0fs "
                        "(lost with the broker?)", a.kind, a.job_id, a.attempt, a.rank,
                        f" step {a.step}" if a.step is not None else "", now - a.first_at)

    async def _outcome(self, a: Announcement, job: Any, now: float) -> Verdict:
        """confirmed | pending | moot (given up on when pending for longer than ``confirm_max_age_s``)."""
        redis = self.runtime.redis
        recorded, state = False, None
        if a.kind == "shard" and a.step is not None:
            recorded = bool(await redis.hexists(Keys.shards(a.job_id, a.attempt, a.step), str(a.rank)))
            raw = await redis.hget(Keys.checkpoints(a.job_id), checkpoint_id(a.step, a.attempt))
            state = json.loads(raw).get("state") if raw else None
        outcome, why = explain(a, job, shard_recorded=recorded, checkpoint_state=state)
        if outcome == "pending" and now - a.first_at > self.settings.confirm_max_age_s:
            log.error("giving up on %s %s of %s rank %d: never applied", a.kind, a.event_id, a.job_id, a.rank)
            outcome = "moot"
            DROPPED.labels(a.kind).inc()
        elif outcome == "moot":
            DROPPED.labels(a.kind).inc()
            log.info("dropping %s of job %s attempt %d rank %d%s: never applied and it never will be: %s",
                     a.kind, a.job_id, a.attempt, a.rank, f" step {a.step}" if a.step is not None else "", why)
        return outcome
