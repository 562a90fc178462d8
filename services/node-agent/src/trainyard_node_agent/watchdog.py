"""Hang detection, as a pure decision.

A rank makes progress when its event spool grows (a StepMetrics per step, a ShardWritten per
checkpoint). A rank of user code (``spec.code``) also makes progress when its log grows: a plain
torchrun-style script never writes the spool, and printing is how it shows it is alive. Output
only resets the clock, it never shortens the limit: until the rank's first *event* the longer
``first_step_timeout_s`` applies between two lines of output (a script that prints "loading…"
and then restores for ten minutes is not late), afterwards ``timeout_s``. So a plain script must
print at least every ``first_step_timeout_s``; one that neither prints nor reports hangs out.
:func:`observe` turns the sizes the agent measured into a rank's :class:`Liveness`.

An attempt is hung on this node when any of its ranks here has made no progress
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
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Liveness:
    """What the agent remembers of one rank's progress between two observations."""

    at: float  # monotonic time of its last progress (or of its launch, adoption, checkpoint request)
    spool_bytes: int = 0  # its event spool's size when last observed
    log_bytes: int = 0  # its log's size when last observed (user code only)
    reported: bool = False  # it wrote at least one event (the SDK or the built-in trainer)
    printed: bool = False  # its log grew at least once while watched (user code only)

    def restarted(self, now: float) -> Liveness:
        """A fresh window from ``now`` (nothing else changes)."""
        return replace(self, at=now)


def observe(last: Liveness, *, spool_bytes: int, log_bytes: int | None, now: float) -> Liveness:
    """The rank's liveness after measuring its spool and, for user code, its log (``log_bytes`` None: the
    log does not count, as for the built-in trainer). Growth is progress; a file that shrank (replaced)
    is only a new baseline."""
    wrote = spool_bytes > last.spool_bytes
    printed = log_bytes is not None and log_bytes > last.log_bytes
    return Liveness(
        at=now if wrote or printed else last.at,
        spool_bytes=spool_bytes,
        log_bytes=last.log_bytes if log_bytes is None else log_bytes,
        reported=last.reported or wrote,
        printed=last.printed or printed,
    )


@dataclass(frozen=True)
class RankProgress:
    """What the watchdog needs of one running rank."""

    allocation_id: str
    rank: int
    pid: int
    since_progress_s: float  # seconds since its spool (or, for user code, its log) last grew, or since launch
    has_progressed: bool  # it wrote at least one event
    state: str | None = None  # /proc state letter (R, S, D, T, t, Z…), None if unknown
    saving_on_request: bool = False  # asked to checkpoint and stop, and the request's deadline is ahead
    output_counts: bool = False  # user code: its log growing counts as progress too (named in the detail)


@dataclass(frozen=True)
class Hung:
    allocation_id: str
    detail: str
    ranks: tuple[int, ...] = ()  # the late ranks (a fault-tolerant attempt stops only these: its replicas)


def find_hangs(ranks: Iterable[RankProgress], *, timeout_s: float, first_step_timeout_s: float) -> list[Hung]:
    """One :class:`Hung` per allocation with at least one rank past its progress deadline."""
    by_allocation: dict[str, list[RankProgress]] = {}
    for r in ranks:
        by_allocation.setdefault(r.allocation_id, []).append(r)
    hung: list[Hung] = []
    for allocation_id, members in sorted(by_allocation.items()):
        late = sorted((r for r in members if _late(r, timeout_s, first_step_timeout_s)), key=lambda r: r.rank)
        if late:
            hung.append(Hung(allocation_id, describe(late, timeout_s, first_step_timeout_s),
                             tuple(r.rank for r in late)))
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
    if all(r.output_counts for r in late):
        what += " and no output"
    limit = timeout_s if started else first_step_timeout_s
    detail = f"{what} for {waited:.0f}s (limit {limit:g}s): {names}"
    stopped = [r for r in late if r.state in ("T", "t")]
    if stopped:
        detail += "; stopped (SIGSTOP or a debugger): " + ", ".join(f"rank {r.rank}" for r in stopped)
    return detail
