"""``start_concurrently``: a service's consumer groups join side by side, not one after another (each start waits
for its group's first assignment), and a failed start leaves no consumer behind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from trainyard_runtime.bus import start_concurrently


class Part:
    def __init__(self, name: str, log: list[str], gate: asyncio.Barrier | None = None,
                 error: BaseException | None = None) -> None:
        self.name, self.log, self.gate, self.error = name, log, gate, error

    async def start(self) -> None:
        self.log.append(f"begin {self.name}")
        if self.gate is not None:
            await self.gate.wait()  # returns only once every subscriber has begun its start
        if self.error is not None:
            raise self.error
        self.log.append(f"end {self.name}")


class Broker:
    def __init__(self, subscribers: list[Part], publishers: list[Part], log: list[str]) -> None:
        self.subscribers, self.publishers, self.log = subscribers, publishers, log
        self.running = False

    async def connect(self) -> None:
        self.log.append("connect")

    async def stop(self) -> None:
        self.log.append("stop")


async def test_every_group_begins_joining_before_any_has_joined() -> None:
    log: list[str] = []
    gate = asyncio.Barrier(3)
    broker: Any = Broker([Part(f"s{i}", log, gate) for i in range(3)], [Part("p", log)], log)
    # one after another, the first start would wait at the barrier for the others forever
    async with asyncio.timeout(60):
        await start_concurrently(broker)
    assert log[0] == "connect" and set(log[1:4]) == {"begin s0", "begin s1", "begin s2"}
    assert set(log[4:7]) == {"end s0", "end s1", "end s2"}
    assert log[7:] == ["begin p", "end p"] and broker.running


async def test_a_failed_start_stops_the_others_and_raises_it() -> None:
    log: list[str] = []
    gate = asyncio.Barrier(2)
    refused = OSError("connection refused")
    broker: Any = Broker([Part("ok", log, gate), Part("bad", log, gate, error=refused)], [Part("p", log)], log)
    async with asyncio.timeout(60):
        with pytest.raises(OSError) as raised:
            await start_concurrently(broker)
    assert raised.value is refused
    assert log[-1] == "stop" and "begin p" not in log and not broker.running
