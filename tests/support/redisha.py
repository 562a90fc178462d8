"""A Redis primary, its replica and one Sentinel (quorum 1, fast failure detection) on free 127.0.0.1
ports in a temporary directory, for the failover tests (trainyard_cli.redisha does the work)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainyard_cli import infra, redisha


@contextmanager
def redis_ha(root: Path) -> Iterator[redisha.RedisHA]:
    """Started and in sync; stopped (every process) on exit."""
    ha = redisha.RedisHA(root, root / "logs", (infra.free_port(), infra.free_port()), (infra.free_port(),))
    try:
        ha.start(timings=redisha.FAST, quorum=1)
        yield ha
    finally:
        ha.stop()
