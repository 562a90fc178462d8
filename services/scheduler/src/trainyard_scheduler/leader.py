"""This instance's part in the leadership (design.md §3.7): whether it leads, under which epoch, since when.

The lease itself and its fencing live in :mod:`trainyard_scheduler.fencing`; this is what the shell keeps of it.
A new term starts the leader's work from durable state (``on_new_term``: the snapshot rebuilt, the reconcile due
at once, so the predecessor's orphans are repaired first); losing it, or a fenced write refused, stands it by.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from trainyard_scheduler.fencing import Leadership

log = logging.getLogger(__name__)


class LeaderRole:
    """Take or renew the fenced leader lease, and remember what this instance's term is."""

    def __init__(self, leadership: Leadership, instance: str, *, clock: Callable[[], datetime],
                 on_new_term: Callable[[], None]) -> None:
        self.leadership, self.instance, self.clock = leadership, instance, clock
        self._on_new_term = on_new_term
        self.epoch: int | None = None  # the leader epoch while this instance leads
        self.since: datetime | None = None  # when this term began: heartbeats before it were not watched

    async def lead(self) -> int | None:
        """Take or renew the fenced leader lease; returns the leader epoch while this instance leads."""
        epoch = await self.leadership.maintain()
        if epoch is None:
            if self.epoch is not None:
                log.warning("no longer the scheduling leader (epoch %d); standing by", self.epoch)
            self.epoch = None
        elif epoch != self.epoch:
            log.info("scheduling leader now (leader epoch %d, instance %s)", epoch, self.instance)
            self.epoch = epoch
            self.since = self.clock()
            self._on_new_term()
        return self.epoch

    async def renew(self) -> None:
        """:meth:`lead` as the runtime's loop (its own cadence, so a long pass never lets the lease lapse)."""
        await self.lead()

    def stand_by(self) -> None:
        """Stop leading now (a newer leader, or a refused fenced write): the next :meth:`lead` takes it again."""
        self.epoch = None
        self.leadership.epoch = None

    async def resign(self) -> None:
        """Give up the lease so a standby does not wait for it to expire."""
        await self.leadership.resign()
