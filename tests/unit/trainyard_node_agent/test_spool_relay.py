"""The spool relay: a line the broker refuses holds up the lines behind it, but never a checkpoint report."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainyard_contract.events import CHECKPOINTS, METRICS, ShardWritten, StepMetrics
from trainyard_contract.spool import SpoolReader
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.agent import NodeAgent
from trainyard_node_agent.settings import NodeAgentSettings


class Redis:
    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, str]] = {}

    async def hset(self, key: str, field: str, value: str) -> None:
        self.hashes.setdefault(key, {})[field] = value


class Bus:
    """Publishes to a list; refuses every topic in ``refusing``."""

    def __init__(self) -> None:
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.refusing: set[str] = set()

    async def publish_raw_traced(self, topic: str, body: bytes, *, key: str | None, traceparent: str | None) -> None:
        if topic in self.refusing:
            raise ConnectionError(f"{topic}: UnknownError")
        self.published.append((topic, json.loads(body)))


class Spool:
    """What a rank appends: one JSON line per event."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, topic: str, key: str, payload: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"topic": topic, "key": key, "traceparent": None, "payload": payload}) + "\n")


def agent_and_rank(tmp_path: Path) -> tuple[NodeAgent, rp.RankProcess, Bus, Spool]:
    bus, redis = Bus(), Redis()
    settings = NodeAgentSettings(node_id="n", artifact_root=tmp_path, agent_state_file=tmp_path / "ranks.json")
    runtime = SimpleNamespace(redis=redis, bus=bus, outbox=None)
    agent = NodeAgent(runtime, settings, base_env={})  # type: ignore[arg-type]  # a stand-in runtime
    spool = tmp_path / "rank-1.jsonl"
    rank = rp.RankProcess(job_id="j", tenant="t", attempt=1, allocation_id="al", epoch=1, rank=1, local_rank=1,
                          pid=0, log_path=tmp_path / "rank.log", spool=SpoolReader(spool), traceparent=None,
                          exit_file=tmp_path / "exit.json", device_index=1)
    return agent, rank, bus, Spool(spool)


def step(writer: Spool, n: int) -> None:
    writer.write(METRICS, "j", json.loads(StepMetrics(job_id="j", tenant="t", attempt=1, rank=1, step=n, loss=1.0,
                                                      consumed_tokens=n).to_bytes()))


def shard(writer: Spool, tmp_path: Path, n: int) -> str:
    event = ShardWritten(job_id="j", tenant="t", attempt=1, epoch=1, global_step=n, rank=1, world_size=2,
                         uri=(tmp_path / "tenants/t/jobs/j/checkpoints/s/__1_0.distcp").as_uri(), size_bytes=1,
                         sha256="0" * 64)
    writer.write(CHECKPOINTS, "j", json.loads(event.to_bytes()))
    return str(event.event_id)


async def test_a_refused_step_metric_does_not_hold_up_the_checkpoint_report_behind_it(tmp_path: Path) -> None:
    agent, rank, bus, writer = agent_and_rank(tmp_path)
    step(writer, 9)
    assert await agent.spool_relay.relay(rank, quiet=True) == 1
    bus.refusing.add(METRICS)  # a partition refusing produce requests after a broker restart
    step(writer, 10)
    shard(writer, tmp_path, 10)
    step(writer, 11)

    assert await agent.spool_relay.relay(rank, quiet=True) == 1  # the report, sent ahead of step 10
    assert [(t, p["eventType"]) for t, p in bus.published] == [(METRICS, "StepMetrics"), (CHECKPOINTS, "ShardWritten")]
    held_at = rank.spool.offset
    # confirmed end to end as usual
    assert agent.announcements.pending and next(iter(agent.announcements.pending.values())).step == 10

    await agent.spool_relay.relay(rank, quiet=True)  # still refused: the report is not published twice
    assert sum(t == CHECKPOINTS for t, _ in bus.published) == 1 and rank.spool.offset == held_at

    bus.refusing.clear()
    await agent.spool_relay.relay(rank, quiet=True)
    assert [p.get("step", p.get("globalStep")) for _, p in bus.published] == [9, 10, 10, 11]
    assert len({p["eventId"] for t, p in bus.published if t == CHECKPOINTS}) == 1  # skipped in order
    assert rank.spool.offset == rank.spool.path.stat().st_size


async def test_when_the_checkpoints_topic_refuses_too_everything_waits_in_order(tmp_path: Path) -> None:
    agent, rank, bus, writer = agent_and_rank(tmp_path)
    bus.refusing |= {METRICS, CHECKPOINTS}
    step(writer, 10)
    shard(writer, tmp_path, 10)
    assert await agent.spool_relay.relay(rank, quiet=True) == 0 and rank.spool.offset == 0
    bus.refusing.clear()
    await agent.spool_relay.relay(rank, quiet=True)
    assert [p["eventType"] for _, p in bus.published] == ["StepMetrics", "ShardWritten"]


async def test_an_undecodable_line_is_dead_lettered_and_the_lines_after_it_are_relayed(tmp_path: Path) -> None:
    agent, rank, bus, writer = agent_and_rank(tmp_path)
    dead: list[Any] = []

    async def publish(event: Any, **_: Any) -> None:
        dead.append(event)

    bus.publish = publish  # type: ignore[attr-defined]  # a test double's method
    step(writer, 1)
    with writer.path.open("ab") as f:
        f.write(b'\x00{"topic": "x"}\n')  # a NUL byte: UnicodeDecodeError, not JSONDecodeError
        f.write(b'{"topic": "\xff"}\n')  # invalid UTF-8
    step(writer, 2)
    await agent.spool_relay.relay(rank)  # not quiet: an error would be raised here
    assert [p["step"] for _, p in bus.published] == [1, 2]
    assert [d.error for d in dead] == ["unreadable spool line (not one JSON object)"] * 2
    assert rank.spool.offset == rank.spool.path.stat().st_size


async def test_a_line_whose_handling_fails_for_good_is_dead_lettered_not_retried(tmp_path: Path,
                                                                                  monkeypatch: Any) -> None:
    from trainyard_node_agent import spool_relay

    agent, rank, bus, writer = agent_and_rank(tmp_path)
    dead: list[Any] = []

    async def publish(event: Any, **_: Any) -> None:
        dead.append(event)

    bus.publish = publish  # type: ignore[attr-defined]  # a test double's method
    real = spool_relay.check_line

    def check_line(record: Any, who: Any, *, offset: int) -> Any:
        if record["payload"].get("step") == 1:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(record, who, offset=offset)

    monkeypatch.setattr(spool_relay, "check_line", check_line)
    step(writer, 1)
    step(writer, 2)
    await agent.spool_relay.relay(rank)
    assert [p["step"] for _, p in bus.published] == [2]
    assert len(dead) == 1 and dead[0].error.startswith("spool line that cannot be relayed: UnicodeDecodeError")


async def test_draining_a_spool_that_is_a_fifo_gives_up_at_once_with_the_reason(tmp_path: Path) -> None:
    import os

    agent, rank, bus, writer = agent_and_rank(tmp_path)
    os.mkfifo(writer.path)  # a plain open() would block the event loop for good
    assert await agent.spool_relay.drain(rank) == "spool refused: not a regular file (a FIFO)"
    assert bus.published == []
