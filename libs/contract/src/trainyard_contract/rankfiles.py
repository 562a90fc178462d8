"""Reading a file a rank can write (its exit note, its spool, what the launcher left beside them).

Nothing a rank controls is trusted (CONVENTIONS.md, "Trust boundaries"): the name may be a FIFO (an
``open`` that never returns), a symlink to ``/dev/zero`` or another tenant's file, a directory, or a
20 GB sparse file. :func:`open_rank_file` opens it ``O_NOFOLLOW|O_NONBLOCK`` (a FIFO's open returns at
once), and refuses anything that is not a regular file (``fstat``); :func:`read_rank_file` also reads
at most ``limit`` bytes (a bigger file is refused, never read). :func:`aread_rank_file` runs the read
off the event loop, so a slow disk never stops the agent's heartbeats either.

A refusal is a :class:`RankFileRefused` whose message names the file and why, e.g.
``exit note refused: not a regular file (a FIFO)``. A file that does not exist is ``None``: a rank
that wrote nothing is not an attack.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from pathlib import Path

from trainyard_contract.errors import TrainyardError

DEFAULT_LIMIT = 64 * 1024  # exit notes, exit files, pid files: a few hundred bytes in practice
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RankFileRefused(TrainyardError):
    """A file a rank controls that the platform will not read: ``what`` refused: ``reason``."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what} refused: {reason}")
        self.what, self.reason = what, reason


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a file"


def open_rank_file(path: Path | str, *, what: str = "rank file") -> int | None:
    """A read-only descriptor (``O_CLOEXEC``, blocking reads again) of the regular file ``path``; None if
    it does not exist. Raises :class:`RankFileRefused` for a symlink, FIFO, device, directory or socket."""
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RankFileRefused(what, "a symlink (never followed)") from exc
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a socket; a directory on some systems
            raise RankFileRefused(what, "not a regular file") from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RankFileRefused(what, f"not a regular file ({_kind(mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_rank_file(path: Path | str, *, limit: int = DEFAULT_LIMIT, what: str = "rank file") -> bytes | None:
    """The bytes of the regular file ``path`` (at most ``limit``), None if it does not exist. Raises
    :class:`RankFileRefused` for anything else, or a file bigger than ``limit`` (never read)."""
    fd = open_rank_file(path, what=what)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise RankFileRefused(what, f"too large ({size} bytes; the limit is {limit})")
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # it grew since the fstat
            raise RankFileRefused(what, f"too large (more than {limit} bytes)")
        return data
    finally:
        os.close(fd)


async def aread_rank_file(path: Path | str, *, limit: int = DEFAULT_LIMIT, what: str = "rank file") -> bytes | None:
    """:func:`read_rank_file` in a worker thread: the event loop never waits on a rank's file."""
    return await asyncio.to_thread(read_rank_file, path, limit=limit, what=what)
