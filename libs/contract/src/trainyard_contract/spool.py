"""The event spool: how a torch rank hands events to its node agent.

A rank appends one JSON line per event to its own file (``SpoolWriter``; flushed and
fsynced, so an event that was written survives a crash of the rank). The node agent
tails every rank's file (``SpoolReader``) and publishes each line with the rank's trace
context. Ranks therefore keep training while the broker is down: their events wait in
the file and are flushed on reconnect; consumers are idempotent by ``eventId``.

Line format: ``{"topic": …, "key": …, "traceparent": …, "payload": {event JSON}}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainyard_contract.events import Event
from trainyard_contract.rankfiles import open_rank_file


class SpoolWriter:
    """Append-only, one line per event; safe to use from one process (one rank)."""

    def __init__(self, path: Path | str, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._fsync = fsync

    def write(self, event: Event, *, traceparent: str | None = None, durable: bool = True) -> None:
        """Append ``event``. The line reaches the OS at once, so a crash of the rank loses nothing;
        ``durable`` (and the writer's ``fsync``) also fsyncs it, so a crash of the host loses
        nothing either — for checkpoint reports; per-step metrics skip it (``durable=False``)."""
        line = json.dumps(
            {
                "topic": event.topic,
                "key": event.key(),
                "traceparent": traceparent,
                "payload": json.loads(event.to_bytes()),
            },
            separators=(",", ":"),
        )
        self._fh.write(line + "\n")
        self._fh.flush()
        if self._fsync and durable:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MAX_LINE_BYTES = 1 << 20  # a spool line longer than this is refused (a rank runs untrusted code)
READ_BYTES = 8 << 20  # at most this much is read per call, so a huge spool never lands in memory at once


def decode_line(text: bytes) -> dict[str, Any]:
    """One spool line as its record, or ``{"corrupt": …}`` (a printable excerpt) for anything that is not a
    JSON object in UTF-8: a NUL byte, invalid UTF-8 (UnicodeDecodeError), broken JSON, a bare value."""
    try:
        record = json.loads(text.decode("utf-8"))  # strict UTF-8: json's own guess would try UTF-16/32
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError alike; nesting too deep
        record = None
    if not isinstance(record, dict):
        return {"corrupt": text[:4096].decode(errors="replace")}
    return record


class SpoolReader:
    """Reads complete lines past ``offset``; a partial last line is left for next time.

    Bounded: at most :data:`READ_BYTES` per call, and a line longer than :data:`MAX_LINE_BYTES` is
    yielded as ``{"corrupt": …}`` (not its bytes) and skipped to its end, however long it grows. A line
    that is not UTF-8 JSON (a NUL byte, invalid UTF-8, broken JSON, not an object) is ``{"corrupt": …}``
    too, and the lines after it are read as usual. The file is opened as a rank's file
    (:func:`~trainyard_contract.rankfiles.open_rank_file`): a symlink, FIFO or device in its place raises
    :class:`~trainyard_contract.rankfiles.RankFileRefused` instead of being followed or blocking."""

    def __init__(self, path: Path | str, offset: int = 0) -> None:
        self.path = Path(path)
        self.offset = offset
        self._skipping = False  # inside an over-long line: drop bytes up to its newline

    def read_new(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(offset_after_line, record)``; commit by storing the offset after publishing."""
        fd = open_rank_file(self.path, what="spool")
        if fd is None:
            return
        with open(fd, "rb") as fh:
            fh.seek(self.offset)
            while self._skipping:  # inside an over-long line: drop its bytes, a chunk at a time
                chunk = fh.read(READ_BYTES)
                if not chunk:
                    return
                cut = chunk.find(b"\n")
                self.offset += len(chunk) if cut < 0 else cut + 1
                if cut >= 0:
                    self._skipping = False
                    fh.seek(self.offset)
            data = fh.read(READ_BYTES)
        base, start = self.offset, 0
        while (end := data.find(b"\n", start)) >= 0:
            raw, after, start = data[start:end], base + end + 1, end + 1
            text = raw.strip()
            if not text:
                continue
            if len(raw) > MAX_LINE_BYTES:
                yield after, {"corrupt": f"a spool line of {len(raw)} bytes (the limit is {MAX_LINE_BYTES})"}
                continue
            yield after, decode_line(text)
        if len(data) - start > MAX_LINE_BYTES:
            self._skipping = True
            yield base + len(data), {"corrupt": f"a spool line longer than {MAX_LINE_BYTES} bytes: skipped to its end"}
