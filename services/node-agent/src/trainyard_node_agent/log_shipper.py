"""Rank logs to an object-store artifact root, as they grow (:mod:`trainyard_contract.logsegments`).

A rank writes its log on its node (``TRAINYARD_NODE_STATE_DIR``); under a directory root the API reads it
there. Under an object-store root nothing but the store is shared, so each rank's supervisor hands its
log to :meth:`LogShipper.ship` on every round: the bytes written since the last shipment become a new
segment object once ``interval_s`` has passed (or a whole segment is waiting), and everything at the end
(``final``: the rank has exited, before its WorkerExited is staged — so a finished attempt's log is
complete in the store). A failed upload is logged and tried again next round; the offset moves only
after an upload succeeded, and is kept in the rank table so that a restarted agent goes on from there.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from trainyard_contract.logsegments import SEGMENT_MAX, segment_name
from trainyard_contract.storage import ArtifactLayout, Location, commit_bytes

from trainyard_node_agent import ranks as rp
from trainyard_node_agent.clock import Clock

log = logging.getLogger(__name__)


def due(*, size: int, shipped: int, last_at: float | None, now: float, interval_s: float,
        segment_max: int = SEGMENT_MAX, final: bool = False) -> bool:
    """Whether bytes ``[shipped, size)`` of a log go out now: some are waiting, and the rank ended, a whole
    segment is waiting, or ``interval_s`` passed since the last shipment (or none was made yet)."""
    waiting = size - shipped
    if waiting <= 0:
        return False
    return final or waiting >= segment_max or last_at is None or now - last_at >= interval_s


class LogShipper:
    """Ships the logs of this node's ranks to ``layout`` (an object-store root)."""

    def __init__(self, layout: ArtifactLayout, clock: Clock, *, interval_s: float = 2.0,
                 segment_max: int = SEGMENT_MAX) -> None:
        self.layout = layout
        self.clock = clock
        self.interval_s = interval_s
        self.segment_max = segment_max

    async def ship(self, rank: rp.RankProcess, *, final: bool = False) -> None:
        """Ship what is due of ``rank``'s log (all of it when ``final``); failures wait for the next round."""
        size = rp.file_size(rank.log_path)
        while due(size=size, shipped=rank.log_shipped, last_at=rank.log_shipped_at, now=self.clock.monotonic(),
                  interval_s=self.interval_s, segment_max=self.segment_max, final=final):
            prefix = self.layout.rank_log_segments(rank.tenant, rank.job_id, rank.attempt, rank.rank, rank.generation)
            try:
                sent = await asyncio.to_thread(_ship_one, rank.log_path, rank.log_shipped, self.segment_max, prefix)
            except OSError as exc:
                log.warning("cannot ship the log of rank %s to %s (tried again next round): %s", rank.key, prefix, exc)
                return
            if sent == 0:  # the file is shorter than we shipped (replaced?): nothing sensible to send
                return
            rank.log_shipped += sent
            rank.log_shipped_at = self.clock.monotonic()


def _ship_one(path: Path, offset: int, most: int, prefix: Location) -> int:
    """Upload bytes ``[offset, offset + most)`` of ``path`` as the segment at ``offset``; how many."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(most)
    if data:
        commit_bytes(prefix / segment_name(offset), data)
    return len(data)
