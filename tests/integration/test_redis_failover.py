"""Redis behind Sentinel, failed over again and again under allocation load (docs/design.md §5.2.1).

A primary, a replica and a Sentinel (tests/support/redisha.py). Job workers grant and release gangs of
devices through :class:`LeaseManager` on a ``redis+sentinel://`` client, two scheduler
:class:`Leadership` instances take the leader lease from each other, and meanwhile the primary is failed
over (``SENTINEL FAILOVER``, which promotes the replica without waiting for it to catch up) or killed
(SIGKILL; the old primary comes back as a replica). Every failover may lose the primary's last writes,
epoch increments included; an epoch is used only once the replica acknowledged it. Checked at the end,
on whichever server is primary then:

* no epoch used twice: each job's acknowledged epochs strictly increase, no leader epoch was taken
  twice, and the counters are at least the highest acknowledged value;
* no acknowledged grant lost: each is in the final ``ty:lease-audit``;
* no device double-booked: the audit replayed (tests/chaos/invariants.check_no_double_booking);
* no acknowledged write lost: writers go through the paths the platform answers from — a job record and its
  event staged in one MULTI (the outbox, as behind a 202, a READY or a control request) and a token record
  (an issue or a revocation) — and each write they were told succeeded is on the final primary. Beside them,
  writers of the same writes that do not wait for a replica count what a failover takes from writes
  acknowledged by the primary alone (printed; what the confirmation is for).

And the case the argument names: a killed primary that restarts believing it is the primary confirms
nothing, and rejoins as the new primary's replica with its counters.

``make test`` runs 5 failovers; ``TRAINYARD_LONG_TESTS=1`` (``make test-long``) runs 50.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import RedisError

from tests.chaos.invariants import LeaseOp, check_no_double_booking
from tests.support.redisha import redis_ha
from trainyard_contract import events as ev
from trainyard_runtime.controlrecords import stage_control_request
from trainyard_contract.errors import (
    EpochNotReplicatedError,
    FencingError,
    InfrastructureError,
    LeaseConflictError,
    WriteNotReplicatedError,
)
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.records import TenantToken
from trainyard_runtime.replication import StateRedis, write_confirmed
from trainyard_runtime.store import Keys, connect_redis
from trainyard_scheduler.fencing import Leadership, LeaderKeys

LONG = os.environ.get("TRAINYARD_LONG_TESTS") == "1"
JOBS = 6
DEVICES = [Device(f"n{n}", i) for n in range(2) for i in range(4)]
ACK_TIMEOUT_MS = 300  # a WAIT that cannot be answered (the old primary lost its replica) gives up soon


@dataclass
class Ledger:
    """What the load saw: acknowledged grants and takeovers, and what went wrong on the way."""

    grants: list[tuple[str, int, str, int]] = field(default_factory=list)  # job, epoch, allocation, phase
    takeovers: list[tuple[str, int]] = field(default_factory=list)  # instance, leader epoch
    in_use: dict[str, tuple[int, list[Device]]] = field(default_factory=dict)
    unconfirmed: int = 0  # increments WAIT did not confirm (not used)
    unconfirmed_values: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    errors: int = 0  # Redis unreachable past the client's retries
    conflicts: int = 0
    phase: int = 0  # failovers done so far
    acknowledged: list[tuple[str, str]] = field(default_factory=list)  # (kind, id): writes told they succeeded
    unconfirmed_writes: int = 0  # writes refused as not replicated (not acknowledged: retried by their callers)
    primary_only: list[tuple[str, str]] = field(default_factory=list)  # the control group: no WAIT


def _unconfirmed_value(exc: EpochNotReplicatedError) -> int | None:
    found = re.search(r"increment \((\d+)\)", str(exc))
    return int(found.group(1)) if found else None


async def _reap(leases: LeaseManager, ledger: Ledger, allocation_id: str) -> None:
    """Release an allocation nobody uses (a grant WAIT did not confirm, or a release a failover lost):
    what the scheduler's reconciliation does with orphans."""
    if allocation_id in ledger.in_use:
        return
    raw = await leases.redis.get(Keys.allocation(allocation_id))
    if not raw:
        return
    record = json.loads(raw)
    if record["state"] == "active":
        devices = [Device(d.split(":")[0], int(d.split(":")[1])) for d in record["devices"]]
        await leases.release(allocation_id, int(record["epoch"]), devices)


