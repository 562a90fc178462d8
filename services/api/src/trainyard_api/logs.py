"""Rank logs: the files the node agents write (``ArtifactLayout.rank_log``), tailed and followed.

Under an object-store artifact root a rank's log is the segments its node agent ships as it grows
(:mod:`trainyard_contract.logsegments`): :class:`ShippedLog` reads those, :class:`LogFile` the file.

Pure: :func:`pick_attempt` (which attempt and rank a request means, or why not), :func:`last_lines`.
I/O: :class:`RankLogs` reads the log's end and, to follow, polls it for new bytes until the attempt
has ended (its record says so) and nothing more was written.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Protocol

from trainyard_contract import logsegments
from trainyard_contract.errors import NotFoundError
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.storage import ArtifactLayout, ObjectPath, list_children, read_bytes

CHUNK = 64 * 1024


def pick_attempt(job: JobRecord, attempt: int | None, rank: int) -> AttemptRecord:
    """The attempt asked for (default the newest); NotFoundError naming the attempt or rank otherwise."""
    if not job.attempts:
        raise NotFoundError(f"job {job.job_id} has no attempts yet: it has not started (query.attempt)")
    chosen = job.attempts[-1] if attempt is None else next((a for a in job.attempts if a.attempt == attempt), None)
    if chosen is None:
        have = ", ".join(str(a.attempt) for a in job.attempts)
        raise NotFoundError(f"no attempt {attempt} of job {job.job_id} (query.attempt); it has attempts {have}")
    if not 0 <= rank < chosen.world_size:
        raise NotFoundError(f"no rank {rank} in attempt {chosen.attempt} of job {job.job_id} (query.rank); "
                            f"its ranks are 0..{chosen.world_size - 1}")
    return chosen


def last_lines(data: bytes, n: int) -> bytes:
    """The last ``n`` lines of ``data`` (a trailing partial line counts as one)."""
    if n <= 0:
        return b""
    body = data[:-1] if data.endswith(b"\n") else data
    cut = len(body)
    for _ in range(n):
        cut = body.rfind(b"\n", 0, cut)
        if cut < 0:
            return data
    return data[cut + 1:]


def read_tail(path: Path, n: int, *, chunk: int = CHUNK) -> tuple[bytes, int]:
    """The last ``n`` lines of the file and its size (reading backwards; a missing file is empty)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start, data = size, b""
            while start > 0 and data.count(b"\n") <= n:
                start = max(0, start - chunk)
                f.seek(start)
                data = f.read(size - start)
            return last_lines(data, n), size
    except FileNotFoundError:
        return b"", 0


def read_from(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(CHUNK)
    except FileNotFoundError:
        return b""


class LogSource(Protocol):
    def tail(self, n: int) -> tuple[bytes, int]: ...  # the last n lines, and where the log ends
    def read_from(self, offset: int) -> bytes: ...  # some bytes from offset on (empty: none yet)


class LogFile:
    """A rank's log as a file (a directory artifact root)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def tail(self, n: int) -> tuple[bytes, int]:
        return read_tail(self.path, n)

    def read_from(self, offset: int) -> bytes:
        return read_from(self.path, offset)


class ShippedLog:
    """A rank's log as the segments its node agent shipped to an object store (a missing log is empty)."""

    def __init__(self, prefix: ObjectPath) -> None:
        self.prefix = prefix

    def _pieces(self) -> list[logsegments.Piece]:
        return logsegments.pieces((c.name, c.size or 0) for c in list_children(self.prefix) if not c.is_dir)

    def _read(self, piece: logsegments.Piece) -> bytes:
        return read_bytes(self.prefix / piece.name)[piece.skip:piece.skip + piece.length]

    def tail(self, n: int) -> tuple[bytes, int]:
        found = self._pieces()
        data = b""
        for piece in reversed(found):  # from the end, until there are enough lines
            if data.count(b"\n") > n:
                break
            data = self._read(piece) + data
        return last_lines(data, n), found[-1].end if found else 0

    def read_from(self, offset: int) -> bytes:
        """What was shipped from ``offset`` on, from one listing (up to a segment's worth past the first piece:
        a follower catching up lists once per round, not once per segment)."""
        data = b""
        for piece in self._pieces():
            if piece.end > offset and len(data) < logsegments.SEGMENT_MAX:
                data += self._read(piece)[max(0, offset - piece.start):]
        return data


class RankLogs:
    def __init__(self, layout: ArtifactLayout, *, poll_s: float = 0.5) -> None:
        self.layout = layout
        self.poll_s = poll_s

    def source(self, job: JobRecord, attempt: AttemptRecord, rank: int) -> LogSource:
        """The rank's log; of a replaced replica (faultTolerance), its latest generation's."""
        generation = attempt.generations.get(str(rank), 0)
        if self.layout.remote:
            return ShippedLog(self.layout.rank_log_segments(job.tenant, job.job_id, attempt.attempt, rank, generation))  # type: ignore[arg-type]  # remote: an ObjectPath
        return LogFile(self.layout.rank_log(job.tenant, job.job_id, attempt.attempt, rank, generation))

    async def tail(self, job: JobRecord, attempt: AttemptRecord, rank: int, lines: int) -> bytes:
        data, _ = await asyncio.to_thread(self.source(job, attempt, rank).tail, lines)
        return data

    async def follow(self, job: JobRecord, attempt: AttemptRecord, rank: int, lines: int,
                     ended: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        """The tail, then every new chunk, until ``ended()`` and the log has no more."""
        source = self.source(job, attempt, rank)
        data, offset = await asyncio.to_thread(source.tail, lines)
        if data:
            yield data
        while True:
            done = await ended()  # asked before reading: what was written before the end is sent
            while chunk := await asyncio.to_thread(source.read_from, offset):
                offset += len(chunk)
                yield chunk
            if done:
                return
            await asyncio.sleep(self.poll_s)
