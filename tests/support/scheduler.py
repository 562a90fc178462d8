"""What an in-process :class:`trainyard_scheduler.Scheduler` needs of a ServiceRuntime, for tests that drive it
themselves on a real Redis (no broker: the test delivers events and calls its loops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import StateStore


@dataclass
class SchedulerRuntime:
    redis: Any
    store: StateStore
    outbox: Outbox
    instance: str
