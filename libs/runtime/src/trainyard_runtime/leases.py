"""Epoch-fenced device leases in Redis.

A gang's device leases are taken in one Lua script, all or nothing; each grant bumps the
job's fencing epoch (``ty:epoch:<job>``, never decreasing: Redis runs with AOF
``appendfsync always``). Every grant and release is appended to ``ty:lease-audit`` so
tests can check that no device was ever held by two live allocations.

Optionally a write is also fenced by a *leader epoch* (:class:`LeaderFence`): the key of a
takeover counter and the value the caller believes current. The scripts check it before
anything else, in the same atomic step, and refuse with ``STALE_LEADER`` when another
process has taken over since — so a paused or partitioned former scheduler leader can
neither grant nor release. Lease keys may carry a TTL (renewed by :meth:`LeaseManager.renew`);
:meth:`LeaseManager.restore` re-creates expired ones of a still-active allocation.

Behind Sentinel (asynchronous replication) a grant is used only once a replica acknowledged it
(:func:`trainyard_runtime.replication.eval_durably`): a failover then never hands its epoch out again
(docs/design.md §5.2.1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from trainyard_contract.devices import Device
from trainyard_contract.errors import FencingError, LeaseConflictError, StaleLeaderError
from trainyard_runtime.replication import eval_durably
from trainyard_runtime.store import Keys

__all__ = ["Device", "LeaderFence", "LeaseManager"]

# Every fenced script: KEYS[1] is the leader-epoch key and ARGV[1] the expected value ('' = unfenced;
# the key is then a placeholder and never read).
_CHECK_LEADER = """
if ARGV[1] ~= '' then
  local le = redis.call('GET', KEYS[1])
  if (not le) or tonumber(le) ~= tonumber(ARGV[1]) then
    return redis.error_reply('STALE_LEADER epoch ' .. ARGV[1] .. ', current ' .. tostring(le))
  end
end
"""

# KEYS: leader-epoch, job-epoch, allocation, audit, lease...   ARGV: leader epoch, job, allocation, devices, ttl_ms
_ACQUIRE = _CHECK_LEADER + """
local existing = redis.call('GET', KEYS[3])
if existing then
  local a = cjson.decode(existing)
  if a.state == 'active' then
    -- rewritten unchanged: a write, so that a WAIT after this script also covers the grant it repeats
    redis.call('SET', KEYS[3], existing)
    return a.epoch
  end
  return redis.error_reply('ALLOCATION_RELEASED ' .. ARGV[3])
end
for i = 5, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder then
    local h = cjson.decode(holder)
    if h.allocationId ~= ARGV[3] then
      return redis.error_reply('LEASE_CONFLICT ' .. KEYS[i] .. ' held by ' .. h.allocationId)
    end
  end
end
local epoch = redis.call('INCR', KEYS[2])
local value = cjson.encode({jobId = ARGV[2], allocationId = ARGV[3], epoch = epoch})
local ttl = tonumber(ARGV[5])
for i = 5, #KEYS do
  if ttl > 0 then redis.call('SET', KEYS[i], value, 'PX', ttl) else redis.call('SET', KEYS[i], value) end
end
redis.call('SET', KEYS[3], cjson.encode({jobId = ARGV[2], allocationId = ARGV[3], epoch = epoch,
  devices = cjson.decode(ARGV[4]), state = 'active'}))
if ARGV[1] ~= '' then
  redis.call('XADD', KEYS[4], '*', 'op', 'grant', 'job', ARGV[2], 'allocation', ARGV[3],
    'epoch', epoch, 'devices', ARGV[4], 'leader', ARGV[1])
else
  redis.call('XADD', KEYS[4], '*', 'op', 'grant', 'job', ARGV[2], 'allocation', ARGV[3],
    'epoch', epoch, 'devices', ARGV[4])
