"""Fault injection for tests, applied where the scheduler is composed (``__main__``), never inside it.

:class:`PauseAfterGrant` wraps :class:`~trainyard_scheduler.fencing.FencedLeases`: each gang's lease grant
returns only after a pause, which holds the placement between its grant and its attempt record long enough
for a test to act in that window (kill the leader, take over) even on a loaded host. The scheduler cannot
tell the wrapper from the real leases; with ``admit_pause_s`` = 0 (every deployment) nothing is wrapped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from trainyard_contract.devices import Device

from trainyard_scheduler.fencing import FencedLeases


class PauseAfterGrant(FencedLeases):
    """:class:`FencedLeases` whose :meth:`acquire` waits ``pause_s`` after a successful grant."""

    def __init__(self, leases: FencedLeases, pause_s: float) -> None:
        super().__init__(leases.redis, ttl_ms=leases.ttl_ms)
        self.pause_s = pause_s

    async def acquire(self, leader_epoch: int, job_id: str, allocation_id: str, devices: Sequence[Device]) -> int:
        epoch = await super().acquire(leader_epoch, job_id, allocation_id, devices)
        await asyncio.sleep(self.pause_s)
        return epoch


def with_faults(leases: FencedLeases, *, admit_pause_s: float) -> FencedLeases:
    """The leases the scheduler gets: as they are, or paused after each grant (tests only)."""
    return PauseAfterGrant(leases, admit_pause_s) if admit_pause_s > 0 else leases
