"""Least-recently-used eviction, pure: which cached things to delete to free some bytes. The node's code
cache (``trainyard_node_agent.codecache``) and dataset shard cache (``trainyard.shardcache``) both use it."""

from __future__ import annotations

from collections.abc import Collection, Iterable


def least_recently_used(entries: Iterable[tuple[str, int, float]], *, need_bytes: int,
                        keep: Collection[str] = ()) -> list[str]:
    """Of ``entries`` (key, size in bytes, last used), the keys to delete to free at least ``need_bytes``:
    least recently used first (ties by key, so the choice is stable), never one in ``keep``. Fewer —
    possibly none — when what is not kept does not suffice; none when ``need_bytes`` <= 0."""
    chosen: list[str] = []
    for key, size, _used in sorted(entries, key=lambda e: (e[2], e[0])):
        if need_bytes <= 0:
            break
        if key in keep:
            continue
        chosen.append(key)
        need_bytes -= size
    return chosen
