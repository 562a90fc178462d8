"""Fencing for two (or more) scheduler processes: a leader lease with an epoch, and device
leases whose grant checks that epoch inside the same Lua script.

* :class:`Leadership` — ``ty:sched:leader`` holds ``"<epoch> <instance>"`` with a TTL; a
  takeover (the key expired or was given up) increments ``ty:sched:leader-epoch``, which never
  goes down. The leader renews every tick; a standby takes over within ``ttl`` of the leader's
  last renewal.
* :class:`FencedLeases` — the gang grant of ``trainyard_common.leases`` (same keys, same audit
  stream ``ty:lease-audit``, same holder JSON that node agents read) plus a check of the leader
  epoch: a paused or partitioned old leader's grant is refused (``STALE_LEADER``). Job-record
  writes of the tick are fenced the same way with WATCH on the epoch key (see the scheduler).
  Lease TTLs are renewed by node heartbeats (:meth:`renew_node`); a live attempt whose lease
  keys expired (e.g. after a long control-plane outage) gets them back (:meth:`restore`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from trainyard_common.errors import FencingError, LeaseConflictError
from trainyard_common.leases import Device
from trainyard_common.store import Keys


class LeaderKeys:
    leader = "ty:sched:leader"  # "<epoch> <instance>", with a TTL
    epoch = "ty:sched:leader-epoch"  # takeover counter, never decreasing


# KEYS: leader, epoch   ARGV: instance, ttl_ms, my_epoch (0 = none)
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

_CHECK_LEADER = """
local le = redis.call('GET', KEYS[1])
if ARGV[1] ~= '' and ((not le) or tonumber(le) ~= tonumber(ARGV[1])) then
  return redis.error_reply('STALE_LEADER epoch ' .. ARGV[1] .. ', current ' .. tostring(le))
end
"""

# KEYS: leader-epoch, job-epoch, allocation, audit, lease...   ARGV: leader epoch, job, allocation, devices, ttl
_ACQUIRE = _CHECK_LEADER + """
for i = 5, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder then
    local h = cjson.decode(holder)
    if h.allocationId ~= ARGV[3] then
      return redis.error_reply('LEASE_CONFLICT ' .. KEYS[i] .. ' held by ' .. h.allocationId)
    end
  end
end
local existing = redis.call('GET', KEYS[3])
if existing then
  local a = cjson.decode(existing)
  if a.state == 'active' then return a.epoch end
  return redis.error_reply('ALLOCATION_RELEASED ' .. ARGV[3])
end
local epoch = redis.call('INCR', KEYS[2])
local value = cjson.encode({jobId = ARGV[2], allocationId = ARGV[3], epoch = epoch})
local ttl = tonumber(ARGV[5])
for i = 5, #KEYS do
  if ttl > 0 then redis.call('SET', KEYS[i], value, 'PX', ttl) else redis.call('SET', KEYS[i], value) end
end
redis.call('SET', KEYS[3], cjson.encode({jobId = ARGV[2], allocationId = ARGV[3], epoch = epoch,
  devices = cjson.decode(ARGV[4]), state = 'active'}))
redis.call('XADD', KEYS[4], '*', 'op', 'grant', 'job', ARGV[2], 'allocation', ARGV[3],
  'epoch', epoch, 'devices', ARGV[4], 'leader', ARGV[1])
return epoch
"""

# KEYS: leader-epoch, allocation, audit, lease...   ARGV: leader epoch ('' = unfenced), allocation, epoch
_RELEASE = _CHECK_LEADER + """
local existing = redis.call('GET', KEYS[2])
if not existing then return 0 end
local a = cjson.decode(existing)
if tonumber(ARGV[3]) < a.epoch then
  return redis.error_reply('STALE_EPOCH ' .. ARGV[3] .. ' < ' .. a.epoch)
end
if a.state ~= 'active' then return 0 end
local released = 0
for i = 4, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder and cjson.decode(holder).allocationId == ARGV[2] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
end
a.state = 'released'
redis.call('SET', KEYS[2], cjson.encode(a))
redis.call('XADD', KEYS[3], '*', 'op', 'release', 'job', a.jobId, 'allocation', ARGV[2],
  'epoch', a.epoch, 'devices', cjson.encode(a.devices))
return released
"""

# KEYS: lease...   ARGV: ttl_ms
_RENEW = """
local renewed = 0
for i = 1, #KEYS do
  if redis.call('PEXPIRE', KEYS[i], ARGV[1]) == 1 then renewed = renewed + 1 end
