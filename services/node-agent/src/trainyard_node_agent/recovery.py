"""A restarted agent's recovery (design.md §7, control-plane outage): ranks run in their own session under a
launcher that records their exit status, so the agent adopts the ranks an earlier incarnation left running
(pid + start time checked against reuse) instead of killing them, relays their spools from the persisted
offsets, and reports the ranks that ended while no agent watched them from the launcher's exit file.

Two steps, because Redis and the broker may be away at start-up: :meth:`Recovery.adopt` before them (the rank
table from Redis, else the node-local file), :meth:`Recovery.resume` once they answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from redis.exceptions import RedisError

from trainyard_node_agent import ranks as rp
from trainyard_node_agent.announcements import Announcements
from trainyard_node_agent.attempts import Attempts
from trainyard_node_agent.confinement import Confinement
from trainyard_node_agent.localstate import merge_tables
from trainyard_node_agent.rank_table import RankTable
from trainyard_node_agent.supervision import Trigger

log = logging.getLogger(__name__)


class Recovery:
    """Adopts what an earlier incarnation of this agent left, then watches or reports it."""

    def __init__(self, redis: Any, table: RankTable, attempts: Attempts, *, announcements: Announcements,
                 sandbox: Confinement, boot_id: str) -> None:
        self.redis, self.table, self.attempts = redis, table, attempts
        self.announcements, self.sandbox, self.boot_id = announcements, sandbox, boot_id

    async def adopt(self) -> None:
        """Before ``runtime.start()`` (Redis and the broker may still be down): adopt the ranks an
        earlier incarnation of this agent left running; note the ones that ended meanwhile."""
        local = self.table.local.load()
        shared: dict[str, Any] | None = None
        try:
            raw = await asyncio.wait_for(self.redis.hgetall(self.table.key), 5.0)
            shared = {k: json.loads(v) for k, v in raw.items()}
        except (TimeoutError, RedisError, OSError) as exc:
            log.warning("Redis is unreachable at start-up (%r): using the local rank table %s",
                        exc, self.table.local.path)
        await self.announcements.load()
        for key, entry in merge_tables(*(t for t in (shared, local) if t is not None)).items():
            if entry.get("boot") == self.boot_id:
                continue
            rank = rp.RankProcess.from_persisted(entry)
            running = rank.pgid > 1 and rp.same_process(rank.pgid, rank.start_ticks) and rp.alive(rank.pgid, rank.pgid)
            if shared is not None and key not in shared and not running:
                continue  # reported and forgotten already; only the local copy lagged behind
            if running:
                supervisor = self.attempts.supervisor(rank)
                supervisor.apply(Trigger.ADOPTED)
                supervisor.restart_hang_window()
                self.table.ranks[key] = supervisor
                log.warning("adopting rank %d of job %s attempt %d (pid %d), still running since the last agent",
                            rank.rank, rank.job_id, rank.attempt, rank.pid)
            else:
                self.table.unreported[key] = rank
        # what ended while no agent watched it may have left processes: its attempt's cgroup goes (not adopted ones)
        await asyncio.to_thread(self.sandbox.sweep, {(r.job_id, r.attempt) for r in self.table.records()})
        self.table.save_local(force=True)

    async def resume(self) -> None:
        """After ``runtime.start()``: watch the adopted ranks; report the ones that ended unwatched."""
        for supervisor in self.table.supervisors():
            rank = supervisor.rank
            if rank.adopted and rank.watcher is None:
                await self.table.persist(rank)
                self.attempts.watch(supervisor)
        for rank in list(self.table.unreported.values()):
            await self.attempts.report_unwatched(rank)
