"""Epoch-fenced device leases in Redis.

A gang's device leases are taken in one Lua script, all or nothing; each grant bumps the
job's fencing epoch (``ty:epoch:<job>``, never decreasing: Redis runs with AOF
``appendfsync always``). Every grant and release is appended to ``ty:lease-audit`` so
tests can check that no device was ever held by two live allocations.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from trainyard_common.errors import FencingError, LeaseConflictError
from trainyard_common.store import Keys

# KEYS: epoch, allocation, audit, lease...   ARGV: job, allocation, devices-json, ttl_ms
_ACQUIRE = """
local existing = redis.call('GET', KEYS[2])
if existing then
  local a = cjson.decode(existing)
  if a.state == 'active' then return a.epoch end
  return redis.error_reply('ALLOCATION_RELEASED ' .. ARGV[2])
end
for i = 4, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder then
    local h = cjson.decode(holder)
    if h.allocationId ~= ARGV[2] then
      return redis.error_reply('LEASE_CONFLICT ' .. KEYS[i] .. ' held by ' .. h.allocationId)
    end
  end
end
local epoch = redis.call('INCR', KEYS[1])
local value = cjson.encode({jobId = ARGV[1], allocationId = ARGV[2], epoch = epoch})
local ttl = tonumber(ARGV[4])
for i = 4, #KEYS do
  if ttl > 0 then redis.call('SET', KEYS[i], value, 'PX', ttl) else redis.call('SET', KEYS[i], value) end
end
redis.call('SET', KEYS[2], cjson.encode({jobId = ARGV[1], allocationId = ARGV[2], epoch = epoch,
  devices = cjson.decode(ARGV[3]), state = 'active'}))
redis.call('XADD', KEYS[3], '*', 'op', 'grant', 'job', ARGV[1], 'allocation', ARGV[2],
  'epoch', epoch, 'devices', ARGV[3])
return epoch
"""

# KEYS: allocation, audit, lease...   ARGV: allocation, epoch
_RELEASE = """
local existing = redis.call('GET', KEYS[1])
if not existing then return 0 end
local a = cjson.decode(existing)
if tonumber(ARGV[2]) < a.epoch then
  return redis.error_reply('STALE_EPOCH ' .. ARGV[2] .. ' < ' .. a.epoch)
end
if a.state ~= 'active' then return 0 end
local released = 0
for i = 3, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder and cjson.decode(holder).allocationId == ARGV[1] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
end
a.state = 'released'
redis.call('SET', KEYS[1], cjson.encode(a))
redis.call('XADD', KEYS[2], '*', 'op', 'release', 'job', a.jobId, 'allocation', ARGV[1],
  'epoch', a.epoch, 'devices', cjson.encode(a.devices))
return released
"""


@dataclass(frozen=True)
class Device:
    node_id: str
    index: int

    def __str__(self) -> str:
        return f"{self.node_id}:{self.index}"


class LeaseManager:
    def __init__(self, redis: Redis, *, ttl_ms: int = 0) -> None:
        self.redis = redis
        self.ttl_ms = ttl_ms
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self, job_id: str, allocation_id: str, devices: Sequence[Device]) -> int:
        """Lease every device for ``allocation_id`` or none; returns the new fencing epoch.

        Idempotent: calling again for the same active allocation returns its epoch.
        """
        keys = [Keys.epoch(job_id), Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, d.index) for d in devices]
        try:
            epoch = await self._acquire(
                keys=keys,
                args=[job_id, allocation_id, json.dumps([str(d) for d in devices]), self.ttl_ms],
            )
        except ResponseError as exc:
            text = str(exc)
            if text.startswith("LEASE_CONFLICT"):
                raise LeaseConflictError(text) from exc
            raise FencingError(text) from exc
        return int(epoch)

    async def release(self, allocation_id: str, epoch: int, devices: Sequence[Device]) -> int:
        """Release the devices this allocation still holds; a stale epoch is refused."""
        keys = [Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, d.index) for d in devices]
        try:
            return int(await self._release(keys=keys, args=[allocation_id, epoch]))
        except ResponseError as exc:
            raise FencingError(str(exc)) from exc

    async def current_epoch(self, job_id: str) -> int:
        return int(await self.redis.get(Keys.epoch(job_id)) or 0)

    async def holder(self, device: Device) -> dict[str, object] | None:
        raw = await self.redis.get(Keys.lease(device.node_id, device.index))
        return json.loads(raw) if raw else None
