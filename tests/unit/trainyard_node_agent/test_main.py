"""The node agent's process lifecycle: start in order, return quietly when stopped while waiting for Redis and
the broker, close the agent before the runtime, once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from trainyard_runtime.service import serve_until_signalled
from trainyard_node_agent import __main__ as main


class Journal:
    """The runtime and the agent in one: what was called, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def part(self, name: str) -> Any:
        journal = self

        class Part:
            async def prepare(self) -> None:
                journal.calls.append(f"{name}.prepare")

            async def start(self) -> None:
                journal.calls.append(f"{name}.start")

            async def aclose(self) -> None:
                journal.calls.append(f"{name}.aclose")

        return Part()


def process(journal: Journal, stop: asyncio.Event) -> main.NodeAgentProcess:
    return main.NodeAgentProcess(journal.part("runtime"), None, journal.part("agent"), stop)  # type: ignore[arg-type]  # a test double


async def test_starts_in_order_and_closes_the_agent_before_the_runtime_once(monkeypatch: pytest.MonkeyPatch) -> None:
    async def dependencies_answer(*args: object) -> bool:
        return True

    monkeypatch.setattr(main, "wait_for_dependencies", dependencies_answer)
    journal, stop = Journal(), asyncio.Event()
    agent_process = process(journal, stop)
    await agent_process.start()
    await agent_process.aclose()
    await agent_process.aclose()
    assert journal.calls == ["agent.prepare", "runtime.start", "agent.start", "agent.aclose", "runtime.aclose"]


async def test_stopped_while_waiting_for_its_dependencies_it_returns_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    async def never_answer(runtime: object, settings: object, stop: asyncio.Event) -> bool:
        stop.set()  # SIGTERM while Redis and the broker are still away
        return False

    monkeypatch.setattr(main, "wait_for_dependencies", never_answer)
    journal, stop = Journal(), asyncio.Event()
    await asyncio.wait_for(serve_until_signalled(process(journal, stop), "node agent", stop), 5.0)
    assert journal.calls == ["agent.prepare", "agent.aclose", "runtime.aclose"]