async def job_worker(job_id: str, leases: LeaseManager, ledger: Ledger, stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        n += 1
        allocation_id = f"{job_id}-a{n}"
        gang = rng.sample(DEVICES, rng.randint(1, 3))
        try:
            epoch = None
            for _ in range(3):  # the same allocation again: its epoch, once the replica has it
                try:
                    epoch = await leases.acquire(job_id, allocation_id, gang)
                    break
                except EpochNotReplicatedError as exc:
                    ledger.unconfirmed += 1
                    if (value := _unconfirmed_value(exc)) is not None:
                        ledger.unconfirmed_values[job_id].add(value)
            if epoch is None:
                continue  # abandoned: an orphan, reaped when it is in someone's way
            ledger.grants.append((job_id, epoch, allocation_id, ledger.phase))
            ledger.in_use[allocation_id] = (epoch, gang)
            await asyncio.sleep(rng.uniform(0.005, 0.02))
            del ledger.in_use[allocation_id]
            await leases.release(allocation_id, epoch, gang)
        except LeaseConflictError as exc:
            ledger.conflicts += 1
            await _reap(leases, ledger, str(exc).rsplit(" ", 1)[-1])
        except FencingError:  # the unconfirmed allocation it retried was reaped meanwhile
            ledger.in_use.pop(allocation_id, None)
        except (InfrastructureError, RedisError, OSError):
            ledger.in_use.pop(allocation_id, None)
            ledger.errors += 1
            await asyncio.sleep(0.05)
        await asyncio.sleep(rng.uniform(0.002, 0.01))


async def write_worker(redis: StateRedis, ledger: Ledger, stop: asyncio.Event, name: str, *,
                       confirmed: bool = True) -> None:
    """Acknowledged writes through the platform's own paths: a record and its outbox event in one MULTI (as
    the API stages JobSubmitted, the coordinator CheckpointReady, a control request), and a token record
    (StateStore.add_token, as an issue or a revocation). ``confirmed=False``: the same writes on a client that
    waits for no replica, into ``ledger.primary_only``."""
    from trainyard_runtime.outbox import Outbox
    from trainyard_runtime.store import StateStore

    outbox, store = Outbox(redis, f"failover-{name}"), StateStore(redis)
    into = ledger.acknowledged if confirmed else ledger.primary_only
    n = 0
    while not stop.is_set():
        n += 1
        record_id = f"{name}-{n}"
        try:
            if n % 2:
                async with redis.pipeline(transaction=True) as pipe:
                    pipe.set(f"ty:failover-test:{record_id}", record_id)
                    stage_control_request(pipe, outbox, ev.JobControlRequested(
                        job_id=f"job-{name}", tenant="t", action="pause", reason=record_id),
                        requested_by=name, at=ev.utcnow())
                    await pipe.execute()
                into.append(("record", record_id))
            else:
                token = await store.add_token(f"secret-{record_id}", "t", record_id)
                into.append(("token", token.name))
        except WriteNotReplicatedError:
            ledger.unconfirmed_writes += 1
        except (InfrastructureError, RedisError, OSError):
            ledger.errors += 1
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.005)


