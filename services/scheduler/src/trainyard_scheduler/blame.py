"""Who is to blame when the nodes of a live attempt stop heart-beating. Pure.

A node is blamed only for what points at it. Silence alone is weak evidence: when most of the
cluster goes quiet at once, or this scheduler has not been watching long enough to have seen
the heartbeats (it just started or took over: a leader gap, a restart of every service), the
cause is the control plane, the broker or the network, not the nodes. And a node that is being
drained stops on purpose. :func:`judge_silence` says which, in this order:

* ``alive``          — every node of the attempt heart-beats;
* ``drain``          — every silent node is being drained: the drain ends the attempt (checkpoint,
  then stop), no failure;
* ``wait``           — this scheduler has watched for less than ``node_timeout_s``: its view of the
  heartbeats has a gap, so nothing is concluded yet;
* ``control-plane``  — more than ``cluster_share`` of the recently seen nodes are silent together:
  the attempt is interrupted and retried, but no node is blamed and no failure budget is spent;
* ``node``           — the silent nodes went quiet alone: the attempt fails as ``lost`` and they
  are blamed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from trainyard_contract.errors import ConfigError

SilenceVerdict = Literal["alive", "drain", "wait", "control-plane", "node"]


@dataclass(frozen=True)
class SilencePolicy:
    node_timeout_s: float = 15.0
    cluster_share: float = 0.5  # more than this share of the recently seen nodes silent together: not the nodes
    recent_s: float = 3600.0  # nodes seen within this long make up "the cluster"

    def __post_init__(self) -> None:
        if self.node_timeout_s <= 0 or not 0 < self.cluster_share <= 1 or self.recent_s < self.node_timeout_s:
            raise ConfigError("silence policy: node_timeout_s > 0, 0 < cluster_share <= 1, recent_s >= node_timeout_s "
                              f"(got {self})")


@dataclass(frozen=True)
class Silence:
    verdict: SilenceVerdict
    nodes: tuple[str, ...] = ()  # the attempt's silent nodes
    detail: str = ""


def judge_silence(attempt_nodes: Collection[str], *, available: Collection[str], last_seen: Mapping[str, datetime],
                  draining: Collection[str], watching_since: datetime | None, now: datetime,
                  policy: SilencePolicy) -> Silence:
    """Judge the silent nodes of one live attempt (see the module docstring).

    ``available``: nodes heart-beating within the node timeout; ``last_seen``: every node of the
    inventory and its last heartbeat; ``watching_since``: when this scheduler began to lead.
    """
    silent = tuple(n for n in attempt_nodes if n not in available)
    if not silent:
        return Silence("alive")
    names = ", ".join(silent)
    if all(n in draining for n in silent):
        return Silence("drain", silent, f"node {names} is being drained")
    watched = (now - watching_since).total_seconds() if watching_since is not None else 0.0
    if watched < policy.node_timeout_s:
        return Silence("wait", silent, f"node {names} silent, but this scheduler has watched the heartbeats for "
                                       f"{watched:.0f}s only (under the node timeout {policy.node_timeout_s:.0f}s)")
    cluster = {n for n, seen in last_seen.items() if (now - seen).total_seconds() <= policy.recent_s} | set(silent)
    quiet = sorted(n for n in cluster if n not in available and n not in draining)  # drained ones stop on purpose
    if len(quiet) > policy.cluster_share * len(cluster):
        return Silence("control-plane", silent,
                       f"{len(quiet)} of {len(cluster)} nodes stopped sending heartbeats together "
                       f"({', '.join(quiet[:8])}{', …' if len(quiet) > 8 else ''}): a control-plane or network "
                       "interruption, not a node fault")
    alone = tuple(n for n in silent if n not in draining)
    return Silence("node", alone, f"node {', '.join(alone)} stopped sending heartbeats")
