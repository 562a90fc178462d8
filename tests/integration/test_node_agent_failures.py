"""How the node agent handles failures, as real processes against the real broker and Redis, with a
tiny stand-in rank that reports a step every 0.2 s: a SIGSTOPped rank hangs its attempt and the
agent kills all of it; a lost device lease stops the ranks; exits are classified (nan, nccl);
a restart while Redis is down adopts the running ranks from the node-local table, keeps relaying
their spools from the persisted offsets, and reports their exits once Redis is back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_node_agent import Services, alive, reap_ranks  # noqa: F401 - reap_ranks: autouse
from tests.integration.test_scheduler_stack import EventTap, make_spec, poll
from trainyard_cli import infra
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_contract.events import (
    CheckpointRequested,
    GangAllocated,
    NodeAssignment,
    NodeHeartbeat,
    RankAssignment,
    ShardWritten,
    StepMetrics,
    WorkerExited,
    WorkerStarted,
)
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import StateStore, connect_redis
from trainyard_node_agent.agent import AgentKeys
from trainyard_node_agent.sandbox import job_uid

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NODE = "node-f"

# A stand-in rank: one StepMetrics line per 0.2 s in its spool; per rank, optionally print a line
# and exit with a code after some seconds (progress.json, by job id, in the job's dataset: a sandboxed rank
# sees that, read-only, but not the artifact root's top level).
PROGRESS = r"""
import json, os, sys, time, uuid
from datetime import UTC, datetime
from pathlib import Path
env = os.environ
rank, job = env["RANK"], env["TRAINYARD_JOB_ID"]
plan = Path(env["TRAINYARD_ARTIFACT_ROOT"], "datasets", "tinycorpus", "v1", "progress.json")
mine = json.loads(plan.read_text()).get(job, {}).get(rank, {}) if plan.exists() else {}
start, step = time.monotonic(), 0
with open(env["TRAINYARD_EVENTS_FILE"], "a") as spool:
    while True:
        step += 1
        payload = {"eventId": str(uuid.uuid4()), "eventType": "StepMetrics", "occurredAt": datetime.now(UTC).isoformat(),
                   "jobId": job, "attempt": int(env["TRAINYARD_ATTEMPT"]), "rank": int(rank), "step": step,
                   "loss": 1.0, "consumedTokens": step}
        spool.write(json.dumps({"topic": "trainyard.metrics", "key": job, "payload": payload}) + "\n")
        spool.flush(); os.fsync(spool.fileno())
        if "exitAfter" in mine and time.monotonic() - start > mine["exitAfter"]:
            print(mine.get("say", ""), flush=True)
            if "noteStep" in mine:  # what the trainer notes: the step that failed
                Path(env["TRAINYARD_EXIT_NOTE_FILE"]).write_text(json.dumps({"globalStep": mine["noteStep"]}))
            sys.exit(mine["code"])
        time.sleep(0.2)
