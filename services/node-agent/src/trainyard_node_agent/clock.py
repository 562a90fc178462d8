"""The node agent's clock: monotonic time for deadlines and hang windows, wall time for what leaves the
node (a refusal's timestamp, a CheckpointRequested deadline), and sleeping. Injected, so tests (and the
pure decisions fed by it) never read the system clock themselves."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    """What the agent asks of time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines, hang windows)."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


def wall_datetime(clock: Clock) -> datetime:
    """The clock's wall time as an aware UTC datetime."""
    return datetime.fromtimestamp(clock.wall(), UTC)
