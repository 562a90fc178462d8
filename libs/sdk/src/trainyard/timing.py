"""Where a rank's time goes between two ``run.report`` calls: data wait, compute, collectives, checkpoints.

Each StepMetrics carries these per rank, which is what the platform's straggler detection and
goodput accounting read. Wrap the parts of your step::

    with run.timing.data():
        batch = next(loader)
    with run.timing.compute():
        loss = model(x, y); loss.backward()
        with run.timing.collective():      # nested: counted as collective, not compute
            dist.all_reduce(...)

Timers nest: a timer's bucket gets its own time less the time of the timers inside it. On CUDA
``compute`` and ``collective`` synchronise the device when they end (the host runs ahead of
the device; without it the time would land in whatever waits next).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

__all__ = ["StepTimes", "Timing"]

BUCKETS = ("data_wait", "compute", "collective", "checkpoint")


@dataclass
class StepTimes:
    """Seconds of one step (or of the window since the last report) by kind."""

    data_wait: float = 0.0
    compute: float = 0.0
    collective: float = 0.0
    checkpoint: float = 0.0


class _Timer:
    __slots__ = ("_timing", "_bucket", "_sync", "_started", "_nested_before")

    def __init__(self, timing: Timing, bucket: str, sync: bool) -> None:
        self._timing, self._bucket, self._sync = timing, bucket, sync
        self._started = 0.0
        self._nested_before = 0.0

    def __enter__(self) -> _Timer:
        t = self._timing
        self._nested_before = t._nested
        t._nested = 0.0
        self._started = t.clock()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        t = self._timing
        if self._sync:
            t.synchronize()
        elapsed = t.clock() - self._started
        setattr(t.window, self._bucket, getattr(t.window, self._bucket) + max(0.0, elapsed - t._nested))
        t._nested = self._nested_before + elapsed  # the enclosing timer excludes all of this one


class Timing:
    """The per-rank timers of a run (``run.timing``); :meth:`take` ends the window."""

    def __init__(self, *, synchronize: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.synchronize = synchronize
        self.clock = clock
        self.window = StepTimes()
        self._nested = 0.0

    def data(self) -> _Timer:
        """Time spent waiting for input (``data_wait_seconds``)."""
        return _Timer(self, "data_wait", False)

    def compute(self) -> _Timer:
        """Forward, backward and optimizer time (``compute_seconds``)."""
        return _Timer(self, "compute", True)

    def collective(self) -> _Timer:
        """Exposed communication: all-reduce, all-gather, … (``collective_seconds``)."""
        return _Timer(self, "collective", True)

    def checkpoint(self) -> _Timer:
        """Time training waited for a checkpoint (``checkpoint_seconds``); the SDK times its own saves."""
        return _Timer(self, "checkpoint", False)

    def add(self, *, data_wait: float = 0.0, compute: float = 0.0, collective: float = 0.0,
            checkpoint: float = 0.0) -> None:
        """Add seconds measured elsewhere (the built-in trainer measures its step itself)."""
        w = self.window
        w.data_wait += data_wait
        w.compute += compute
        w.collective += collective
        w.checkpoint += checkpoint

    def take(self) -> StepTimes:
        """The window's times; a new window starts."""
        window, self.window = self.window, StepTimes()
        return window
