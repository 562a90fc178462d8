"""One retry policy, as data (temporalio's ``RetryPolicy``): how long to wait after each failure, and when to stop.

Every place that tries something again states its numbers as a :class:`RetryPolicy` and asks it for the delay;
none doubles a delay by hand:

========================================  =========  ===========  =======  =========
site                                      initial    coefficient  maximum  attempts
========================================  =========  ===========  =======  =========
bus redelivery of a failed event          0.4 s      2            10 s     for ever
outbox relay, broker or Redis away        0.2 s      2            10 s     for ever
idle-fetch doorbell listener              0.5 s      2            10 s     for ever
a service's periodic loop (every ``t``)   2 ``t``    2            30 s     for ever
node agent: spool relay, exit record      0.2 s      2            5 s      its give-up rule
node agent at start: Redis, the broker    0.5 s      2            5 s      until stopped
Redis client, a dead connection           0.1 s      2            0.5 s    4
Redis client through Sentinel             0.2 s      2            1 s      13
scheduler: a job's next attempt           0.5 s      2            60 s     ``max_total_failures``
========================================  =========  ===========  =======  =========

Pure: no clock and no sleeping here; the caller sleeps. Jitter draws from an injected source, and is off unless
a policy asks for it (none does yet: each site's numbers are what they were before the policy was one type).
:class:`Backoff` is the failure streak of a loop that retries for ever (reset by a success).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff", "RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """Wait ``initial_interval_s`` after the first failure, ``backoff_coefficient`` times longer after each
    further one, never longer than ``maximum_interval_s``; spread each wait by up to ``jitter`` of itself either
    way; give up after ``maximum_attempts`` tries in all (None: never)."""

    initial_interval_s: float = 1.0
    backoff_coefficient: float = 2.0
    maximum_interval_s: float = 100.0
    maximum_attempts: int | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.initial_interval_s < 0 or self.maximum_interval_s < 0:
            raise ValueError("retry intervals must not be negative")
        if self.backoff_coefficient < 1:
            raise ValueError("the back-off coefficient must be at least 1")
        if self.maximum_attempts is not None and self.maximum_attempts < 1:
            raise ValueError("maximum_attempts must be at least 1 (None: no limit)")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter is a fraction of the delay, between 0 and 1")

    def delay(self, failures: int, draw: Callable[[], float] = random.random) -> float:
        """Seconds to wait after failure number ``failures`` in a row (1: the first) before the next try.
        ``draw`` (uniform in [0, 1)) is called only when the policy has jitter."""
        try:
            raw = self.initial_interval_s * self.backoff_coefficient ** max(failures - 1, 0)
        except OverflowError:  # a coefficient to a huge power: the cap applies
            raw = math.inf
        delay = min(self.maximum_interval_s, raw)
        if self.jitter:
            delay *= 1.0 + self.jitter * (2.0 * draw() - 1.0)
        return delay

    def exhausted(self, attempts: int) -> bool:
        """Whether ``attempts`` tries so far have spent the policy's budget (no further try)."""
        return self.maximum_attempts is not None and attempts >= self.maximum_attempts


@dataclass
class Backoff:
    """The failure streak of a loop that retries for ever: :meth:`failed` counts a failure and returns how long
    to wait before the next try; :meth:`succeeded` starts the streak over."""

    policy: RetryPolicy
    failures: int = 0

    def failed(self) -> float:
        self.failures += 1
        return self.policy.delay(self.failures)

    def succeeded(self) -> None:
        self.failures = 0
