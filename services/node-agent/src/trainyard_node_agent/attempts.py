"""An attempt's life on this node, as one unit of processes: its scope opens while its ranks are launched,
each rank is watched by its supervisor until its exit is reported, and once no rank of it is launching or on
the table any more its containment is closed (what it left killed, its cgroup and private /dev/shm removed;
:mod:`confinement`). Ranks of user code pin their code tree and environment; the caches are collected once they
end.

The launch race: a rank that ends at once must not close its attempt under the ranks still to start, so an
attempt being launched stays open (:meth:`Attempts.launching`) even while none of its ranks is on the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from trainyard_contract.codetree import archive_hex

from trainyard_node_agent import ranks as rp
from trainyard_node_agent.codecache import CodeCache
from trainyard_node_agent.confinement import Confinement
from trainyard_node_agent.envcache import EnvCache
from trainyard_node_agent.rank_table import RankTable
from trainyard_node_agent.spool_relay import SpoolRelay
from trainyard_node_agent.supervisor import RankSupervisor, SupervisorContext

log = logging.getLogger(__name__)


class Attempts:
    """Watches the ranks of the table until their exits are reported, and closes each attempt's containment."""

    def __init__(self, table: RankTable, context: SupervisorContext, *, sandbox: Confinement,
                 spool_relay: SpoolRelay, code_cache: CodeCache, env_cache: EnvCache | None = None) -> None:
        self.table, self.context, self.sandbox = table, context, sandbox
        self.spool_relay, self.code_cache, self.env_cache = spool_relay, code_cache, env_cache
        # attempts whose ranks here are being launched: their scope stays open even while none of them is on the
        # table yet (a rank that ended at once must not close it under the ranks still to start)
        self._launching: set[tuple[str, int]] = set()

    def supervisor(self, rank: rp.RankProcess) -> RankSupervisor:
        return RankSupervisor(rank, self.context)

    @contextlib.asynccontextmanager
    async def launching(self, job_id: str, attempt: int) -> AsyncIterator[None]:
        """The attempt's scope stays open while its ranks here start; closed after when none of them started."""
        self._launching.add((job_id, attempt))
        try:
            yield
        finally:
            self._launching.discard((job_id, attempt))
            await self.maybe_close(job_id, attempt)

    def watch(self, supervisor: RankSupervisor) -> None:
        """Start the rank's watcher (:meth:`_watch`)."""
        rank = supervisor.rank
        rank.watcher = asyncio.create_task(self._watch(supervisor), name=f"rank-{rank.key}")

    async def _watch(self, supervisor: RankSupervisor) -> None:
        """Run the rank's supervisor until its exit is reported, then take the rank off the table."""
        rank = supervisor.rank
        try:
            await supervisor.run()
            await self.forget(rank)
            if rank.code_archive:
                await self.collect_code()
        except Exception:
            log.exception("watching rank %s failed", rank.key)
        finally:
            self.table.ranks.pop(rank.key, None)
            self.table.mark_changed()
            await self.maybe_close(rank.job_id, rank.attempt)

    async def report_unwatched(self, rank: rp.RankProcess) -> None:
        """A rank that ended while no agent watched it: its supervisor reports it, then it is forgotten."""
        await self.supervisor(rank).report_unwatched()
        await self.forget(rank)

    async def forget(self, rank: rp.RankProcess) -> None:
        self.spool_relay.forget(rank.key)
        await self.table.forget(rank)

    async def maybe_close(self, job_id: str, attempt: int) -> None:
        """Once no rank of the attempt runs here any more, kill what it left and remove its cgroup and /dev/shm."""
        if (job_id, attempt) not in self._launching and not self.table.has_attempt(job_id, attempt):
            try:
                await asyncio.to_thread(self.sandbox.close_attempt, job_id, attempt)
            except OSError as exc:
                log.error("closing attempt %d of %s: %r", attempt, job_id, exc)

    async def collect_code(self) -> None:
        """Delete quarantined code trees and environments no live rank uses; evict least recently used ones past
        each cache's limit (never one a live rank uses). After a tree or environment was built, and after a rank
        of user code ended."""
        records = [r for r in self.table.records() if r.running]
        for cache, in_use in ((self.code_cache, {archive_hex(r.code_archive) for r in records if r.code_archive}),
                              (self.env_cache, {archive_hex(r.environment) for r in records if r.environment})):
            if cache is None:
                continue
            try:
                await cache.acollect(in_use)
            except OSError as exc:
                log.warning("collecting the %s cache %s: %r", cache.what, cache.root, exc)
