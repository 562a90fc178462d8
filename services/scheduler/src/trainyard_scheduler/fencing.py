"""Fencing for two (or more) scheduler processes: a leader lease with an epoch, and device
leases whose grant checks that epoch inside the same Lua script.

* :class:`Leadership` — ``ty:sched:leader`` holds ``"<epoch> <instance>"`` with a TTL; a
  takeover (the key expired or was given up) increments ``ty:sched:leader-epoch``, which never
  goes down. The leader renews every tick; a standby takes over within ``ttl`` of the leader's
  last renewal. Behind Sentinel a takeover waits for a replica to hold its epoch (§5.2.1).
* :class:`FencedLeases` — :class:`trainyard_runtime.leases.LeaseManager` with its optional leader
  fence bound to ``ty:sched:leader-epoch`` (checked inside the same Lua script as the grant): a
  paused or partitioned old leader's grant is refused (``STALE_LEADER``). Job-record
  writes of the tick are fenced the same way with WATCH on the epoch key (see the scheduler).
  Lease TTLs are renewed by node heartbeats (:meth:`renew_node`); a live attempt whose lease
  keys expired (e.g. after a long control-plane outage) gets them back (:meth:`restore`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from trainyard_contract.errors import EpochNotReplicatedError
from trainyard_runtime.leases import Device, LeaderFence, LeaseManager
from trainyard_runtime.replication import epoch_acks, eval_durably
from trainyard_runtime.store import Keys

log = logging.getLogger(__name__)


class LeaderKeys:
    leader = Keys.sched_leader  # "<epoch> <instance>", with a TTL
    epoch = Keys.sched_leader_epoch  # takeover counter, never decreasing


# KEYS: leader, epoch   ARGV: instance, ttl_ms, my_epoch (0 = none), take (1: may take over; 0: return -1 instead,
# so that a takeover can be made in a call that waits for a replica, while renewals do not wait)
_LEAD = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local sep = string.find(cur, ' ', 1, true)
  if not sep then return 0 end
  local e = tonumber(string.sub(cur, 1, sep - 1))
  local who = string.sub(cur, sep + 1)
  if who ~= ARGV[1] then return 0 end
  if e == tonumber(ARGV[3]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return e
  end
end
if ARGV[4] == '0' then return -1 end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], epoch .. ' ' .. ARGV[1], 'PX', ARGV[2])
return epoch
"""

# KEYS: leader   ARGV: instance, epoch
_RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[2] .. ' ' .. ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Leadership:
    """The fenced leader lease of one scheduler instance."""

    def __init__(self, redis: Redis, instance: str, *, ttl_s: float) -> None:
        self.redis = redis
        self.instance = instance
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.epoch: int | None = None
        self._lock = asyncio.Lock()  # one renewal at a time: a race with itself would look like a takeover
        self._lead = redis.register_script(_LEAD)
        self._resign = redis.register_script(_RESIGN)

    async def maintain(self) -> int | None:
        """Take or renew the lease; returns the leader epoch while this instance leads, else None.

        Behind Sentinel a takeover counts only once a replica acknowledged its epoch (§5.2.1): until
        then this instance does not lead (None), and the next call takes over again with a new epoch.
        """
        keys = [LeaderKeys.leader, LeaderKeys.epoch]
        args: list[str | int] = [self.instance, self.ttl_ms, self.epoch or 0]
        async with self._lock:
            durable = epoch_acks(self.redis).replicas > 0
            result = int(await self._lead(keys=keys, args=[*args, 0 if durable else 1]))
            if result == -1:  # a takeover: made in a call that waits for a replica
                try:
                    result = int(await eval_durably(self.redis, self._lead, keys, [*args, 1]))
                except EpochNotReplicatedError as exc:
                    log.warning("leader takeover not used: %s", exc)
                    result = 0
            self.epoch = result or None
            return self.epoch

    async def resign(self) -> None:
        """Give the lease up so a standby does not wait for it to expire."""
        async with self._lock:
            if self.epoch is not None:
                await self._resign(keys=[LeaderKeys.leader], args=[self.instance, self.epoch])
                self.epoch = None

    async def current(self) -> tuple[int, str] | None:
        raw: str | None = await self.redis.get(LeaderKeys.leader)  # type: ignore[assignment]  # decoded: str
        if not raw:
            return None
        epoch, who = raw.split(" ", 1)
        return int(epoch), who


class FencedLeases:
    """Device leases granted only by the current leader: :class:`LeaseManager` with a leader fence."""

    def __init__(self, redis: Redis, *, ttl_ms: int = 0) -> None:
        self.redis = redis
        self.ttl_ms = ttl_ms
        self._leases = LeaseManager(redis, ttl_ms=ttl_ms)

    async def acquire(self, leader_epoch: int, job_id: str, allocation_id: str, devices: Sequence[Device]) -> int:
        """Lease every device or none, if ``leader_epoch`` is still current; returns the job's fencing epoch."""
        return await self._leases.acquire(job_id, allocation_id, devices, fence=_fence(leader_epoch))

    async def release(self, allocation_id: str, epoch: int, devices: Sequence[Device], *,
                      leader_epoch: int | None = None) -> int:
        """Release what the allocation still holds; with ``leader_epoch``, only while it is current."""
        fence = None if leader_epoch is None else _fence(leader_epoch)
        return await self._leases.release(allocation_id, epoch, devices, fence=fence)

    async def renew_node(self, node_id: str, indices: Sequence[int]) -> int:
        """Extend the TTL of every lease on the node's devices (called per NodeHeartbeat)."""
        return await self._leases.renew(node_id, indices)

    async def stage_renew_node(self, pipe: Any, node_id: str, indices: Sequence[int]) -> None:
        """:meth:`renew_node` staged in the caller's pipeline (many nodes' heartbeats in one round trip)."""
        await self._leases.stage_renew(pipe, node_id, indices)

    async def restore(self, leader_epoch: int, allocation_id: str, epoch: int,
                      devices: Sequence[Device]) -> tuple[int, int]:
        """Re-create expired lease keys of an active allocation; returns (restored, held by others)."""
        return await self._leases.restore(allocation_id, epoch, devices, fence=_fence(leader_epoch))


def _fence(leader_epoch: int) -> LeaderFence:
    return LeaderFence(LeaderKeys.epoch, leader_epoch)
