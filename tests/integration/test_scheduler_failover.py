"""Scheduler processes against the real broker and Redis: the leader is killed with SIGKILL in the
middle of an allocation (leases granted, attempt not yet recorded), a standby takes over, releases
the orphan and places the job; then the leader is paused (SIGSTOP) mid-allocation, another instance
takes over, and the old leader's write, once it resumes, is refused. No device is ever double-booked
(checked on the lease audit stream)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import env_vars
from tests.integration.test_scheduler_stack import EventTap, make_spec, poll
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_contract.events import DeviceInfo, GangAllocated, JobSubmitted, NodeHeartbeat
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_scheduler import SchedulerKeys
from tests.support.datasets import verified

NODES = ("n0", "n1", "n2")
# admit_pause_s holds each placement between its lease grant and its attempt record, so the test can act
# in that window even on a loaded host
SCHEDULER = {"tick_s": 0.3, "leader_ttl_s": 3.0, "reconcile_interval_s": 1.0, "node_timeout_s": 30,
             "lease_ttl_s": 120, "admit_pause_s": 4.0, "start_timeout_s": 600}


class Processes:
    """Scheduler processes (``python -m trainyard_scheduler``); whatever still runs at the end is killed."""

    def __init__(self, env: dict[str, Any], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> subprocess.Popen[bytes]:
        own = {f"TRAINYARD_{k.upper()}": str(v) for k, v in {**SCHEDULER, "instance_id": name}.items()}
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "trainyard_scheduler"],  # noqa: S603 - our own module
                                    env={**os.environ, **env_vars(self.env), **own}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.log_dir.glob("*.log"))

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)


@pytest.fixture
def processes(env: dict[str, Any], tmp_path: Path) -> Iterator[Processes]:
    p = Processes(env, tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
async def bus(env: dict[str, Any]) -> AsyncIterator[Bus]:
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    publisher = Bus(env["kafka_bootstrap"], service_name="test-publisher", topic_namespace=env["topic_namespace"])
    await publisher.start()
    try:
        yield publisher
    finally:
        await publisher.aclose()


async def heartbeats(bus: Bus) -> None:
    """Three 4-device nodes (the test plays their agents' inventory; no ranks are launched)."""
    while True:
        for node in NODES:
            devices = [DeviceInfo(index=i, type="cpu", memory_bytes=16 << 30) for i in range(4)]
            await bus.publish(NodeHeartbeat(node_id=node, host="127.0.0.1", rack="r0", devices=devices))
        await asyncio.sleep(1.0)


async def leader(redis: Any) -> tuple[int, str] | None:
    raw = await redis.get(SchedulerKeys.leader)
    if not raw:
        return None
    epoch, who = raw.split(" ", 1)
    return int(epoch), who


async def mid_allocation(store: StateStore, redis: Any, job_id: str) -> dict[str, str] | None:
    """A grant for ``job_id`` whose attempt is not recorded yet."""
    job = await store.get_job(job_id)
    recorded = {a.allocation_id for a in job.attempts} if job else set()
    for _, fields in await redis.xrange(Keys.lease_audit):
        if fields["op"] == "grant" and fields["job"] == job_id and fields["allocation"] not in recorded:
            return fields
    return None


def replay_audit(entries: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    """Replay grants and releases; a grant of a device still held is a double booking."""
    held: dict[str, str] = {}
    for _, f in entries:
        for device in json.loads(f["devices"]):
            if f["op"] in ("grant", "restore"):
                assert held.get(device, f["allocation"]) == f["allocation"], \
                    f"{device} granted to {f['allocation']} while held by {held[device]}"
                held[device] = f["allocation"]
            elif f["op"] == "release" and held.get(device) == f["allocation"]:
                del held[device]
    return held


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_failover_mid_allocation_never_double_books(env: dict[str, Any], processes: Processes,
                                                          bus: Bus) -> None:
    """Which instance leads at any moment is up to timing (a loaded host may let a lease lapse and
    hand leadership on); what the platform promises is checked instead: leader epochs only grow,
    every grant was made under the then-current leader epoch, a grant whose leader died or was
    paused is released and never announced, each job gets one attempt, and no device is booked twice."""
    redis = connect_redis(env["redis_url"])
    store = StateStore(redis)
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    await tap.start()
    beating = asyncio.create_task(heartbeats(bus))

    async def submit(job_id: str) -> None:
        spec = make_spec(4)
        await verified(store, spec.dataset)
        assert await store.create_job(JobRecord(job_id=job_id, tenant="t1", spec=spec, spec_hash=spec.spec_hash()))
        await bus.publish(JobSubmitted(job_id=job_id, tenant="t1", spec=spec, spec_hash=spec.spec_hash()))

    async def standing_by(name: str) -> None:
        await poll(lambda: redis.exists(Keys.health("scheduler", name)), f"{name} started", 90)

    try:
        processes.start("sched-a")
        first = await poll(lambda: leader(redis), "a leader", timeout_s=60)
        processes.start("sched-b")
        await standing_by("sched-b")

        # 1. kill -9 of the leader between its lease grant and the attempt record
        await submit("j1")
        orphan = await poll(lambda: mid_allocation(store, redis, "j1"), "j1's leases granted", 60)
        granter = granter_of(processes, int(orphan["leader"]))
        processes.procs[granter].kill()
        killed_at = time.monotonic()
        second = await poll(lambda: _newer_leader(redis, int(orphan["leader"])),
                            f"takeover after kill -9 of {granter}; logs:\n{processes.logs()}", 60)
        takeover_s = time.monotonic() - killed_at
        assert second[0] > first[0] and second[1] != granter
        j1 = await _placed(store, "j1")
        assert [a.allocation_id for a in j1.attempts] == [j1.attempts[0].allocation_id]
        assert j1.attempts[0].allocation_id != orphan["allocation"] and j1.attempts[0].epoch >= 2
        print(f"takeover by the standby {takeover_s:.1f}s after kill -9 of the leader (leader TTL "
              f"{SCHEDULER['leader_ttl_s']}s)")

        # 2. a paused (SIGSTOP) leader mid-allocation; another instance takes over; the old one resumes
        processes.start("sched-c")
        await standing_by("sched-c")
        await submit("j2")
        stale = await poll(lambda: mid_allocation(store, redis, "j2"), "j2's leases granted", 60)
        paused = granter_of(processes, int(stale["leader"]))
        undone_before = _placement_undone(processes, paused, "j2")
        processes.procs[paused].send_signal(signal.SIGSTOP)
        third = await poll(lambda: _newer_leader(redis, int(stale["leader"])),
                           f"takeover from the paused {paused}; logs:\n{processes.logs()}", 60)
        j2 = await _placed(store, "j2")
        processes.procs[paused].send_signal(signal.SIGCONT)
        # the resumed instance finishes its placement; the leader-epoch check refuses the write
        async def refused() -> bool:
            return _placement_undone(processes, paused, "j2") > undone_before

        await poll(refused, f"{paused} to find its placement of j2 refused; logs:\n{processes.logs()}", 60)
        j2 = await store.get_job("j2")
        assert j2 is not None and [a.allocation_id for a in j2.attempts] == [j2.attempts[0].allocation_id]
        assert j2.attempts[0].allocation_id != stale["allocation"]
        now = await leader(redis)
        assert now is not None and now[0] >= third[0] > second[0]  # leader epochs never go back

        # 3. the invariants, on the lease audit stream
        async def orphans_released() -> list[tuple[str, dict[str, str]]] | None:
            entries = await redis.xrange(Keys.lease_audit)
            released = {f["allocation"] for _, f in entries if f["op"] == "release"}
            return entries if {orphan["allocation"], stale["allocation"]} <= released else None

        audit = await poll(orphans_released, "the orphaned grants released", 60)
        held = replay_audit(audit)
        grants = [int(f["leader"]) for _, f in audit if f["op"] == "grant"]
        assert grants == sorted(grants), f"a grant under an older leader epoch after a newer one: {grants}"
        j1, j2 = await store.get_job("j1"), await store.get_job("j2")
        assert j1 is not None and j2 is not None
        live = {a.allocation_id for j in (j1, j2) for a in j.attempts if a.state in ("starting", "running")}
        assert set(held.values()) == live
        attempts = {a.allocation_id for j in (j1, j2) for a in j.attempts}

        async def announced() -> set[str] | None:  # the outbox relays each attempt's GangAllocated
            published = {e.allocation_id for e in tap.events(GangAllocated)}
            return published if attempts <= published else None

        published = await poll(announced, f"GangAllocated of {sorted(attempts)}", 60)
        assert stale["allocation"] not in published and orphan["allocation"] not in published
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await tap.stop()
        await redis.aclose()


def granter_of(processes: Processes, leader_epoch: int) -> str:
    """The instance that held ``leader_epoch`` (each says so in its log when it takes over)."""
    marker = f"scheduling leader now (leader epoch {leader_epoch}, instance "
    for log in processes.log_dir.glob("*.log"):
        if marker in log.read_text(errors="replace"):
            return log.stem
    raise AssertionError(f"no instance logged leader epoch {leader_epoch}; logs:\n{processes.logs()}")


def _placement_undone(processes: Processes, name: str, job_id: str) -> int:
    text = (processes.log_dir / f"{name}.log").read_text(errors="replace")
    return text.count(f"job {job_id} or the leader changed while it was being placed; placement undone")


async def _newer_leader(redis: Any, than: int) -> tuple[int, str] | None:
    current = await leader(redis)
    return current if current and current[0] > than else None


async def _placed(store: StateStore, job_id: str) -> JobRecord:
    async def check() -> JobRecord | None:
        job = await store.get_job(job_id)
        return job if job and job.attempts and job.attempts[-1].state == "starting" else None

    return await poll(check, f"{job_id} placed", timeout_s=60)
