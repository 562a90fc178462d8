"""Hang detection, as a pure decision.

A rank makes progress when its event spool grows (a StepMetrics per step, a ShardWritten per
checkpoint). An attempt is hung on this node when any of its ranks here has made no progress
for ``timeout_s`` (``first_step_timeout_s`` before its first event: start-up, rendezvous and
restore take longer than a step). Then the agent stops *all* its ranks of that attempt at once,
instead of leaving the healthy ones to wait out their collective timeout; the scheduler revokes
the ranks on other nodes and starts a new attempt.

A rank asked to checkpoint and stop (CheckpointRequested) is not late while it saves: until the
request's deadline its silence is the save, not a hang.

The detail names the ranks that made no progress, and which of them are stopped (state ``T``:
SIGSTOP or a debugger), since a stopped process is the usual culprit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RankProgress:
    """What the watchdog needs of one running rank."""

    allocation_id: str
    rank: int
    pid: int
    since_progress_s: float  # seconds since its spool last grew (or since it was launched)
    has_progressed: bool  # it wrote at least one event
    state: str | None = None  # /proc state letter (R, S, D, T, t, Z…), None if unknown
    saving_on_request: bool = False  # asked to checkpoint and stop, and the request's deadline is ahead


@dataclass(frozen=True)
class Hung:
    allocation_id: str
    detail: str


def find_hangs(ranks: Iterable[RankProgress], *, timeout_s: float, first_step_timeout_s: float) -> list[Hung]:
    """One :class:`Hung` per allocation with at least one rank past its progress deadline."""
    by_allocation: dict[str, list[RankProgress]] = {}
    for r in ranks:
        by_allocation.setdefault(r.allocation_id, []).append(r)
    hung: list[Hung] = []
    for allocation_id, members in sorted(by_allocation.items()):
        late = sorted((r for r in members if _late(r, timeout_s, first_step_timeout_s)), key=lambda r: r.rank)
        if late:
            hung.append(Hung(allocation_id, describe(late, timeout_s, first_step_timeout_s)))
    return hung


def _late(r: RankProgress, timeout_s: float, first_step_timeout_s: float) -> bool:
    if r.saving_on_request:
        return False
    return r.since_progress_s > (timeout_s if r.has_progressed else first_step_timeout_s)


def describe(late: list[RankProgress], timeout_s: float, first_step_timeout_s: float) -> str:
    """A sentence naming the late ranks and the stopped ones."""
    names = ", ".join(f"rank {r.rank} (pid {r.pid})" for r in late)
    waited = max(r.since_progress_s for r in late)
    started = all(r.has_progressed for r in late)
    what = "no step progress" if started else "no first step"
    limit = timeout_s if started else first_step_timeout_s
    detail = f"{what} for {waited:.0f}s (limit {limit:g}s): {names}"
    stopped = [r for r in late if r.state in ("T", "t")]
    if stopped:
        detail += "; stopped (SIGSTOP or a debugger): " + ", ".join(f"rank {r.rank}" for r in stopped)
    return detail