"""  # noqa: E501 - a rank's script, run as written


@dataclass
class Rig:
    env: dict[str, Any]
    services: Services
    tap: EventTap
    publisher: Bus
    redis: Any
    agent_settings: dict[str, object]

    async def gang(self, job_id: str, *, world: int = 2, attempt: int = 1,
                   spec: TrainingSpec | None = None) -> GangAllocated:
        """Lease devices 0..world-1 of the node and publish the GangAllocated (playing the scheduler)."""
        allocation_id = f"{job_id}-a{attempt}"
        devices = [Device(NODE, i) for i in range(world)]
        epoch = await LeaseManager(self.redis).acquire(job_id, allocation_id, devices)
        spec = spec or make_spec(world)
        event = GangAllocated(
            job_id=job_id, tenant="t1", attempt=attempt, allocation_id=allocation_id, epoch=epoch, world_size=world,
            nodes=[NodeAssignment(node_id=NODE, host="127.0.0.1",
                                  ranks=[RankAssignment(rank=i, local_rank=i, device_index=i) for i in range(world)])],
            master_addr="127.0.0.1", master_port=infra.free_port(), spec=spec, spec_hash=spec.spec_hash(),
        )
        await self.publisher.publish(event)
        return event

    def plan(self, plan: dict[str, Any]) -> None:
        dataset = Path(self.env["artifact_root"], "datasets", "tinycorpus", "v1")  # make_spec's dataset
        dataset.mkdir(parents=True, exist_ok=True)
        (dataset / "progress.json").write_text(json.dumps(plan))


@pytest.fixture
async def rig(env: dict[str, Any], tmp_path: Path) -> AsyncIterator[Rig]:
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    services = Services(env, tmp_path)
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    publisher = Bus(env["kafka_bootstrap"], service_name="test-scheduler", topic_namespace=env["topic_namespace"])
    redis = connect_redis(env["redis_url"])
    await tap.start()
    await publisher.start()
    settings = {"node_id": NODE, "device_count": 2, "heartbeat_s": 0.5, "kill_grace_s": 2, "spool_poll_s": 0.1,
                "rank_command": json.dumps([sys.executable, "-c", PROGRESS]), "hang_timeout_s": 3,
                "first_step_timeout_s": 60, "lease_check_s": 0.5}
    try:
        yield Rig(env, services, tap, publisher, redis, settings)
    finally:
        services.stop_all()
        await tap.stop()
        await publisher.aclose()
        await redis.aclose()


async def heartbeat_after(tap: EventTap) -> None:
    await tap.wait(NodeHeartbeat, node_id=NODE, timeout_s=90)


async def test_a_sigstopped_rank_hangs_the_attempt_and_every_rank_of_it_is_killed(rig: Rig) -> None:
    rig.services.start("trainyard_node_agent", "agent", **rig.agent_settings)
    await heartbeat_after(rig.tap)
    await rig.gang("hung")
    started = await rig.tap.wait(WorkerStarted, 2, job_id="hung", timeout_s=60)
    await rig.tap.wait(StepMetrics, 4, job_id="hung", timeout_s=60)
    victim = next(e for e in started if e.rank == 1)
    os.kill(victim.pid, signal.SIGSTOP)
    exits = await rig.tap.wait(WorkerExited, 2, job_id="hung", timeout_s=60)
    assert {e.reason for e in exits} == {"hang"}, exits
    by_rank = {e.rank: e for e in exits}
    assert "rank 1" in (by_rank[0].detail or "") and "stopped (SIGSTOP" in (by_rank[0].detail or "")
    assert not any(alive(e.pid) for e in started), "the stopped rank is killed too"


async def test_a_rank_whose_lease_is_gone_is_stopped_as_revoked(rig: Rig) -> None:
    rig.services.start("trainyard_node_agent", "agent", **rig.agent_settings)
    await heartbeat_after(rig.tap)
    gang = await rig.gang("unleased")
    started = await rig.tap.wait(WorkerStarted, 2, job_id="unleased", timeout_s=60)
    # the scheduler released the allocation but its AllocationRevoked was lost with the broker
    await LeaseManager(rig.redis).release(gang.allocation_id, gang.epoch, [Device(NODE, 0), Device(NODE, 1)])
    exits = await rig.tap.wait(WorkerExited, 2, job_id="unleased", timeout_s=60)
    assert {e.reason for e in exits} == {"revoked"}
    assert all("no longer leased" in (e.detail or "") for e in exits), exits
    await poll(_gone([e.pid for e in started]), "ranks stopped")


async def test_exits_are_classified_from_exit_code_and_log(rig: Rig) -> None:
    rig.plan({"classified": {
        "0": {"exitAfter": 0.5, "code": 3, "say": "NonFiniteError: loss is nan at step 3", "noteStep": 99},
        "1": {"exitAfter": 0.5, "code": 1,
              "say": "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1595, unhandled system error"},
    }})
    rig.services.start("trainyard_node_agent", "agent", **rig.agent_settings)
    await heartbeat_after(rig.tap)
    await rig.gang("classified")
    exits = {e.rank: e for e in await rig.tap.wait(WorkerExited, 2, job_id="classified", timeout_s=60)}
    assert (exits[0].exit_code, exits[0].reason) == (3, "nan") and "nan at step 3" in (exits[0].detail or "")
    assert (exits[1].exit_code, exits[1].reason) == (1, "nccl") and "NCCL error" in (exits[1].detail or "")
    # the step: the trainer's exit note (the failing step of a NaN), else the last StepMetrics relayed
    assert exits[0].global_step == 99
    last = exits[1].global_step
    assert last is not None and last >= 1
    await rig.tap.wait(StepMetrics, job_id="classified", rank=1, step=last, timeout_s=30)
    await asyncio.sleep(1.0)  # the exit follows the spool: no later step may show up
    assert max(m.step for m in rig.tap.events(StepMetrics, job_id="classified", rank=1)) == last


async def test_announcements_are_published_again_until_redis_shows_them_applied(rig: Rig) -> None:
    """WorkerStarted lost with the broker: the scheduler's record never shows the rank started, so the
    agent publishes the same event (same id: consumers de-duplicate) again, until it does."""
    rig.services.start("trainyard_node_agent", "agent", **{**rig.agent_settings, "confirm_interval_s": 0.5,
                                                          "confirm_after_s": 1.0})
    await heartbeat_after(rig.tap)
    spec = make_spec(2)
    gang = await rig.gang("unheard")
    job = JobRecord(job_id="unheard", tenant="t1", spec=spec, spec_hash=spec.spec_hash(), state="running",
                    attempts=[AttemptRecord(attempt=1, allocation_id=gang.allocation_id, epoch=gang.epoch,
                                            world_size=2, state="starting")])
    await StateStore(rig.redis).put_job(job)
    await poll(_async(lambda: any(n >= 3 for n in _copies(rig.tap, "unheard").values())),
               "WorkerStarted published again while unapplied")
    copies = _copies(rig.tap, "unheard")
    assert len(copies) == 2, "one event id per rank, however often it is published"
    # the scheduler applies them: the agent stops publishing
    job.attempts[0].started_ranks = [0, 1]
    await StateStore(rig.redis).put_job(job)
    unconfirmed = AgentKeys(NODE).unconfirmed

    async def dropped() -> bool:  # what the agent still waits for, durably (it survives restarts)
        waiting = [json.loads(v) for v in (await rig.redis.hgetall(unconfirmed)).values()]
        return not [a for a in waiting if a["job_id"] == "unheard"]

    await poll(dropped, "the agent to drop the announcements it saw applied")
    settled = rig.services.log("agent").count("published started of job unheard")
    await asyncio.sleep(3.0)  # several confirmation rounds (0.5 s apart): none publishes again
    assert rig.services.log("agent").count("published started of job unheard") == settled
    assert len(_copies(rig.tap, "unheard")) == 2


def _copies(tap: EventTap, job_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in tap.events(WorkerStarted, job_id=job_id):
        counts[str(e.event_id)] = counts.get(str(e.event_id), 0) + 1
    return counts


async def test_restart_while_redis_is_down_adopts_ranks_from_the_local_table(env: dict[str, Any], tmp_path: Path,
                                                                             rig: Rig) -> None:
    port = infra.free_port()
    server = infra.start_redis(port, tmp_path / "redis-data", tmp_path / "redis.log")
    own_redis = connect_redis(server.address)
    try:
        rig.env = {**env, "redis_url": server.address}
        rig.services.env = rig.env
        rig.redis, old_redis = own_redis, rig.redis
        await old_redis.aclose()
        agent = rig.services.start("trainyard_node_agent", "agent-1", **rig.agent_settings)
        await heartbeat_after(rig.tap)
        await rig.gang("outage")
        started = {e.rank: e for e in await rig.tap.wait(WorkerStarted, 2, job_id="outage", timeout_s=60)}
        await rig.tap.wait(StepMetrics, 4, job_id="outage", timeout_s=60)

        # the agent and Redis die; the ranks train on, writing to their spools
        agent.kill()
        agent.wait(10)
        server.process.kill()
        server.process.wait(10)
        heartbeats_before = len(rig.tap.events(NodeHeartbeat, node_id=NODE))
        agent = rig.services.start("trainyard_node_agent", "agent-2", **rig.agent_settings)
        await poll(_logged(rig.services, "agent-2", "using the local rank table"), "agent-2 reads its local table")
        await poll(_logged(rig.services, "agent-2", "adopting rank 1"), "agent-2 adopts the ranks")
        await asyncio.sleep(2.0)
        assert all(alive(e.pid) for e in started.values()), rig.services.log("agent-2")
        assert agent.poll() is None, "the agent waits for Redis instead of exiting"

        # Redis comes back (AOF): the agent starts serving, heartbeats resume
        server = infra.start_redis(port, tmp_path / "redis-data", tmp_path / "redis-2.log")
        await poll(_async(lambda: len(rig.tap.events(NodeHeartbeat, node_id=NODE)) > heartbeats_before + 2),
                   "heartbeats after Redis came back", timeout_s=90)
        os.kill(started[0].pid, signal.SIGKILL)
        (killed,) = await rig.tap.wait(WorkerExited, job_id="outage", rank=0, timeout_s=60)
        assert (killed.exit_code, killed.reason) == (-9, "killed")
        # every step rank 0 wrote, also while no agent watched it, was published: none lost
        steps = sorted({e.step for e in rig.tap.events(StepMetrics, job_id="outage", rank=0)})
        assert steps == list(range(1, steps[-1] + 1)) and steps[-1] > 10, steps
        os.killpg(os.getpgid(started[1].pid), signal.SIGKILL)
    finally:
        await own_redis.aclose()
        server.stop()


async def test_warm_interpreters_become_sandboxed_ranks_and_report_like_cold_ones(rig: Rig, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "progress_rank.py").write_text("def main():\n" + textwrap.indent(PROGRESS, "    "))
    monkeypatch.setenv("PYTHONPATH", str(modules))
    rig.services.start("trainyard_node_agent", "agent", **{**rig.agent_settings, "warm_ranks": 2,
                                                          "warm_module": "progress_rank"})  # sandboxed: the default
    await heartbeat_after(rig.tap)
    await asyncio.sleep(3.0)  # the pool fills in the background
    await rig.gang("warm")
    started = {e.rank: e for e in await rig.tap.wait(WorkerStarted, 2, job_id="warm", timeout_s=60)}
    await rig.tap.wait(StepMetrics, 4, job_id="warm", timeout_s=60)
    parents = {_cmdline(_ppid(e.pid)) for e in started.values()}
    assert all("warm.py progress_rank" in p for p in parents), parents
    for e in started.values():  # each rank entered its sandbox: the job's uid, a mount namespace of its own
        uid = int(Path(f"/proc/{e.pid}/status").read_text().split("Uid:")[1].split()[0])
        assert uid == job_uid("warm", first=1_000_000_000, count=2**20), uid
        assert os.readlink(f"/proc/{e.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    os.kill(started[0].pid, signal.SIGKILL)
    (killed,) = await rig.tap.wait(WorkerExited, job_id="warm", rank=0, timeout_s=60)
    assert (killed.exit_code, killed.reason) == (-9, "killed")
    exit_file = Path(rig.env["artifact_root"]) / "tenants/t1/jobs/warm/attempts/1/exit/rank-0.json"
    assert json.loads(exit_file.read_text())["writer"] == "warm-launcher"
    os.killpg(os.getpgid(started[1].pid), signal.SIGKILL)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _gone(pids: list[int]) -> Any:
    async def check() -> bool:
        return not any(alive(p) for p in pids)

    return check


def _logged(services: Services, name: str, text: str) -> Any:
    async def check() -> bool:
        return text in services.log(name)

    return check


def _async(fn: Any) -> Any:
    async def check() -> Any:
        return fn()

    return check


async def test_a_checkpoint_request_stops_real_ranks_as_preempted_at_one_step(rig: Rig) -> None:
    """CheckpointRequested on the broker → the agent writes the request file and signals the ranks (real
    trainers, under the launcher) → they save one step together and exit 7 → WorkerExited(preempted)
    with that step. A stale epoch is ignored, a duplicate is a no-op, and saving is not a hang."""
    from tests.integration.test_trainer_ranks import preempt_spec
    from trainyard.data import STDLIB_SOURCES, prepare_dataset

    root = Path(rig.env["artifact_root"])
    prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:6])
    data = preempt_spec().model_dump(by_alias=True, mode="json")
    data["training"]["maxSteps"] = 500  # it cannot finish before the request
    spec = TrainingSpec.model_validate(data)
    rig.services.start("trainyard_node_agent", "agent", **{
        **rig.agent_settings, "rank_command": json.dumps([sys.executable, "-m", "trainyard_trainer"]),
        "rank_env": json.dumps({"TRAINYARD_PEAK_FLOPS": "1e11"}), "hang_timeout_s": 120, "first_step_timeout_s": 300})
    await heartbeat_after(rig.tap)
    gang = await rig.gang("preempt", spec=spec)
    await rig.tap.wait(StepMetrics, 2, job_id="preempt", timeout_s=300)

    def request(epoch: int) -> CheckpointRequested:
        return CheckpointRequested(job_id="preempt", attempt=1, allocation_id=gang.allocation_id, epoch=epoch,
                                   reason="preempted by job urgent", requested_by="urgent",
                                   deadline=datetime.now(UTC) + timedelta(seconds=120))

    await rig.publisher.publish(request(gang.epoch - 1))
    await poll(_logged(rig.services, "agent", "with stale epoch"), "the stale request ignored")
    await rig.publisher.publish(request(gang.epoch))
    await rig.publisher.publish(request(gang.epoch))
    exits = {e.rank: e for e in await rig.tap.wait(WorkerExited, 2, job_id="preempt", timeout_s=300)}
    assert {(e.exit_code, e.reason) for e in exits.values()} == {(7, "preempted")}, exits
    step = exits[0].global_step
    assert step is not None and exits[1].global_step == step and step < 500
    shards = rig.tap.events(ShardWritten, job_id="preempt")
    assert sorted((s.rank, s.global_step) for s in shards) == [(0, step), (1, step)]
    request_file = root / "tenants/t1/jobs/preempt/attempts/1/checkpoint-request.json"
    assert CheckpointRequested.model_validate_json(request_file.read_bytes()).epoch == gang.epoch
    log = rig.services.log("agent")
    assert "already delivered; ignoring the duplicate" in log and "is hung" not in log
