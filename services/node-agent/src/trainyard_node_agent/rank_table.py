"""The rank table: the supervisor of every rank launched or adopted here, the ranks that ended while no agent
watched them, and their durable copies — a Redis hash (``AgentKeys.ranks``) and a node-local file (read when
Redis is down at start-up; design.md §7). A restarted agent adopts from it.

Only the table writes those copies; the other parts ask it (:meth:`RankTable.persist`, :meth:`forget`) and
query it (the running ranks, an allocation's ranks, the ones the watchdogs look after).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from redis.exceptions import RedisError

from trainyard_node_agent import ranks as rp
from trainyard_node_agent.clock import Clock
from trainyard_node_agent.localstate import LocalState
from trainyard_node_agent.supervision import watched
from trainyard_node_agent.supervisor import RankSupervisor

log = logging.getLogger(__name__)


class RankTable:
    """Rank key → supervisor, with the table's copies in Redis (``key``) and in ``local``."""

    def __init__(self, redis: Any, key: str, local: LocalState, *, boot_id: str, clock: Clock) -> None:
        self.redis, self.key, self.local, self.boot_id, self.clock = redis, key, local, boot_id, clock
        self.ranks: dict[str, RankSupervisor] = {}  # rank key -> the supervisor of a rank launched or adopted here
        self.unreported: dict[str, rp.RankProcess] = {}  # ended while no agent watched them
        self.changed_at = float("-inf")  # monotonic time a rank last started or ended here

    def add(self, supervisor: RankSupervisor) -> None:
        self.ranks[supervisor.rank.key] = supervisor

    def mark_changed(self) -> None:
        """A rank started or ended just now (the warm pool waits for quiet)."""
        self.changed_at = self.clock.monotonic()

    # ------------------------------------------------------------------ queries
    def records(self) -> list[rp.RankProcess]:
        return [s.rank for s in self.ranks.values()]

    def supervisors(self) -> list[RankSupervisor]:
        return list(self.ranks.values())

    def of_allocation(self, allocation_id: str) -> list[RankSupervisor]:
        return [s for s in self.ranks.values() if s.rank.allocation_id == allocation_id]

    def looked_after(self) -> list[RankSupervisor]:
        """The running ranks the hang watchdog, the lease check and a drain look after."""
        return [s for s in self.ranks.values() if s.rank.running and watched(s.rank.state)]

    def running_jobs(self) -> list[str]:
        return sorted({r.job_id for r in self.records() if r.running})

    def running_allocations(self) -> list[str]:
        return sorted({r.allocation_id for r in self.records() if r.running})

    def has_attempt(self, job_id: str, attempt: int) -> bool:
        return any(r.job_id == job_id and r.attempt == attempt for r in self.records())

    # ------------------------------------------------------------------ the durable copies
    async def persist(self, rank: rp.RankProcess, *, force_local: bool = False) -> None:
        """Record the rank (and its spool offset) in Redis and in the node-local table."""
        try:
            await self.redis.hset(self.key, rank.key, json.dumps(rank.persisted(self.boot_id)))
        except (RedisError, OSError) as exc:
            log.debug("could not record rank %s in Redis: %r (the local table has it)", rank.key, exc)
        self.save_local(force=force_local)

    async def forget(self, rank: rp.RankProcess) -> None:
        """Its exit is reported: off the table and its copies."""
        self.unreported.pop(rank.key, None)
        try:
            await self.redis.hdel(self.key, rank.key)
        except (RedisError, OSError) as exc:  # a later agent reports it again: a harmless duplicate
            log.warning("could not remove rank %s from Redis: %r", rank.key, exc)
        self.ranks.pop(rank.key, None)
        self.save_local(force=True)

    def save_local(self, *, force: bool = False) -> None:
        ranks = {**self.unreported, **{key: s.rank for key, s in self.ranks.items()}}
        table = {key: rank.persisted(self.boot_id) for key, rank in ranks.items()}
        self.local.save(table, force=force)

    async def flush_local(self) -> None:
        """The local-state loop: write the local table when a change is still unwritten (writes are throttled)."""
        if self.local.dirty:
            self.save_local(force=True)