end
return epoch
"""

# KEYS: leader-epoch, allocation, audit, lease...   ARGV: leader epoch, allocation, epoch
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

# KEYS: leader-epoch, allocation, audit, lease...   ARGV: leader epoch, allocation, epoch, ttl_ms
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


@dataclass(frozen=True)
class LeaderFence:
    """A write is allowed only while the integer at ``key`` still equals ``epoch``."""

    key: str
    epoch: int


def _fence_args(fence: LeaderFence | None, placeholder: str) -> tuple[str, str | int]:
    return (placeholder, "") if fence is None else (fence.key, fence.epoch)


def _translate(exc: ResponseError) -> Exception:
    text = str(exc)
    if text.startswith("LEASE_CONFLICT"):
        return LeaseConflictError(text)
    if text.startswith("STALE_LEADER"):
        return StaleLeaderError(text)
    return FencingError(text)


class LeaseManager:
    """Grants, releases, renews and restores device leases (see the module docstring)."""

    def __init__(self, redis: Redis, *, ttl_ms: int = 0) -> None:
        self.redis = redis
        self.ttl_ms = ttl_ms
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)
        self._renew = redis.register_script(_RENEW)
        self._restore = redis.register_script(_RESTORE)

    async def acquire(self, job_id: str, allocation_id: str, devices: Sequence[Device], *,
                      fence: LeaderFence | None = None) -> int:
        """Lease every device for ``allocation_id`` or none; returns the new fencing epoch.

        Idempotent: calling again for the same active allocation returns its epoch. With
        ``fence``, refused (FencingError ``STALE_LEADER``) unless the leader epoch is still current.
        Behind Sentinel the epoch is returned only once a replica has it; otherwise
        :class:`EpochNotReplicatedError` (retryable: the same call returns the same epoch once it is
        replicated; a grant never retried is an orphan that reconciliation releases).
        """
        fence_key, fence_value = _fence_args(fence, Keys.epoch(job_id))
        keys = [fence_key, Keys.epoch(job_id), Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, int(d.index)) for d in devices]
        args = [fence_value, job_id, allocation_id, json.dumps([str(d) for d in devices]), self.ttl_ms]
        try:
            return int(await eval_durably(self.redis, self._acquire, keys, args))
        except ResponseError as exc:
            raise _translate(exc) from exc

    async def release(self, allocation_id: str, epoch: int, devices: Sequence[Device], *,
                      fence: LeaderFence | None = None) -> int:
        """Release the devices this allocation still holds; a stale epoch (or leader, with ``fence``) is refused."""
        fence_key, fence_value = _fence_args(fence, Keys.allocation(allocation_id))
        keys = [fence_key, Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, int(d.index)) for d in devices]
        try:
            return int(await self._release(keys=keys, args=[fence_value, allocation_id, epoch]))
        except ResponseError as exc:
            raise _translate(exc) from exc

    async def renew(self, node_id: str, indices: Sequence[int]) -> int:
        """Extend the TTL of every lease on these devices of ``node_id`` (a heartbeat); returns how many."""
        if not self.ttl_ms or not indices:
            return 0
        keys = [Keys.lease(node_id, int(i)) for i in indices]
        return int(await self._renew(keys=keys, args=[self.ttl_ms]))

    async def stage_renew(self, pipe: Any, node_id: str, indices: Sequence[int]) -> None:
        """:meth:`renew` staged in the caller's pipeline (its result is the pipeline's)."""
        if self.ttl_ms and indices:
            await self._renew(keys=[Keys.lease(node_id, int(i)) for i in indices], args=[self.ttl_ms], client=pipe)

    async def restore(self, allocation_id: str, epoch: int, devices: Sequence[Device], *,
                      fence: LeaderFence | None = None) -> tuple[int, int]:
        """Re-create expired lease keys of an active allocation; returns (restored, held by others)."""
        fence_key, fence_value = _fence_args(fence, Keys.allocation(allocation_id))
        keys = [fence_key, Keys.allocation(allocation_id), Keys.lease_audit]
        keys += [Keys.lease(d.node_id, int(d.index)) for d in devices]
        try:
            restored, conflicts = await self._restore(keys=keys, args=[fence_value, allocation_id, epoch,
                                                                        self.ttl_ms])
        except ResponseError as exc:
            raise _translate(exc) from exc
        return int(restored), int(conflicts)

    async def current_epoch(self, job_id: str) -> int:
        return int(await self.redis.get(Keys.epoch(job_id)) or 0)

    async def holder(self, device: Device) -> dict[str, object] | None:
        raw = await self.redis.get(Keys.lease(device.node_id, device.index))
        return json.loads(raw) if raw else None
