"""The node agent and the scheduler as real processes (``python -m …``), against the real broker
and Redis: a killed agent's ranks keep running and the restarted agent adopts them (their exit
status comes from the launcher's exit file), ranks that died with no record are reported lost,
and SIGTERM stops an agent cleanly together with its ranks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import env_vars
from tests.integration.scheduler_workload import control_file_for
from tests.integration.test_scheduler_stack import WORKLOAD, EventTap, make_spec, poll
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_contract.events import GangAllocated, JobSubmitted, WorkerExited, WorkerStarted
from trainyard_node_agent import AgentKeys
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore, connect_redis
from tests.support.datasets import verified

class Services:
    """Starts and stops service processes; whatever is still running at the end is killed."""

    def __init__(self, env: dict[str, Any], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, module: str, name: str, **settings: object) -> subprocess.Popen[bytes]:
        own = {f"TRAINYARD_{k.upper()}": str(v) for k, v in settings.items()}
        environ = {**os.environ, **env_vars(self.env), **own}
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", module], env=environ, stdout=log,  # noqa: S603 - our own module
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen[bytes], name: str, timeout_s: float = 30.0) -> int:
        """The exit code; a process that does not stop in time fails the test with its log."""
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # a node agent logs where its tasks wait
            time.sleep(2)
            raise AssertionError(f"{name} did not stop within {timeout_s:.0f}s:\n{self.log(name)}") from None

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-12000:] if path.exists() else ""

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def services(env: dict[str, Any], tmp_path: Path) -> Iterator[Services]:
    s = Services(env, tmp_path)
    try:
        yield s
    finally:
        s.stop_all()


def reap_rank_groups(artifact_root: Path) -> list[int]:
    """Kill the process group of every rank launched under ``artifact_root`` that still runs (an agent
    killed by a test leaves its ranks running: they live in sessions of their own). Returns the groups.

    A rank's pid is in ``<attempt>/exit/rank-<r>.pid``; its group leader is its launcher (or warm
    interpreter), which is checked by name so a reused pid is never signalled."""
    reaped = []
    for pid_file in Path(artifact_root).glob("tenants/*/jobs/*/attempts/*/exit/rank-*.pid"):
        try:
            pgid = os.getpgid(int(pid_file.read_text().strip()))
            leader = Path(f"/proc/{pgid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"launcher.py" not in leader and b"warm.py" not in leader:
            continue
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        reaped.append(pgid)
    reap_attempt_cgroups(Path(artifact_root))
    return reaped


def reap_attempt_cgroups(artifact_root: Path) -> None:
    """Kill every attempt cgroup (cgroup2's ``cgroup.kill``) holding a process of a rank under ``artifact_root``:
    a rank's wrappers (its PID namespace's pid 1) are not in its launcher's group, and an agent killed by a test
    never closes its attempts' scopes."""
    marker = f"TRAINYARD_ARTIFACT_ROOT={artifact_root}".encode()
    kills = [k for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")  # pure cgroup2; a hybrid host's
             for k in Path(base).glob("trainyard/*/*/cgroup.kill")]
    for kill in kills:
        try:
            pids = [int(p) for p in (kill.parent / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0") or marker + b"\0" in environ:
                try:
                    kill.write_text("1")
                except OSError:
                    pass
                break


@pytest.fixture(autouse=True)
def reap_ranks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that has an artifact root: no rank (or its launcher) outlives it."""
    root = Path(request.getfixturevalue("env")["artifact_root"]) if "env" in request.fixturenames else None
    yield
    if root is not None:
        reap_rank_groups(root)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not running; only its parent (gone) could reap it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # it ended (and was reaped) since os.kill: ENOENT or ESRCH
        return False
    return not stat.split(") ", 1)[1].startswith("Z")


@pytest.mark.slow
async def test_restarted_agent_adopts_running_ranks_reports_lost_ones_and_sigterm_stops_them(
    env: dict[str, Any], services: Services
) -> None:
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    publisher = Bus(env["kafka_bootstrap"], service_name="test-publisher", topic_namespace=env["topic_namespace"])
    redis = connect_redis(env["redis_url"])
    store = StateStore(redis)
    await tap.start()
    await publisher.start()
    try:
        scheduler = services.start("trainyard_scheduler", "scheduler", tick_s=0.3, reconcile_interval_s=1.0,
                                   retry_backoff_s=0.3)
        # drain_timeout_s 0: this stand-in rank does not answer checkpoint requests (the trainer does: the
        # drain on SIGTERM is tested end to end in tests/e2e/test_drain.py), so SIGTERM stops its ranks at once
        agent_settings = {"node_id": "node-x", "device_count": 2, "heartbeat_s": 0.5, "kill_grace_s": 2,
                          "rank_command": json.dumps([sys.executable, str(WORKLOAD)]), "spool_poll_s": 0.1,
                          "drain_timeout_s": 0}
        agent = services.start("trainyard_node_agent", "agent-1", **agent_settings)

        async def registered() -> bool:
            return bool(await redis.hget(Keys.nodes, "node-x"))

        logs = f"{services.log('scheduler')}\n{services.log('agent-1')}"
        await poll(registered, f"node-x in the inventory; logs:\n{logs}", timeout_s=90)
        control = control_file_for(Path(env["artifact_root"]))
        control.parent.mkdir(parents=True, exist_ok=True)
        forever = {"0": 300, "1": 300}
        control.write_text(
            json.dumps({"sturdy": {"sleep": {"1": forever, "2": forever, "3": forever}}}))
        spec = make_spec(2)
        await verified(store, spec.dataset)
        assert await store.create_job(JobRecord(job_id="sturdy", tenant="t1", spec=spec, spec_hash=spec.spec_hash()))
        await publisher.publish(JobSubmitted(job_id="sturdy", tenant="t1", spec=spec, spec_hash=spec.spec_hash()))

        first = await tap.wait(WorkerStarted, 2, job_id="sturdy", attempt=1, timeout_s=90)
        pids = {e.rank: e.pid for e in first}
        assert all(_is_workload(p) for p in pids.values()), "WorkerStarted names the rank itself, not its launcher"
        # 1. kill -9 of the agent: its ranks live on (own session) ...
        agent.kill()
        agent.wait(10)
        assert all(alive(p) for p in pids.values())
        old = await _boots(redis, first)
        assert len(old) == 2
        # ... and the next agent adopts them instead of killing them.
        agent = services.start("trainyard_node_agent", "agent-2", **agent_settings)
        await poll(_adopted_by_a_new_boot(redis, first, old), "the restarted agent to adopt both ranks", timeout_s=90)
        await asyncio.sleep(2.0)
        assert all(alive(p) for p in pids.values()), services.log("agent-2")
        assert tap.events(WorkerExited, job_id="sturdy") == []
        job = await store.get_job("sturdy")
        assert job is not None and job.attempts[-1].attempt == 1 and job.attempts[-1].state == "running"

        # 2. an adopted rank dies: its exit status comes from the launcher's exit file, not "lost"
        os.kill(pids[0], signal.SIGKILL)
        (killed,) = await tap.wait(WorkerExited, job_id="sturdy", attempt=1, rank=0, timeout_s=60)
        assert (killed.exit_code, killed.reason) == (-9, "killed"), killed
        (revoked,) = await tap.wait(WorkerExited, job_id="sturdy", attempt=1, rank=1, timeout_s=60)
        assert revoked.reason == "revoked"
        await poll(_async(lambda: not any(alive(p) for p in pids.values())), "attempt 1's ranks gone")

        # 3. the agent and the whole rank process groups die together: no exit status anywhere → lost
        (second,) = await tap.wait(GangAllocated, job_id="sturdy", attempt=2, timeout_s=90)
        # a newer fencing epoch than attempt 1's (not necessarily the next: a grant whose MULTI lost a race with
        # another write to the job, such as its rank's WorkerExited, used one up and the placement was decided again)
        assert second.epoch > first[0].epoch
        started = await tap.wait(WorkerStarted, 2, job_id="sturdy", attempt=2, timeout_s=90)
        agent.kill()
        agent.wait(10)
        for e in started:
            os.killpg(os.getpgid(e.pid), signal.SIGKILL)
        await poll(_async(lambda: not any(alive(e.pid) for e in started)), "attempt 2's ranks killed")
        agent = services.start("trainyard_node_agent", "agent-3", **agent_settings)
        lost = await tap.wait(WorkerExited, 2, job_id="sturdy", attempt=2, timeout_s=90)
        assert {(e.reason, e.exit_code) for e in lost} == {("lost", -9)}, lost
        failed = _async_job(store, lambda j: len(j.attempts) > 1 and j.attempts[1].state == "failed")
        await poll(failed, "the scheduler to fail attempt 2", timeout_s=90)  # a hang guard, as above
        job = await store.get_job("sturdy")
        assert job is not None and (job.attempts[1].failure_reason or "").startswith("lost:"), job.attempts[1]

        # 4. SIGTERM: the agent stops its ranks, reports them, and exits 0.
        third = await tap.wait(WorkerStarted, 2, job_id="sturdy", attempt=3, timeout_s=90)
        agent.send_signal(signal.SIGTERM)
        assert services.wait(agent, "agent-3") == 0, services.log("agent-3")
        stopped = await tap.wait(WorkerExited, 2, job_id="sturdy", attempt=3, timeout_s=30)
        assert {e.reason for e in stopped} == {"killed"}
        assert not any(alive(e.pid) for e in third)

        scheduler.send_signal(signal.SIGTERM)
        assert services.wait(scheduler, "scheduler") == 0, services.log("scheduler")
        assert await redis.get("ty:sched:leader") is None  # handed back on a clean stop
    finally:
        await tap.stop()
        await publisher.aclose()
        await redis.aclose()


def _is_workload(pid: int) -> bool:
    return str(WORKLOAD) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")


async def _boots(redis: Any, started: list[WorkerStarted]) -> dict[str, str]:
    """The agent incarnation that holds each started rank in its table (rank key → boot id)."""
    raw = await redis.hgetall(AgentKeys("node-x").ranks)
    keys = [f"{e.allocation_id}/{e.rank}" for e in started]
    return {k: json.loads(raw[k])["boot"] for k in keys if k in raw}


def _adopted_by_a_new_boot(redis: Any, started: list[WorkerStarted], old: dict[str, str]) -> Any:
    async def check() -> bool:
        now = await _boots(redis, started)
        return len(now) == len(started) and all(now[k] != old.get(k) for k in now)

    return check


def _async_job(store: StateStore, predicate: Any) -> Any:
    async def check() -> bool:
        job = await store.get_job("sturdy")
        return job is not None and predicate(job)

    return check


def _async(fn: Any) -> Any:
    async def check() -> Any:
        return fn()

    return check


def test_help_lists_the_settings() -> None:
    for module, variable in (("trainyard_node_agent", "TRAINYARD_RANK_COMMAND"),
                             ("trainyard_scheduler", "TRAINYARD_NODE_TIMEOUT_S")):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        assert variable in out and "SIGTERM" in out
    missing = subprocess.run([sys.executable, "-m", "trainyard_node_agent"], capture_output=True, text=True,
                             timeout=60, env={k: v for k, v in os.environ.items() if k != "TRAINYARD_NODE_ID"})
    assert missing.returncode == 2 and "TRAINYARD_NODE_ID" in missing.stderr
