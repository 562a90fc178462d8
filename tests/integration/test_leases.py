"""Epoch-fenced, all-or-nothing device leases in a real Redis."""

from __future__ import annotations

import asyncio

import pytest

from trainyard_contract.errors import FencingError, LeaseConflictError
from trainyard_runtime.leases import Device, LeaderFence, LeaseManager
from trainyard_runtime.store import Keys


@pytest.fixture
async def leases(env: dict):
    from trainyard_runtime.store import connect_redis

    client = connect_redis(env["redis_url"])
    yield LeaseManager(client)
    await client.aclose()


D = [Device("n0", i) for i in range(4)]


async def test_gang_is_all_or_nothing(leases: LeaseManager) -> None:
    e1 = await leases.acquire("job-a", "alloc-a1", D[:2])
    assert e1 == 1
    with pytest.raises(LeaseConflictError, match="held by alloc-a1"):
        await leases.acquire("job-b", "alloc-b1", D[1:3])
    # nothing of the failed gang was taken
    assert await leases.holder(D[2]) is None
    assert (await leases.holder(D[1]))["allocationId"] == "alloc-a1"


async def test_acquire_is_idempotent_and_epochs_only_grow(leases: LeaseManager) -> None:
    e1 = await leases.acquire("job-a", "alloc-1", D[:2])
    assert await leases.acquire("job-a", "alloc-1", D[:2]) == e1
    assert await leases.release("alloc-1", e1, D[:2]) == 2
    e2 = await leases.acquire("job-a", "alloc-2", D[:2])
    assert e2 == e1 + 1
    assert await leases.current_epoch("job-a") == e2
    with pytest.raises(FencingError):
        await leases.acquire("job-a", "alloc-1", D[:2])  # a released allocation cannot come back


async def test_stale_epoch_cannot_release(leases: LeaseManager) -> None:
    e1 = await leases.acquire("job-a", "alloc-1", D[:1])
    with pytest.raises(FencingError, match="STALE_EPOCH"):
        await leases.release("alloc-1", e1 - 1, D[:1])
    assert (await leases.holder(D[0]))["epoch"] == e1


async def test_concurrent_gangs_never_share_a_device(leases: LeaseManager) -> None:
    devices = [Device(f"n{n}", i) for n in range(2) for i in range(4)]

    async def try_gang(k: int) -> list[Device] | None:
        gang = [devices[(k + j) % 8] for j in range(3)]
        try:
            await leases.acquire(f"job-{k}", f"alloc-{k}", gang)
            return gang
        except LeaseConflictError:
            return None

    won = [g for g in await asyncio.gather(*(try_gang(k) for k in range(16))) if g]
    held = [d for g in won for d in g]
    assert won and len(held) == len(set(held))
    audit = await leases.redis.xrange(Keys.lease_audit)
    assert len([e for _, e in audit if e["op"] == "grant"]) == len(won)


async def test_a_leader_fence_is_checked_in_the_same_script(leases: LeaseManager) -> None:
    fence_key = "ty:test:leader-epoch"
    await leases.redis.set(fence_key, 3)
    epoch = await leases.acquire("job-a", "alloc-1", D[:2], fence=LeaderFence(fence_key, 3))
    with pytest.raises(FencingError, match="STALE_LEADER epoch 2, current 3"):
        await leases.acquire("job-b", "alloc-2", D[2:], fence=LeaderFence(fence_key, 2))
    assert await leases.holder(D[2]) is None  # nothing granted under the stale fence
    with pytest.raises(FencingError, match="STALE_LEADER"):
        await leases.release("alloc-1", epoch, D[:2], fence=LeaderFence(fence_key, 2))
    assert (await leases.holder(D[0]))["allocationId"] == "alloc-1"
    assert await leases.release("alloc-1", epoch, D[:2], fence=LeaderFence(fence_key, 3)) == 2
    audit = [f for _, f in await leases.redis.xrange(Keys.lease_audit)]
    assert [(f["op"], f.get("leader")) for f in audit] == [("grant", "3"), ("release", None)]
