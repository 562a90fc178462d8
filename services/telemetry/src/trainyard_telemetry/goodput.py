"""The goodput ledger: where a job's allocated device-time went. Pure; no Redis, clock or Kafka.

For each attempt, its wall time (start → end, or → now while it runs) times its world size is
*allocated*. It is split, in this order, each part capped by what is left:

1. ``launchRestore``   attempt start → start of its first completed step (launch, rendezvous, restore);
2. ``checkpointStall`` Σ of rank 0's ``checkpointSeconds`` (training waited for a save);
3. ``productive``      step time (without stalls) of steps a READY checkpoint saved — a DELETED one was
                       READY, a refused one never counts — or, for the attempt that succeeded, every step
                       (the final model);
4. ``lostWork``        step time after the attempt's last READY checkpoint, for an attempt that ended
                       without success (redone by the next attempt);
5. ``inFlight``        the same for an attempt still running (not lost yet, not saved yet);
6. ``hang``            for an attempt that ended with reason ``hang``: its last step → its end;
7. ``idle``            the rest (boundaries, reporting gaps, teardown), so the parts add up to
                       ``allocated`` exactly.

``replicaDown`` (``faultTolerance``): the device-time of a failed replica's rank from its failure until its
newcomer started (one device per replica), while the others trained on; taken from what the attempt's steps
counted (productive, then in flight, then idle), since those steps ran without that replica.

Device-time is counted in integer device-microseconds so the sum is exact; views convert to seconds.
Step timing comes from rank 0's StepMetrics (:class:`StepTiming`, kept by ``steptiming.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord

KINDS: tuple[str, ...] = ("productive", "lostWork", "launchRestore", "checkpointStall", "hang", "replicaDown",
                          "inFlight", "idle")
WASTE_KINDS: tuple[str, ...] = ("lostWork", "launchRestore", "checkpointStall", "hang", "replicaDown", "idle")
_US = 1_000_000


@dataclass(frozen=True)
class StepTiming:
    """Rank 0's step timing of one attempt.

    ``points`` holds (step, cumulative work seconds through that step) for the newest steps only
    (bounded; see ``steptiming.py``); older steps are interpolated with the attempt's mean step time.
    Work seconds are step seconds without the checkpoint stall of the step.
    """

    attempt: int
    steps: int = 0
    first_step: int | None = None
    first_step_at: datetime | None = None
    first_step_seconds: float = 0.0
    last_step: int | None = None
    last_step_at: datetime | None = None
    work_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    points: Sequence[tuple[int, float]] = ()
    recent_work_seconds: float | None = None
    """An exponential moving average of the work seconds of the attempt's steps (α = ``WORK_EWMA_ALPHA``):
    the step time the checkpoint interval advice weighs a save against."""

    def work_through(self, step: int) -> float:
        """Cumulative work seconds of this attempt's steps up to and including ``step``."""
        if not self.steps or self.first_step is None or self.last_step is None or step < self.first_step:
            return 0.0
        if step >= self.last_step:
            return self.work_seconds
        points = sorted(self.points)
        steps = [s for s, _ in points]
        i = bisect.bisect_right(steps, step)
        mean = self.work_seconds / self.steps
        if i == 0:  # older than every kept point: back from the oldest one at the mean step time
            oldest_step, oldest_cum = points[0] if points else (self.last_step, self.work_seconds)
            return max(oldest_cum - (oldest_step - step) * mean, 0.0)
        s0, c0 = points[i - 1]
        if s0 == step or i == len(points):
            return min(c0 + (step - s0) * mean, self.work_seconds)
        s1, c1 = points[i]
        return c0 + (c1 - c0) * (step - s0) / (s1 - s0)


@dataclass
class Ledger:
    """Device-microseconds: ``allocated`` and its parts by kind (``sum(parts) == allocated``)."""

    allocated: int = 0
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, other: Ledger) -> Ledger:
        self.allocated += other.allocated
        for kind, value in other.parts.items():
            self.parts[kind] = self.parts.get(kind, 0) + value
        return self

    @property
    def wasted(self) -> int:
        return sum(self.parts[k] for k in WASTE_KINDS)

    def seconds(self) -> dict[str, float]:
        """Device-seconds: allocated, productive, wasted and every kind."""
        out = {"allocated": self.allocated / _US, "wasted": self.wasted / _US}
        out.update({kind: value / _US for kind, value in self.parts.items()})
        return out

    @property
    def goodput(self) -> float | None:
        """productive ÷ allocated (None before anything was allocated)."""
        return self.parts["productive"] / self.allocated if self.allocated else None

    def to_json(self) -> dict[str, int]:
        return {"allocated": self.allocated, **self.parts}

    @classmethod
    def from_json(cls, data: Mapping[str, int]) -> Ledger:
        return cls(int(data["allocated"]), {k: int(data.get(k, 0)) for k in KINDS})


