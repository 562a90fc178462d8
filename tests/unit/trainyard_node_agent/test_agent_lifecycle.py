"""The agent applying a rank's lifecycle (:mod:`supervision`): how each way of ending it is reported, and
the injected clock behind a checkpoint request's deadline."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainyard_contract.events import CheckpointRequested
from trainyard_contract.spool import SpoolReader
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.agent import NodeAgent
from trainyard_node_agent.relay import Refusal
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.supervision import RankState, Trigger


class FakeClock:
    def __init__(self) -> None:
        self.now, self.epoch = 1000.0, 1_700_000_000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.epoch

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


class Outbox:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def put(self, *events: object, traceparent: str | None = None) -> None:
        self.events += events


class Process:
    """A launched rank's process; pid 0, so the agent never signals anything."""

    def __init__(self) -> None:
        self.pid, self.returncode = 0, None

    async def wait(self) -> int | None:
        return self.returncode


class Redis:
    async def hset(self, *args: object) -> None:
        pass


def make(tmp_path: Path, rank_no: int = 0) -> tuple[NodeAgent, rp.RankProcess, FakeClock]:
    clock = FakeClock()
    settings = NodeAgentSettings(node_id="n", artifact_root=tmp_path, agent_state_file=tmp_path / "ranks.json",
                                 hang_timeout_s=30)
    runtime = SimpleNamespace(redis=Redis(), bus=None, outbox=Outbox())
    agent = NodeAgent(runtime, settings, base_env={}, clock=clock)  # type: ignore[arg-type]  # a test double
    rank = rp.RankProcess(job_id="j", tenant="t", attempt=1, allocation_id="al", epoch=1, rank=rank_no,
                          local_rank=rank_no, pid=0, log_path=tmp_path / f"rank-{rank_no}.log",
                          spool=SpoolReader(tmp_path / f"rank-{rank_no}.jsonl"), traceparent=None,
                          exit_file=tmp_path / "exit" / f"rank-{rank_no}.json")
    rank.process = Process()  # type: ignore[assignment]  # a fake process
    supervisor = agent.attempts.supervisor(rank)
    supervisor.apply(Trigger.LAUNCHED)
    agent.ranks[rank.key] = supervisor
    return agent, rank, clock


def exited(rank: rp.RankProcess, code: int | None) -> None:
    rank.process.returncode = code if code is not None else -9  # type: ignore[union-attr]  # present here (the test asserts it)
    if code is not None:
        rank.exit_file.parent.mkdir(parents=True, exist_ok=True)
        rank.exit_file.write_text(json.dumps({"exitCode": code}))


@pytest.mark.parametrize(("stop", "code", "outcome"), [
    (None, 0, ("ok", None)),
    (None, None, ("killed", None)),  # our child: its status is known, not lost
    ("agent", 0, ("ok", "the node agent stopped")),
    ("agent", -15, ("killed", "the node agent stopped")),
    ("revoke", -15, ("revoked", "allocation released")),
    ("preempt", -15, ("preempted", "preempted for job b")),
    ("revoke+violation", -9, ("security", "forged")),
    ("revoke+agent", -15, ("revoked", "allocation released")),
])
async def test_how_a_rank_ended_follows_what_the_agent_decided(tmp_path: Path, stop: str | None, code: int | None,
                                                               outcome: tuple[str, str | None]) -> None:
    agent, rank, _ = make(tmp_path)
    if stop and stop.startswith("revoke"):
        agent.control.revoke(agent.ranks[rank.key], "allocation released")
    if stop == "preempt":
        agent.control.revoke(agent.ranks[rank.key], "preempted for job b")
    if stop and stop.endswith("agent"):
        stopping = agent.ranks[rank.key].apply(Trigger.AGENT_STOPPING, "the node agent stopped")
        assert stopping is not None
        exited(rank, code)
        await stopping
    if stop == "revoke+violation":
        agent.runtime.outbox = Outbox()
        await agent.control.violation(rank, Refusal("forged", violation=True, event_type="ShardWritten"))
    exited(rank, code)
    assert agent.ranks[rank.key].how_it_ended()[1:] == outcome


async def test_a_violation_stops_every_rank_of_the_allocation_once(tmp_path: Path) -> None:
    agent, first, _ = make(tmp_path, 0)
    _, second, _ = make(tmp_path, 1)
    agent.ranks[second.key] = agent.attempts.supervisor(second)
    refusal = Refusal("forged", violation=True, event_type="ShardWritten")
    await agent.control.violation(first, refusal)
    await agent.control.violation(first, refusal)
    assert [r.state for r in (first, second)] == [RankState.VIOLATED, RankState.VIOLATED]
    assert second.stop_detail == "rank 0 of this job was stopped: forged"
    assert len(agent.runtime.outbox.events) == 1  # one SecurityViolation


async def test_a_checkpoint_request_is_delivered_once_with_its_deadline_on_the_injected_clock(tmp_path: Path) -> None:
    agent, rank, clock = make(tmp_path)
    deadline = datetime.fromtimestamp(clock.epoch + 90, UTC)
    request = CheckpointRequested(job_id="j", attempt=1, allocation_id="al", epoch=1, reason="preempt",
                                  deadline=deadline)
    await agent.control.on_checkpoint_requested(request)
    assert rank.state is RankState.CHECKPOINTING
    assert rank.checkpoint_deadline == pytest.approx(clock.now + 90) and rank.liveness.at == clock.now
    clock.now += 5
    await agent.control.on_checkpoint_requested(request)  # a duplicate: nothing moves
    assert rank.checkpoint_deadline == pytest.approx(clock.now - 5 + 90)
    agent.control.revoke(agent.ranks[rank.key], "preempted")
    assert rank.state is RankState.REVOKED
