"""The node agent's own lifecycle: where it is (:class:`Phase`, one holder every part reads) and the
background tasks it must cancel when it closes.

An agent prepares (adopts what an earlier incarnation left running) before Redis and the broker answer,
serves once they do, and drains when stopped. One that is stopped before it served leaves its ranks
running for the next incarnation to adopt; one that served stops them (design.md §7, failover).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Coroutine
from typing import Any


class Phase(enum.Enum):
    PREPARING = "preparing"  # adopting; Redis and the broker may still be away
    SERVING = "serving"  # handlers, heartbeats and watchdogs run
    DRAINING = "draining"  # stopped after serving: its ranks checkpoint and stop
    LEFT_RUNNING = "left-running"  # stopped before serving: its ranks keep running for the next agent


class Lifecycle:
    """The agent's phase, shared by reference with the parts that behave differently while it closes."""

    def __init__(self) -> None:
        self.phase = Phase.PREPARING

    @property
    def serving(self) -> bool:
        """It served (and its watchdogs still look after the ranks while it drains)."""
        return self.phase in (Phase.SERVING, Phase.DRAINING)

    @property
    def closing(self) -> bool:
        return self.phase in (Phase.DRAINING, Phase.LEFT_RUNNING)

    def serve(self) -> None:
        self.phase = Phase.SERVING

    def close(self) -> bool:
        """Enter the closing phase; False when it was closing already (close is idempotent)."""
        if self.closing:
            return False
        self.phase = Phase.DRAINING if self.phase is Phase.SERVING else Phase.LEFT_RUNNING
        return True


class Background:
    """Fire-and-forget tasks (a revoked rank's stop, a code-cache collection), kept until done, cancelled on close."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
