"""Every service follows a Redis failover (issue #20 item 4; docs/design.md §5.2.1), on real processes.

The local stack as ``TRAINYARD_REDIS_HA=1 make up`` runs it: a primary, a replica and three Sentinels,
every service (api, scheduler, checkpoint coordinator, registry, two node agents) a Sentinel client
with its own ACL user. While a 2-rank gpt-tiny job trains and checkpoints, the primary is failed over
twice: ``SENTINEL FAILOVER`` (the replica is promoted without waiting for it to catch up), then kill -9
(the old primary comes back as the new one's replica). Then:

* the job keeps making progress (a newer READY checkpoint after each failover) and succeeds; its
  attempts' epochs grow and each READY checkpoint carries its attempt's epoch;
* the API answers GET /v1/training-jobs/{id}, and a job submitted after the failovers is placed and
  succeeds;
* every service writes to the current primary: the health beacons, deleted there, all come back;
* exactly one scheduler leads (the leader key names the live scheduler, below the epoch counter);
* the lease audit on the current primary shows no device held by two live allocations, and once both
  jobs are done none of their allocations holds a device.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from tests.chaos.invariants import LeaseOp, check_fencing, check_leases_released, check_no_double_booking
from tests.support.redisha import kill_stack_primary
from trainyard_cli import infra
from trainyard_cli.devstack import prepare_and_publish
from trainyard_cli.stack import SERVICES, LocalStack, StackSettings
from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_scheduler.fencing import LeaderKeys
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"succeeded", "failed", "cancelled"}
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
T = TypeVar("T")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    ports = dict(kafka_port=infra.free_port(), redis_port=infra.free_port(), api_port=infra.free_port(),
                 redis_replica_port=infra.free_port())
    settings = StackSettings(
        state_dir=tmp_path / ".trainyard", redis_ha=True, redis_sentinel_port=infra.free_ports(3),
        nodes=2, devices_per_node=4, ready_timeout_s=180, drain_timeout_s=0, **ports,
    )
    # straggler detection off: a rank slowed by the failover (or by a shared CI host) is not what this is about
    stack = LocalStack(settings, extra_env={"TRAINYARD_STRAGGLER_DETECTION": "false"})
    try:
        stack.up()
        yield stack
    except BaseException:
        stack.down()  # what failed is the error to see, not what down stopped
        raise
    stopped = stack.down()
    assert {"redis-sentinel-%d" % (settings.redis_sentinel_port + i) for i in range(3)} <= set(stopped)


def redis_do(stack: LocalStack, fn: Callable[[Any], Awaitable[T]]) -> T:
    """``fn(redis)`` on a fresh Sentinel client of the operator (it finds the current primary)."""
    async def go() -> T:
        redis = connect_redis(stack.redis_url)
        try:
            return await fn(redis)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    resp = client.get(f"/v1/training-jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def ready_step(j: dict[str, Any]) -> int:
    return max((c["globalStep"] for c in j["checkpoints"] if c["state"] == "READY"), default=-1)


def progressed(client: httpx.Client, job_id: str, beyond: int, timeout_s: float) -> dict[str, Any]:
    """The job once it has a READY checkpoint past step ``beyond`` (or has succeeded)."""
    def check() -> dict[str, Any] | None:
        j = job(client, job_id)
        assert j["state"] not in ("failed", "cancelled"), json.dumps(j)[:3000]
        return j if ready_step(j) > beyond or j["state"] == "succeeded" else None

    return wait_for(check, f"{job_id}: a READY checkpoint past step {beyond}", timeout_s)


def finished(client: httpx.Client, job_id: str, timeout_s: float) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        last.update(job(client, job_id))
        return last if last["state"] in TERMINAL else None

    try:
        return wait_for(check, f"{job_id} to finish", timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {json.dumps(last)[:3000]}") from None


def health_instances(stack: LocalStack) -> dict[str, dict[str, str]]:
    """service → {instance: pid} of the health beacons on the current primary."""
    async def read(redis: Any) -> dict[str, dict[str, str]]:
        found: dict[str, dict[str, str]] = {}
        async for key in redis.scan_iter(match=Keys.health("*", "*"), count=100):
            _, _, service, instance = key.split(":", 3)
            found.setdefault(service, {})[instance] = await redis.get(key) or ""
        return found

    return redis_do(stack, read)


def test_every_service_follows_redis_failovers_while_a_job_trains(stack: LocalStack, tmp_path: Path) -> None:
    started = time.monotonic()
    timings: dict[str, float] = {}

    def mark(what: str) -> None:
        timings[what] = round(time.monotonic() - started, 1)

    ha = stack.redis_ha()
    first_primary = ha.wait_ready()
    assert first_primary == stack.s.redis_port
    prepare_and_publish(stack)
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["training"]["maxSteps"] = 300  # still training after both failovers (5-11 steps/s on 2 shared cores)
    spec["checkpointPolicy"]["everySteps"] = 20
    token = stack.token_file.read_text().strip()
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        resp = client.post("/v1/training-jobs", json=spec)
        assert resp.status_code == 202, resp.text
        job_a = resp.json()["jobId"]
        before = progressed(client, job_a, -1, 120)  # ranks past start-up: a READY checkpoint
        assert before["state"] == "running", json.dumps(before)[:2000]
        mark("job A training")

        # 1: SENTINEL FAILOVER — the replica is promoted without waiting for it (the primary's last writes lost)
        second_primary = ha.failover(timeout_s=60)
        assert second_primary != first_primary
        mark("failover")
        during = job(client, job_a)  # the API answers right away, from the new primary
        assert during["state"] not in TERMINAL, json.dumps(during)[:2000]  # the failover was while it trained
        progressed(client, job_a, ready_step(during), 90)  # a checkpoint made READY on the new primary
        mark("job A progressed after the failover")

        # 2: kill -9 the primary; the old one comes back as the new one's replica
        old, third_primary = kill_stack_primary(stack)
        assert (old, third_primary) == (second_primary, first_primary)
        mark("kill -9")
        during = job(client, job_a)
        assert during["state"] not in TERMINAL, json.dumps(during)[:2000]
        progressed(client, job_a, ready_step(during), 90)
        mark("job A progressed after the kill")

        # every service writes to the current primary: beacons deleted there all come back
        beacons = health_instances(stack)
        redis_do(stack, lambda r: r.delete(*(Keys.health(s, i) for s, inst in beacons.items() for i in inst)))
        pids = {c.name: c.pid for c in stack.running()}

        def all_beacons() -> dict[str, dict[str, str]] | None:
            found = health_instances(stack)
            have = {s: len(found.get(s, {})) for s in (*SERVICES, "node-agent")}
            return found if all(n >= (stack.s.nodes if s == "node-agent" else 1) for s, n in have.items()) else None

        back = wait_for(all_beacons, "every service's health beacon on the new primary", 30)
        beacon_pids = {int(p) for inst in back.values() for p in inst.values()}
        assert {pids[s] for s in SERVICES} | {pids[f"node-agent-{i}"] for i in range(stack.s.nodes)} <= beacon_pids, \
            (back, pids)
        mark("beacons back")

        # the API answers; a job submitted now is placed and succeeds
        assert job(client, job_a)["jobId"] == job_a
        small = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
        small["training"]["maxSteps"] = 20
        small["checkpointPolicy"]["everySteps"] = 10
        resp = client.post("/v1/training-jobs", json=small)
        assert resp.status_code == 202, resp.text
        job_b = resp.json()["jobId"]

        done_a = finished(client, job_a, 300)  # deadlines are ceilings for a loaded host, not expectations
        assert done_a["state"] == "succeeded", json.dumps(done_a)[:3000]
        mark("job A succeeded")
        done_b = finished(client, job_b, 180)
        assert done_b["state"] == "succeeded", json.dumps(done_b)[:3000]
        assert done_b["attempts"], done_b
        mark("job B succeeded")

    assert not [c.name for c in stack.components() if not c.alive]  # no service gave up on Redis

    # exactly one scheduler leads: the leader key names the running scheduler, at or below the epoch counter
    leader, leader_epoch = redis_do(stack, lambda r: asyncio.gather(r.get(LeaderKeys.leader), r.get(LeaderKeys.epoch)))
    assert leader is not None, "no scheduler leads"
    epoch, instance = leader.split(" ", 1)
    schedulers = health_instances(stack)["scheduler"]
    assert list(schedulers) == [instance] and schedulers[instance] == str(pids["scheduler"]), (leader, schedulers)
    assert 0 < int(epoch) <= int(leader_epoch)

    # the jobs' attempts are consistent; the audit shows no double booking and, in time, no leftover lease
    async def history(redis: Any) -> tuple[list[Any], dict[str, Any], list[LeaseOp]]:
        store = StateStore(redis)
        jobs = await store.get_jobs([job_a, job_b])
        checkpoints = {j.job_id: await store.list_checkpoints(j.job_id) for j in jobs}
        audit = [LeaseOp.from_stream(f) for _, f in await redis.xrange(Keys.lease_audit)]
        return jobs, checkpoints, audit

    jobs, checkpoints, audit = redis_do(stack, history)
    assert check_fencing(jobs, checkpoints) == []
    assert check_no_double_booking(audit) == []
    assert {op.job_id for op in audit if op.op == "grant"} >= {job_a, job_b}
    def released() -> bool:
        left = check_leases_released(redis_do(stack, history)[2], jobs)
        assert not left or time.monotonic() < deadline, left
        return not left

    deadline = time.monotonic() + 60
    wait_for(released, "the finished jobs' allocations released", 90, every_s=1.0)
    mark("checked")
    print("redis failover stack:", json.dumps({"timings_s": timings, "attempts_a": len(done_a["attempts"]),
                                                "primaries": [first_primary, second_primary, third_primary]}))
