"""A rank's log in an object store: append-only, as immutable segments.

An object store cannot append, and a rank's log lives on its node. Under an object-store artifact root
the node agent ships each rank's log as it grows (:class:`trainyard_node_agent.log_shipper.LogShipper`):
the bytes from offset ``o`` on, up to :data:`SEGMENT_MAX`, become one object named ``<o, 16 digits>.log``
under :meth:`~trainyard_contract.storage.ArtifactLayout.rank_log_segments`. A segment is written once and
never changed; the log is the segments in offset order. An agent that restarted without knowing how far
it had shipped ships again from an earlier offset: segments may overlap, and the overlap is the same
bytes, so a reader takes each byte from the first segment that has it (:func:`pieces`).

Pure: naming and assembly. The API reads the pieces (:mod:`trainyard_api.logs`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

SEGMENT_MAX = 4 * 1024 * 1024  # bytes in one segment object at most
_NAME = re.compile(r"^(\d{16})\.log$")


def segment_name(offset: int) -> str:
    """The object name of the segment that starts at byte ``offset`` of the log."""
    if not 0 <= offset < 10**16:
        raise ValueError(f"log offset out of range: {offset}")
    return f"{offset:016d}.log"


def segment_offset(name: str) -> int | None:
    """The offset a segment's name says; None for any other name."""
    found = _NAME.match(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Piece:
    """The bytes ``[start, start + length)`` of the log: segment ``name`` from byte ``skip`` on."""

    name: str
    start: int
    skip: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def pieces(listing: Iterable[tuple[str, int]]) -> list[Piece]:
    """The log as pieces of its segments, in order, each byte once: ``listing`` is (name, size) of the
    objects under the rank's prefix (other names ignored). A segment within what earlier ones cover
    adds nothing; a gap (a segment lost, or still being written by a slow upload) is skipped over."""
    segments = sorted((offset, size, name) for name, size in listing
                      if (offset := segment_offset(name)) is not None and size > 0)
    out: list[Piece] = []
    covered = 0
    for offset, size, name in segments:
        if offset + size <= covered:
            continue
        skip = max(0, covered - offset)
        out.append(Piece(name, offset + skip, skip, size - skip))
        covered = offset + size
    return out


def size(listing: Iterable[tuple[str, int]]) -> int:
    """Where the shipped log ends."""
    found = pieces(listing)
    return found[-1].end if found else 0
