"""One rank's supervisor: it relays while the rank runs, drains the spool before the exit is staged, and
reports a rank that ended unwatched as such."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainyard_contract.events import WorkerExited
from trainyard_contract.spool import SpoolReader
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.supervision import RankState, Trigger
from trainyard_node_agent.supervisor import RankSupervisor, SupervisorContext


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


class Journal:
    """Relay, outbox and announcements in one: what happened, in order."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.exits: list[WorkerExited] = []

    async def relay(self, rank: rp.RankProcess, *, quiet: bool = False) -> int:
        self.steps.append("relay")
        return 0

    async def drain(self, rank: rp.RankProcess) -> None:
        self.steps.append("drain")

    async def put(self, *events: Any, traceparent: str | None = None) -> None:
        self.steps.append("exit")
        self.exits += events

    async def track(self, event: Any, kind: str, rank: rp.RankProcess, traceparent: str | None) -> None:
        self.steps.append(f"track {kind}")


class Process:
    """A rank's process that has ended already; pid 0, so nothing is ever signalled."""

    def __init__(self, code: int) -> None:
        self.pid, self.returncode = 0, code

    async def wait(self) -> int:
        return self.returncode


def supervised(tmp_path: Path, journal: Journal) -> RankSupervisor:
    settings = NodeAgentSettings(node_id="n", artifact_root=tmp_path, agent_state_file=tmp_path / "ranks.json")
    context = SupervisorContext(settings, FakeClock(), journal, journal, journal,  # type: ignore[arg-type]  # a test double
                                closing=lambda: False)
    rank = rp.RankProcess(job_id="j", tenant="t", attempt=1, allocation_id="al", epoch=1, rank=0, local_rank=0,
                          pid=0, log_path=tmp_path / "rank-0.log", spool=SpoolReader(tmp_path / "rank-0.jsonl"),
                          traceparent=None, exit_file=tmp_path / "exit" / "rank-0.json")
    return RankSupervisor(rank, context)


async def test_the_spool_is_drained_before_the_exit_is_staged(tmp_path: Path) -> None:
    journal = Journal()
    supervisor = supervised(tmp_path, journal)
    supervisor.rank.process = Process(0)  # type: ignore[assignment]  # a fake process
    supervisor.apply(Trigger.LAUNCHED)
    await supervisor.run()
    assert journal.steps == ["relay", "drain", "exit", "track exited"]
    assert [(e.exit_code, e.reason, e.node_id) for e in journal.exits] == [(0, "ok", "n")]


async def test_a_rank_that_ended_unwatched_says_so(tmp_path: Path) -> None:
    journal = Journal()
    supervisor = supervised(tmp_path, journal)
    supervisor.rank.exit_file.parent.mkdir(parents=True)
    supervisor.rank.exit_file.write_text(json.dumps({"exitCode": 0}))
    await supervisor.report_unwatched()
    (exited,) = journal.exits
    assert journal.steps[:2] == ["drain", "exit"]
    assert exited.reason == "ok" and exited.detail is not None
    assert exited.detail.endswith("it ended while its node agent was down")


async def test_an_adopted_rank_whose_group_vanished_has_ended(tmp_path: Path) -> None:
    journal = Journal()
    supervisor = supervised(tmp_path, journal)
    supervisor.apply(Trigger.ADOPTED)
    assert supervisor.rank.state is RankState.RUNNING and supervisor.rank.adopted
    await supervisor.run()  # pgid 0 is never the same process: gone after one poll
    assert supervisor.rank.gone and journal.exits[0].reason == "lost"


class Shipper:
    """Records the log shipments a supervisor asks for, in the journal."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    async def ship(self, rank: rp.RankProcess, *, final: bool = False) -> None:
        self.journal.steps.append("ship final" if final else "ship")


async def test_under_an_object_store_the_whole_log_is_shipped_before_the_exit_is_staged(tmp_path: Path) -> None:
    journal = Journal()
    supervisor = supervised(tmp_path, journal)
    supervisor.context = replace(supervisor.context, logs=Shipper(journal))  # type: ignore[arg-type]  # a test double
    supervisor.rank.process = Process(0)  # type: ignore[assignment]  # a fake process
    supervisor.apply(Trigger.LAUNCHED)
    await supervisor.run()
    assert journal.steps == ["relay", "ship", "drain", "ship final", "exit", "track exited"]


async def test_an_exit_note_that_is_a_fifo_is_refused_with_a_named_reason(tmp_path: Path) -> None:
    import os

    journal = Journal()
    supervisor = supervised(tmp_path, journal)
    supervisor.rank.process = Process(0)  # type: ignore[assignment]  # a fake process
    supervisor.rank.last_step = 41
    supervisor.apply(Trigger.LAUNCHED)
    supervisor.rank.exit_file.parent.mkdir(parents=True)
    os.mkfifo(supervisor.rank.note_file)  # read_text() would wait for a writer for ever
    await supervisor.run()
    (exited,) = journal.exits
    assert exited.exit_code == 0 and exited.global_step == 41  # the last step relayed instead
    assert exited.detail is not None and "exit note refused: not a regular file (a FIFO)" in exited.detail


async def test_exit_files_that_are_links_or_huge_are_refused(tmp_path: Path) -> None:
    journal = Journal()
    supervisor = supervised(tmp_path, journal)
    rank = supervisor.rank
    rank.process = Process(3)  # type: ignore[assignment]  # a fake process
    supervisor.apply(Trigger.LAUNCHED)
    rank.exit_file.parent.mkdir(parents=True)
    rank.note_file.symlink_to("/dev/zero")
    with open(rank.exit_file, "wb") as fh:
        fh.truncate(20 << 30)  # sparse: a read would cost 20 GiB of memory
    rank.log_path.symlink_to("/dev/zero")
    await supervisor.run()
    (exited,) = journal.exits
    assert exited.exit_code == 3  # the process's own status, since the exit file was refused
    assert exited.detail is not None
    assert "exit note refused: a symlink (never followed)" in exited.detail
    assert "exit file refused: too large (21474836480 bytes" in exited.detail
