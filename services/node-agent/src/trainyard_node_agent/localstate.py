"""The node-local copy of the agent's rank table, for a restart while Redis is down.

The agent keeps every rank it runs in Redis (``ty:agent:<node>:ranks``) and mirrors the same
table into one JSON file on this node (written atomically). A restarted agent reads both,
prefers the entry with the larger spool offset (the one that has published more), and adopts
the ranks that still run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainyard_contract.storage import atomic_write_bytes

log = logging.getLogger(__name__)


class LocalState:
    """``{key: entry}`` in one file; writes are throttled unless forced."""

    def __init__(self, path: Path, *, min_interval_s: float = 1.0) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        self._last_write = 0.0
        self._dirty = False

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring the unreadable local rank table %s: %r", self.path, exc)
            return {}
        return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}

    def save(self, entries: Mapping[str, Mapping[str, Any]], *, force: bool = False) -> None:
        """Write the table (at most every ``min_interval_s`` unless ``force``); never raises."""
        now = time.monotonic()
        if not force and now - self._last_write < self.min_interval_s:
            self._dirty = True
            return
        try:
            atomic_write_bytes(self.path, json.dumps(entries, sort_keys=True).encode())
        except OSError as exc:
            log.warning("could not write the local rank table %s: %r", self.path, exc)
            return
        self._last_write, self._dirty = now, False

    @property
    def dirty(self) -> bool:
        return self._dirty


def merge_tables(*tables: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """One table from several copies: per key, the entry with the largest spool offset."""
    merged: dict[str, dict[str, Any]] = {}
    for table in tables:
        for key, entry in table.items():
            current = merged.get(key)
            if current is None or int(entry.get("offset", 0)) > int(current.get("offset", 0)):
                merged[key] = dict(entry)
    return merged