def _us(seconds: float) -> int:
    return max(int(round(seconds * _US)), 0)


class _Budget:
    """Hands out an attempt's wall microseconds in order, never more than is left."""

    def __init__(self, total: int) -> None:
        self.left = total

    def take(self, wanted_us: int) -> int:
        given = min(max(wanted_us, 0), self.left)
        self.left -= given
        return given


def ended_by_hang(attempt: AttemptRecord) -> bool:
    return attempt.ended_at is not None and (attempt.failure_reason or "").startswith("hang")


def attempt_ledger(
    attempt: AttemptRecord, timing: StepTiming | None, saved_steps: Iterable[int], *, now: datetime
) -> Ledger:
    """One attempt's ledger. ``saved_steps``: global steps of READY (or DELETED) checkpoints it wrote."""
    end = attempt.ended_at or now
    wall = _us((end - attempt.started_at).total_seconds())
    budget = _Budget(wall)
    parts = dict.fromkeys(KINDS, 0)
    if timing is None or not timing.steps or timing.first_step_at is None or timing.last_step_at is None:
        parts["hang" if ended_by_hang(attempt) else "launchRestore"] = budget.take(wall)
    else:
        first_started = timing.first_step_at.timestamp() - timing.first_step_seconds
        parts["launchRestore"] = budget.take(_us(first_started - attempt.started_at.timestamp()))
        parts["checkpointStall"] = budget.take(_us(timing.checkpoint_seconds))
        if attempt.state == "succeeded":
            saved = timing.work_seconds
        else:
            last_step = timing.last_step if timing.last_step is not None else 0
            last_saved = max((s for s in saved_steps if s <= last_step), default=None)
            saved = timing.work_through(last_saved) if last_saved is not None else 0.0
        parts["productive"] = budget.take(_us(saved))
        unsaved = _us(timing.work_seconds - saved)
        parts["inFlight" if attempt.ended_at is None else "lostWork"] = budget.take(unsaved)
        if ended_by_hang(attempt):
            parts["hang"] = budget.take(_us((end - timing.last_step_at).total_seconds()))
    parts["idle"] = budget.left
    w = max(attempt.world_size, 0)
    ledger = Ledger(wall * w, {k: v * w for k, v in parts.items()})
    down = _replicas_down_us(attempt, end)
    for kind in ("productive", "inFlight", "idle"):  # those steps ran without the replica: its share is down time
        moved = min(down, ledger.parts[kind])
        ledger.parts[kind] -= moved
        ledger.parts["replicaDown"] += moved
        down -= moved
    return ledger


def _replicas_down_us(attempt: AttemptRecord, end: datetime) -> int:
    """Device-µs of the attempt's failed replicas, each from its failure to its newcomer's start (or the end)."""
    total = 0
    for r in attempt.replacements:
        back = min(r.started_at or end, end)
        total += max(_us((back - r.at).total_seconds()), 0)
    return total


def saved_steps_by_attempt(checkpoints: Iterable[CheckpointRecord]) -> dict[int, list[int]]:
    """Steps each attempt saved: READY checkpoints, and DELETED ones (READY until retention)."""
    saved: dict[int, list[int]] = {}
    for c in checkpoints:
        if c.state in ("READY", "DELETED"):  # only READY records become DELETED
            saved.setdefault(c.attempt, []).append(c.global_step)
    return saved


def job_ledger(
    job: JobRecord, checkpoints: Iterable[CheckpointRecord], timings: Mapping[int, StepTiming], *, now: datetime
) -> Ledger:
    """The job's ledger: the sum over its attempts."""
    saved = saved_steps_by_attempt(checkpoints)
    total = Ledger()
    for attempt in job.attempts:
        total.add(attempt_ledger(attempt, timings.get(attempt.attempt), saved.get(attempt.attempt, []), now=now))
    return total


def total(ledgers: Iterable[Ledger]) -> Ledger:
    out = Ledger()
    for ledger in ledgers:
        out.add(ledger)
    return out
