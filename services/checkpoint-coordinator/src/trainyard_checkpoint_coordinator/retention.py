"""Which checkpoints retention would remove (``checkpointPolicy.keepLast``). Pure.

The seam for retention / GC: the coordinator calls :func:`retention_candidates` after
each READY and, for now, only logs the result. Deleting (and the rules that protect a
checkpoint an attempt is resuming from, or one the registry exported) is the next
issue's work.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainyard_common.records import CheckpointRecord


def retention_candidates(checkpoints: Sequence[CheckpointRecord], keep_last: int) -> list[CheckpointRecord]:
    """READY checkpoints older than the newest ``keep_last`` READY ones, oldest first."""
    ready = sorted((c for c in checkpoints if c.state == "READY"), key=lambda c: (c.global_step, c.attempt))
    return ready[: max(len(ready) - keep_last, 0)]
