"""What an attack cost the node agent, for the record (printed; never asserted: these machines are loaded): the
longest gap between two of its heartbeats while the attacks ran, next to the interval it was configured with."""

from __future__ import annotations

from typing import Any

from trainyard_contract.events import NodeHeartbeat


def heartbeat_gaps(tap: Any, node_id: str) -> list[float]:
    """Seconds between consecutive NodeHeartbeats of ``node_id`` the tap saw (by their occurredAt)."""
    beats = sorted(e.occurred_at for e in tap.events(NodeHeartbeat, node_id=node_id))
    return [(b - a).total_seconds() for a, b in zip(beats, beats[1:], strict=False)]


def report(what: str, tap: Any, node_id: str, interval_s: float) -> str:
    gaps = heartbeat_gaps(tap, node_id)
    line = (f"[figure] {what}: {len(gaps) + 1} heartbeats of {node_id}, longest gap {max(gaps, default=0):.2f} s "
            f"(interval {interval_s:.2f} s)")
    print(line, flush=True)
    return line