end
return renewed
"""

# KEYS: leader-epoch, allocation, audit, lease...   ARGV: leader epoch, allocation, epoch, ttl
_RESTORE = _CHECK_LEADER + """
local existing = redis.call('GET', KEYS[2])
if not existing then return {0, 0} end
local a = cjson.decode(existing)
if a.state ~= 'active' or tonumber(a.epoch) ~= tonumber(ARGV[3]) then return {0, 0} end
local value = cjson.encode({jobId = a.jobId, allocationId = ARGV[2], epoch = a.epoch})
local ttl = tonumber(ARGV[4])
local restored, conflicts = 0, 0
for i = 4, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if not holder then
    if ttl > 0 then redis.call('SET', KEYS[i], value, 'PX', ttl) else redis.call('SET', KEYS[i], value) end
    restored = restored + 1
  elseif cjson.decode(holder).allocationId ~= ARGV[2] then
    conflicts = conflicts + 1
  end
end
if restored > 0 then
  redis.call('XADD', KEYS[3], '*', 'op', 'restore', 'job', a.jobId, 'allocation', ARGV[2],
    'epoch', a.epoch, 'devices', cjson.encode(a.devices))
end
return {restored, conflicts}
"""


def _translate(exc: ResponseError) -> Exception:
    text = str(exc)
    if text.startswith("LEASE_CONFLICT"):
        return LeaseConflictError(text)
    return FencingError(text)


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
        """Take or renew the lease; returns the leader epoch while this instance leads, else None."""
        async with self._lock:
            result = int(await self._lead(keys=[LeaderKeys.leader, LeaderKeys.epoch],
                                          args=[self.instance, self.ttl_ms, self.epoch or 0]))
            self.epoch = result or None
            return self.epoch

    async def resign(self) -> None:
        """Give the lease up so a standby does not wait for it to expire."""
        async with self._lock:
            if self.epoch is not None:
                await self._resign(keys=[LeaderKeys.leader], args=[self.instance, self.epoch])
                self.epoch = None

    async def current(self) -> tuple[int, str] | None:
        raw = await self.redis.get(LeaderKeys.leader)
        if not raw:
            return None
        epoch, who = raw.split(" ", 1)
        return int(epoch), who


class FencedLeases:
    """Device leases granted only by the current leader (see the module docstring)."""

    def __init__(self, redis: Redis, *, ttl_ms: int = 0) -> None:
        self.redis = redis
        self.ttl_ms = ttl_ms
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)
        self._renew = redis.register_script(_RENEW)
        self._restore = redis.register_script(_RESTORE)

    async def acquire(self, leader_epoch: int, job_id: str, allocation_id: str, devices: Sequence[Device]) -> int:
        """Lease every device or none, if ``leader_epoch`` is still current; returns the job's fencing epoch."""
        keys = [LeaderKeys.epoch, Keys.epoch(job_id), Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, d.index) for d in devices]
        args = [leader_epoch, job_id, allocation_id, json.dumps([str(d) for d in devices]), self.ttl_ms]
        try:
            return int(await self._acquire(keys=keys, args=args))
        except ResponseError as exc:
            raise _translate(exc) from exc

    async def release(self, allocation_id: str, epoch: int, devices: Sequence[Device], *,
                      leader_epoch: int | None = None) -> int:
        """Release what the allocation still holds; with ``leader_epoch``, only while it is current."""
        keys = [LeaderKeys.epoch, Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, int(d.index)) for d in devices]
        args = ["" if leader_epoch is None else leader_epoch, allocation_id, epoch]
        try:
            return int(await self._release(keys=keys, args=args))
        except ResponseError as exc:
            raise _translate(exc) from exc

    async def renew_node(self, node_id: str, indices: Sequence[int]) -> int:
        """Extend the TTL of every lease on the node's devices (called per NodeHeartbeat)."""
        if not self.ttl_ms or not indices:
            return 0
        keys = [Keys.lease(node_id, i) for i in indices]
        return int(await self._renew(keys=keys, args=[self.ttl_ms]))

    async def restore(self, leader_epoch: int, allocation_id: str, epoch: int,
                      devices: Sequence[Device]) -> tuple[int, int]:
        """Re-create expired lease keys of an active allocation; returns (restored, held by others)."""
        keys = [LeaderKeys.epoch, Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, int(d.index)) for d in devices]
        try:
            restored, conflicts = await self._restore(keys=keys, args=[leader_epoch, allocation_id, epoch,
                                                                        self.ttl_ms])
        except ResponseError as exc:
            raise _translate(exc) from exc
        return int(restored), int(conflicts)
