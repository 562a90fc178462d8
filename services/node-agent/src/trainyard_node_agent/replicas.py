"""Fault-tolerant attempts on this node (``spec.faultTolerance``): their Lighthouse, and their replaced replicas.

:class:`Lighthouses`: the node that hosts an attempt's rank 0 runs the job's torchft Lighthouse at
``master_addr:lighthouse_port`` (:mod:`trainyard_node_agent.lighthouse`), started before the ranks; started again
when it dies while the allocation still holds its lease here; stopped when the lease is gone (the attempt ended),
the allocation is revoked, or the agent stops. A restarted agent starts the ones its allocations still need.

:class:`ReplicaRestarts`: a ReplicaReplaced for a rank of this node starts that rank again, as the generation it
names, into the running allocation. Nothing on the bus is trusted for it: the allocation must be one this agent
launched (its GangAllocated is kept in ``ty:agent:<node>:gangs``, written by the agent, never read from a file a
rank can reach), of the epoch the node knows, still holding the rank's device lease; the scheduler must have
granted exactly that generation (``ty:replica:<allocation>:<rank>``, written with the job record that decided
it); the rank must not run here now; each (allocation, rank, generation) starts at most once. A forged or
replayed ReplicaReplaced starts nothing (it is refused, and recorded among the node's refusals).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard_contract.events import GangAllocated, NodeAssignment, ReplicaReplaced
from trainyard_runtime.store import Keys

from trainyard_node_agent.admission import Launch, hosts_rendezvous, local_share
from trainyard_node_agent.clock import Clock
from trainyard_node_agent.leases import lease_holders

log = logging.getLogger(__name__)
REFUSALS_KEPT = 100
GANGS_KEPT = 256  # allocations remembered for replacements; past it, those whose leases are gone are forgotten


def holds_lease(holders: dict[int, dict[str, Any] | None], index: int, allocation_id: str) -> bool:
    holder = holders.get(index)
    return holder is not None and holder.get("allocationId") == allocation_id


@dataclass
class _Lighthouse:
    gang: GangAllocated
    device_index: int
    process: asyncio.subprocess.Process | None = None
    starts: int = 0


class Lighthouses:
    """The Lighthouses of the fault-tolerant attempts whose rank 0 runs here (see the module docstring)."""

    def __init__(self, redis: Any, node_id: str, *, log_dir: Path, clock: Clock) -> None:
        self.redis, self.node_id, self.log_dir, self.clock = redis, node_id, log_dir, clock
        self.running: dict[str, _Lighthouse] = {}  # allocation id -> its Lighthouse

    @staticmethod
    def needed(gang: GangAllocated, share: NodeAssignment) -> bool:
        return gang.lighthouse_port is not None and gang.spec.fault_tolerance is not None and hosts_rendezvous(share)

    async def ensure(self, gang: GangAllocated, share: NodeAssignment) -> None:
        """Start the attempt's Lighthouse unless it runs (before its ranks: their managers dial it at once)."""
        if not self.needed(gang, share) or gang.allocation_id in self.running:
            return
        rank0 = next(s for s in share.ranks if s.rank == 0)
        entry = _Lighthouse(gang, rank0.device_index)
        self.running[gang.allocation_id] = entry
        await self._start(entry)

    async def _start(self, entry: _Lighthouse) -> None:
        gang, ft = entry.gang, entry.gang.spec.fault_tolerance
        assert ft is not None and gang.lighthouse_port is not None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = self.log_dir / f"lighthouse-{gang.allocation_id}.log"
        with open(log_file, "ab") as out:  # noqa: ASYNC230 - a local append-only log, opened once per start
            entry.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trainyard_node_agent.lighthouse", "--bind", f"0.0.0.0:{gang.lighthouse_port}",
                "--min-replicas", str(ft.min_replicas),
                # a replica it heard of is waited for this long when the quorum changes; one that stopped
                # heartbeating (killed) is left out after the heartbeat time-out
                "--join-timeout-ms", str(int(ft.quorum_timeout_seconds * 1000 / 3)),
                "--heartbeat-timeout-ms", str(int(min(2000, ft.quorum_timeout_seconds * 1000 / 6))),
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)
        entry.starts += 1
        log.info("lighthouse of job %s attempt %d on port %d (pid %d, start %d)", gang.job_id, gang.attempt,
                 gang.lighthouse_port, entry.process.pid, entry.starts)

    async def check(self) -> None:
        """Supervision: stop the ones whose allocation no longer holds its lease here; start again the ones that
        died while it does."""
        for allocation_id, entry in list(self.running.items()):
            holders = await lease_holders(self.redis, self.node_id, [entry.device_index])
            if not holds_lease(holders, entry.device_index, allocation_id):
                await self.stop(allocation_id, "its allocation no longer holds the lease here")
            elif entry.process is not None and entry.process.returncode is not None:
                log.warning("the lighthouse of job %s exited with %s; starting it again", entry.gang.job_id,
                            entry.process.returncode)
                await self._start(entry)

    async def stop(self, allocation_id: str, why: str) -> None:
        entry = self.running.pop(allocation_id, None)
        if entry is None or entry.process is None:
            return
        log.info("stopping the lighthouse of job %s attempt %d: %s", entry.gang.job_id, entry.gang.attempt, why)
        with contextlib.suppress(ProcessLookupError):
            entry.process.terminate()
        try:
            await asyncio.wait_for(entry.process.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                entry.process.kill()
            await entry.process.wait()

    async def aclose(self) -> None:
        for allocation_id in list(self.running):
            await self.stop(allocation_id, "the node agent stops")


class ReplicaRestarts:
    """ReplicaReplaced → the rank started again as its new generation, fenced (see the module docstring)."""

    def __init__(self, redis: Any, node_id: str, keys: Any, *, launcher: Any, lighthouses: Lighthouses,
                 table: Any, clock: Clock, replicated: set[str] | None = None) -> None:
        """``replicated``: the fault-tolerant allocation ids launched here, kept up to date for the hang watchdog
        (which then stops only a late replica)."""
        self.redis, self.node_id, self.keys = redis, node_id, keys
        self.launcher, self.lighthouses, self.table, self.clock = launcher, lighthouses, table, clock
        self.replicated = replicated if replicated is not None else set()

    async def remember(self, gang: GangAllocated) -> None:
        """Keep a fault-tolerant allocation launched here (its replicas may be started again)."""
        if gang.spec.fault_tolerance is None:
            return
        self.replicated.add(gang.allocation_id)
        await self.redis.hset(self.keys.gangs, gang.allocation_id, gang.to_bytes())
        if await self.redis.hlen(self.keys.gangs) > GANGS_KEPT:
            await self.prune()

    async def prune(self) -> None:
        """Forget the remembered allocations that hold no lease here any more."""
        for allocation_id, raw in (await self.redis.hgetall(self.keys.gangs)).items():
            gang = GangAllocated.model_validate_json(raw)
            share = local_share(gang, self.node_id)
            indices = [s.device_index for s in share.ranks] if share else []
            holders = await lease_holders(self.redis, self.node_id, indices)
            if not any(holds_lease(holders, i, gang.allocation_id) for i in indices):
                await self.redis.hdel(self.keys.gangs, allocation_id)

    async def resume(self) -> None:
        """After a restart of the agent: the Lighthouses its remembered allocations still need."""
        for raw in (await self.redis.hgetall(self.keys.gangs)).values():
            gang = GangAllocated.model_validate_json(raw)
            self.replicated.add(gang.allocation_id)
            share = local_share(gang, self.node_id)
            if share is None or not Lighthouses.needed(gang, share):
                continue
            rank0 = next(s for s in share.ranks if s.rank == 0)
            if holds_lease(await lease_holders(self.redis, self.node_id, [rank0.device_index]), rank0.device_index,
                           gang.allocation_id):
                await self.lighthouses.ensure(gang, share)

    async def on_replica_replaced(self, event: ReplicaReplaced) -> None:
        if event.node_id != self.node_id:
            return
        found = await self.judge(event)
        if isinstance(found, str):
            await self._refuse(event, found)
            return
        gang, share = found
        if not await self.redis.sadd(self.keys.launched, f"{event.allocation_id}/{event.rank}@{event.generation}"):
            log.info("replica %d generation %d of %s was started here before", event.rank, event.generation,
                     event.allocation_id)
            return
        await self.launcher.launch(gang, Launch(share), generation=event.generation, only_rank=event.rank)

    async def judge(self, event: ReplicaReplaced) -> tuple[GangAllocated, NodeAssignment] | str:
        """The allocation and this rank's share of it, or why the replacement is refused."""
        raw = await self.redis.hget(self.keys.gangs, event.allocation_id)
        if raw is None:
            return f"allocation {event.allocation_id} is not a fault-tolerant allocation launched on this node"
        gang = GangAllocated.model_validate_json(raw)
        if (gang.job_id, gang.attempt, gang.epoch) != (event.job_id, event.attempt, event.epoch):
            return (f"it names job {event.job_id} attempt {event.attempt} epoch {event.epoch}; allocation "
                    f"{gang.allocation_id} is job {gang.job_id} attempt {gang.attempt} epoch {gang.epoch}")
        raw_epoch = await self.redis.hget(self.keys.epochs, gang.job_id)
        if raw_epoch is not None and int(raw_epoch) > gang.epoch:
            return f"stale epoch {gang.epoch}: epoch {int(raw_epoch)} was already seen for job {gang.job_id}"
        share = local_share(gang, self.node_id)
        slot = next((s for s in share.ranks if s.rank == event.rank), None) if share else None
        if share is None or slot is None:
            return f"rank {event.rank} of {gang.allocation_id} is not placed on {self.node_id}"
        holders = await lease_holders(self.redis, self.node_id, [slot.device_index])
        if not holds_lease(holders, slot.device_index, gang.allocation_id):
            return f"device {slot.device_index} is no longer leased to {gang.allocation_id}"
        granted = await self.redis.get(Keys.replica(gang.allocation_id, event.rank))
        if granted is None or int(granted) != event.generation:
            return (f"the scheduler granted rank {event.rank} generation {granted or 'none'}, "
                    f"not {event.generation}")
        if any(r.allocation_id == gang.allocation_id and r.rank == event.rank and r.running
               for r in self.table.records()):
            return f"rank {event.rank} of {gang.allocation_id} still runs here"
        return gang, share

    async def _refuse(self, event: ReplicaReplaced, reason: str) -> None:
        log.warning("refusing to start rank %d of %s as generation %d: %s", event.rank, event.allocation_id,
                    event.generation, reason)
        entry = json.dumps({"allocationId": event.allocation_id, "jobId": event.job_id, "epoch": event.epoch,
                            "attempt": event.attempt, "rank": event.rank, "generation": event.generation,
                            "reason": f"replica replacement refused: {reason}", "at": self.clock.wall()})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self.keys.refused, entry)
            pipe.ltrim(self.keys.refused, 0, REFUSALS_KEPT - 1)
            await pipe.execute()
