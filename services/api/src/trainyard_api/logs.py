"""Rank logs: the files the node agents write (``ArtifactLayout.rank_log``), tailed and followed.

Pure: :func:`pick_attempt` (which attempt and rank a request means, or why not), :func:`last_lines`.
I/O: :class:`RankLogs` reads the file's end and, to follow, polls it for new bytes until the attempt
has ended (its record says so) and nothing more was written.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from trainyard_common.errors import NotFoundError
from trainyard_common.records import AttemptRecord, JobRecord
from trainyard_common.storage import ArtifactLayout

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


class RankLogs:
    def __init__(self, layout: ArtifactLayout, *, poll_s: float = 0.5) -> None:
        self.layout = layout
        self.poll_s = poll_s

    def path(self, job: JobRecord, attempt: AttemptRecord, rank: int) -> Path:
        return self.layout.rank_log(job.tenant, job.job_id, attempt.attempt, rank)

    async def tail(self, job: JobRecord, attempt: AttemptRecord, rank: int, lines: int) -> bytes:
        data, _ = await asyncio.to_thread(read_tail, self.path(job, attempt, rank), lines)
        return data

    async def follow(self, job: JobRecord, attempt: AttemptRecord, rank: int, lines: int,
                     ended: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        """The tail, then every new chunk, until ``ended()`` and the file has no more."""
        path = self.path(job, attempt, rank)
        data, offset = await asyncio.to_thread(read_tail, path, lines)
        if data:
            yield data
        while True:
            done = await ended()  # asked before reading: what was written before the end is sent
            while chunk := await asyncio.to_thread(read_from, path, offset):
                offset += len(chunk)
                yield chunk
            if done:
                return
            await asyncio.sleep(self.poll_s)