async def _lost_writes(redis: StateRedis, writes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    tokens = {TenantToken.model_validate_json(v).name for v in (await redis.hgetall(Keys.tokens)).values()}
    records = [w for w in writes if w[0] == "record"]
    present = await redis.mget([f"ty:failover-test:{r}" for _, r in records]) if records else []
    lost = [w for w, value in zip(records, present) if value != w[1]]
    return lost + [w for w in writes if w[0] == "token" and w[1] not in tokens]


async def leader_worker(redis: StateRedis, ledger: Ledger, stop: asyncio.Event) -> None:
    """Two instances; the leader resigns now and then, so the other takes over (a new leader epoch)."""
    rng = random.Random(7)
    instances = [Leadership(redis, name, ttl_s=0.5) for name in ("a", "b")]
    held: dict[str, int | None] = {"a": None, "b": None}
    while not stop.is_set():
        for leadership in instances:
            try:
                epoch = await leadership.maintain()
                if epoch is not None and epoch != held[leadership.instance]:
                    ledger.takeovers.append((leadership.instance, epoch))
                held[leadership.instance] = epoch
                if epoch is not None and rng.random() < 0.3:
                    await leadership.resign()
                    held[leadership.instance] = None
            except (InfrastructureError, RedisError, OSError):
                ledger.errors += 1
                held[leadership.instance] = None
                leadership.epoch = None
        await asyncio.sleep(0.02)


def _reused(ledger: Ledger) -> list[str]:
    problems = []
    last: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    for job_id, epoch, allocation_id, _ in ledger.grants:
        if (job_id, epoch) in seen:
            problems.append(f"{job_id}: epoch {epoch} acknowledged twice ({allocation_id})")
        elif epoch <= last.get(job_id, 0):
            problems.append(f"{job_id}: epoch {epoch} acknowledged after {last[job_id]}")
        seen.add((job_id, epoch))
        last[job_id] = max(epoch, last.get(job_id, 0))
    leader_epochs = [e for _, e in ledger.takeovers]
    for epoch in {e for e in leader_epochs if leader_epochs.count(e) > 1}:
        problems.append(f"leader epoch {epoch} taken twice: {[t for t in ledger.takeovers if t[1] == epoch]}")
    return problems


async def run_failovers(tmp_path: Path, failovers: int) -> dict[str, int]:
    with redis_ha(tmp_path / "redis-ha") as ha:
        redis = connect_redis(ha.url() + f"?epoch_ack_timeout_ms={ACK_TIMEOUT_MS}")
        assert isinstance(redis, StateRedis) and redis.epoch_acks.replicas == 1
        leases = LeaseManager(redis)
        ledger, stop = Ledger(), asyncio.Event()
        tasks = [asyncio.create_task(job_worker(f"job-{j}", leases, ledger, stop, seed=j)) for j in range(JOBS)]
        tasks.append(asyncio.create_task(leader_worker(redis, ledger, stop)))
        unwaiting = connect_redis(ha.url() + "?epoch_acks=0")  # the control group: the primary alone answers
        tasks += [asyncio.create_task(write_worker(redis, ledger, stop, f"w{i}")) for i in range(2)]
        tasks.append(asyncio.create_task(write_worker(unwaiting, ledger, stop, "u0", confirmed=False)))
        kills = 0
        try:
            await asyncio.sleep(0.5)
            for n in range(failovers):
                if n % 5 == 4:  # every fifth: the primary dies (SIGKILL) instead
                    await asyncio.to_thread(ha.kill_primary)
                    kills += 1
                else:
                    await asyncio.to_thread(ha.failover)
                ledger.phase = n + 1
                await asyncio.sleep(0.3)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        primary = await asyncio.to_thread(ha.wait_ready)
        audit = [LeaseOp.from_stream(f) for _, f in await redis.xrange(Keys.lease_audit)]
        job_epochs = {f"job-{j}": int(await redis.get(Keys.epoch(f"job-{j}")) or 0) for j in range(JOBS)}
        leader_epoch = int(await redis.get(LeaderKeys.epoch) or 0)
        lost_writes = await _lost_writes(redis, ledger.acknowledged)
        lost_primary_only = await _lost_writes(redis, ledger.primary_only)
        await redis.aclose()
        await unwaiting.aclose()

    problems = _reused(ledger)
    audited = {(op.job_id, op.epoch, op.allocation_id) for op in audit if op.op == "grant"}
    lost = [g for g in ledger.grants if g[:3] not in audited]
    for job_id, epoch, _, _ in ledger.grants:
        if job_epochs[job_id] < epoch:
            problems.append(f"{job_id}: counter {job_epochs[job_id]} below acknowledged epoch {epoch}")
    if ledger.takeovers and leader_epoch < max(e for _, e in ledger.takeovers):
        problems.append(f"leader-epoch counter {leader_epoch} below an acknowledged takeover")
    double_booked = check_no_double_booking(audit)
    # an increment that WAIT did not confirm and whose number a later, confirmed grant of the job got again:
    # what would have been a reused epoch without the WAIT
    avoided = sum(1 for job_id, epoch, _, _ in ledger.grants if epoch in ledger.unconfirmed_values[job_id])
    counts = {"failovers": failovers, "kills": kills, "grants_acknowledged": len(ledger.grants),
              "epochs_checked": len(ledger.grants) + len(ledger.takeovers), "takeovers": len(ledger.takeovers),
              "reused": len(problems), "lost_acknowledged": len(lost), "double_booked": len(double_booked),
              "unconfirmed": ledger.unconfirmed, "reuse_avoided": avoided, "errors": ledger.errors,
              "conflicts": ledger.conflicts, "audit_entries": len(audit), "final_primary": primary,
              "writes_acknowledged": len(ledger.acknowledged), "writes_lost": len(lost_writes),
              "writes_unconfirmed": ledger.unconfirmed_writes,
              "primary_only_writes": len(ledger.primary_only), "primary_only_lost": len(lost_primary_only)}
    print("redis failover run:", json.dumps(counts))
    assert not problems, problems[:20]
    assert not lost, lost[:20]
    assert not double_booked, double_booked[:20]
    assert not lost_writes, lost_writes[:20]  # every write acknowledged after a replica confirmed it survived
    assert len(ledger.acknowledged) >= failovers, "too few writes were acknowledged to check anything"
    phases = {g[3] for g in ledger.grants}
    assert len(phases) >= failovers * 0.8, f"allocations went on in only {len(phases)} of {failovers + 1} phases"
    assert ledger.takeovers, "no leader takeover was acknowledged"
    return counts


async def test_a_sentinel_client_follows_a_failover_and_a_kill(tmp_path: Path) -> None:
    """A write acknowledged once a replica confirmed it is on the new primary after a failover (a plain SET
    answered by the primary alone was not, now and then: SENTINEL FAILOVER does not wait for the replica)."""
    with redis_ha(tmp_path / "redis-ha") as ha:
        redis = connect_redis(ha.url())
        try:
            await until_written(lambda: write_confirmed(redis, lambda p: p.set("ty:test", "1")))
            first = ha.primary_port()
            assert await asyncio.to_thread(ha.failover) != first
            assert await redis.incr("ty:test") == 2  # the write followed the new primary
            await asyncio.to_thread(ha.kill_primary)
            assert await redis.incr("ty:test") == 3
            assert (await redis.info("server"))["tcp_port"] == ha.primary_port()
        finally:
            await redis.aclose()


async def until_written(write: Callable[[], Awaitable[object]], timeout_s: float = 60.0) -> None:
    """``write()`` retried while no replica confirms it (right after start the replica may still sync)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await write()
            return
        except WriteNotReplicatedError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def until_confirmed(grant: Callable[[], Awaitable[int]], timeout_s: float = 60.0) -> int:
    """``grant()`` retried while no replica confirms it (EpochNotReplicatedError is retryable: the same
    allocation gets the same epoch once it is replicated)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await grant()
        except EpochNotReplicatedError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_an_epoch_no_replica_acknowledged_is_not_used(tmp_path: Path) -> None:
    with redis_ha(tmp_path / "redis-ha") as ha:
        redis = connect_redis(ha.url() + "?epoch_ack_timeout_ms=200")
        replica = next(p for p in ha.ports if p != ha.primary_port())
        leases, leader = LeaseManager(redis), Leadership(redis, "a", ttl_s=5)
        try:
            # the replica may still be syncing right after start: the first grant is retried until it is confirmed
            first = await until_confirmed(lambda: leases.acquire("job", "job-a1", DEVICES[:2]))
            assert first == 1
            ha.servers[replica].process.send_signal(19)  # SIGSTOP: the replica acknowledges nothing
            try:
                with pytest.raises(EpochNotReplicatedError) as caught:
                    await leases.acquire("job", "job-a2", DEVICES[2:4])
                assert caught.value.retryable
                assert await leader.maintain() is None  # a takeover it cannot confirm: not the leader
            finally:
                ha.servers[replica].process.send_signal(18)  # SIGCONT
            # the same allocation again: the same epoch, now confirmed; a takeover now gets a new epoch
            assert await until_confirmed(lambda: leases.acquire("job", "job-a2", DEVICES[2:4])) == 2
            deadline = time.monotonic() + 60
            while (led := await leader.maintain()) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # the replica catching up after SIGCONT
            # 2, or more when a takeover the slow replica did not confirm in time was given up (never reused)
            assert led is not None and led >= 2 and await redis.get(LeaderKeys.epoch) == str(led)
        finally:
            await redis.aclose()


async def test_a_killed_primary_back_believing_it_is_primary_confirms_nothing_and_rejoins_as_a_replica(
    tmp_path: Path
) -> None:
    """The case §5.2.1 argues: P dies, Sentinel promotes R, P restarts from its own config and AOF as a
    primary. Nothing it increments is confirmed (it has no replica; once Sentinel demotes it, it refuses
    writes), and once it replicates from R every counter is R's: the next grant is past every confirmed one."""
    with redis_ha(tmp_path / "redis-ha") as ha:
        redis = connect_redis(ha.url() + "?epoch_ack_timeout_ms=200")
        leases = LeaseManager(redis)
        stale: Any = None
        try:
            confirmed = [await until_confirmed(lambda: leases.acquire("job", f"job-a{i}", DEVICES[2 * i:2 * i + 2]))  # noqa: B023 - awaited at once
                         for i in range(2)]
            assert confirmed == [1, 2]
            old, new = await asyncio.to_thread(ha.kill_primary_back_as_it_was)
            assert new != old
            # a client that still talks to the old primary (it is back, on its own): its grant is never used —
            # no replica acknowledges it while P believes it is primary, and P refuses writes once demoted
            stale = connect_redis(f"redis://127.0.0.1:{old}/0?epoch_acks=1&epoch_ack_timeout_ms=200")
            with pytest.raises((EpochNotReplicatedError, InfrastructureError, RedisError)) as refused:
                await LeaseManager(stale).acquire("job", "job-stale", DEVICES[4:6])
            print("the stale primary's grant:", type(refused.value).__name__, refused.value)
            assert await asyncio.to_thread(ha.wait_ready, 60) == new  # P replicates from R now
            # through Sentinel: the next grant is past every confirmed epoch, and P holds R's counter
            third = await until_confirmed(lambda: leases.acquire("job", "job-a2", DEVICES[4:6]))
            assert third > max(confirmed)
            deadline = time.monotonic() + 30
            while await stale.get(Keys.epoch("job")) != str(third):  # replication is asynchronous: in time
                assert time.monotonic() < deadline, await stale.get(Keys.epoch("job"))
                await asyncio.sleep(0.1)
            audit = [LeaseOp.from_stream(f) for _, f in await redis.xrange(Keys.lease_audit)]
            assert "job-stale" not in {op.allocation_id for op in audit}  # nothing of it reached the primary
            assert check_no_double_booking(audit) == []
        finally:
            await redis.aclose()
            if stale is not None:
                await stale.aclose()


async def test_failovers_under_allocation_load_never_reuse_an_epoch_or_double_book(tmp_path: Path) -> None:
    await run_failovers(tmp_path, failovers=5)


@pytest.mark.long
@pytest.mark.skipif(not LONG, reason="50 failovers; set TRAINYARD_LONG_TESTS=1 (make test-long)")
async def test_fifty_failovers_under_allocation_load_never_reuse_an_epoch_or_double_book(tmp_path: Path) -> None:
    counts = await run_failovers(tmp_path, failovers=50)
    assert counts["failovers"] >= 50


async def test_a_write_no_replica_confirmed_is_not_acknowledged(tmp_path: Path) -> None:
    """With the replica frozen, what the platform would acknowledge is refused as retryable, never answered
    as done: a token write, a MULTI with an outbox event, the outbox relay (no event announces it), and the
    API's POST /v1/training-jobs (503 with Retry-After, not 202). Thawed, the same calls succeed."""
    import httpx

    from tests.support.api import TOKEN_A, seed
    from trainyard_api import ApiSettings
    from trainyard_api.app import ApiContext, create_app
    from trainyard_api.schemas import EXAMPLE_SPEC
    from trainyard_runtime.outbox import Outbox
    from trainyard_runtime.store import StateStore

    with redis_ha(tmp_path / "redis-ha") as ha:
        url = ha.url() + "?epoch_ack_timeout_ms=200"
        redis = connect_redis(url)
        store, outbox = StateStore(redis), Outbox(redis, "api")
        app = create_app(ApiContext(ApiSettings(redis_url=url, artifact_root=tmp_path / "artifacts"), store, outbox))
        replica = next(p for p in ha.ports if p != ha.primary_port())
        try:
            await until_written(lambda: seed(store))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                         headers={"Authorization": f"Bearer {TOKEN_A}"}) as api:
                ha.servers[replica].process.send_signal(19)  # SIGSTOP: the replica acknowledges nothing
                try:
                    with pytest.raises(WriteNotReplicatedError) as caught:
                        await store.add_token("secret-frozen", "tenant-a", "frozen")
                    assert caught.value.retryable
                    with pytest.raises(WriteNotReplicatedError):  # a control request: its record and its event
                        async with redis.pipeline(transaction=True) as pipe:
                            stage_control_request(pipe, outbox, ev.JobControlRequested(
                                job_id="job-x", tenant="tenant-a", action="pause", reason="frozen replica"),
                                requested_by="alice", at=ev.utcnow())
                            await pipe.execute()
                    with pytest.raises(WriteNotReplicatedError):  # the relay publishes nothing unconfirmed
                        await outbox.relay_once(bus=None)  # type: ignore[arg-type]  # a test double
                    resp = await api.post("/v1/training-jobs", json=EXAMPLE_SPEC, headers={"Idempotency-Key": "k"})
                    assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
                finally:
                    ha.servers[replica].process.send_signal(18)  # SIGCONT
                deadline = time.monotonic() + 60
                while (resp := await api.post("/v1/training-jobs", json=EXAMPLE_SPEC,
                                              headers={"Idempotency-Key": "k"})).status_code == 503:
                    assert time.monotonic() < deadline, resp.text  # the replica catching up
                    await asyncio.sleep(0.2)
                assert resp.status_code == 202, resp.text
                job = await store.get_job(resp.json()["jobId"])
                assert job is not None and job.state == "queued"
        finally:
            await redis.aclose()
