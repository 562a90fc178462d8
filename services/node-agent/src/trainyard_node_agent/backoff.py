"""Trying again what failed while Redis or the broker is away: the platform's one back-off policy,
:class:`~trainyard_runtime.retry.RetryPolicy` (a first delay, doubling up to a cap), one loop (:func:`retry`),
and the rules for giving up (pure over the failure count, the delay and the injected clock).

While the agent serves it retries for ever: a spool waits, an exit must still be reported. Once it is
closing, each caller bounds its patience in its own way: :class:`ClosingGrace` (some seconds after the
first failure seen while closing), :func:`closing_and_capped` (until the delay reached its cap),
:func:`past` (a fixed deadline).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from trainyard_runtime.retry import RetryPolicy

from trainyard_node_agent.clock import Clock

log = logging.getLogger(__name__)

# Relaying a spool, recording an exit: 0.2 s, doubling to 5 s.
INFRASTRUCTURE = RetryPolicy(initial_interval_s=0.2, maximum_interval_s=5.0)
# Flushing the outbox at shutdown: every half second until its deadline.
SHUTDOWN_FLUSH = RetryPolicy(initial_interval_s=0.5, maximum_interval_s=0.5)


class GiveUp(Protocol):
    def __call__(self, failures: int, delay: float) -> bool:
        """After failure number ``failures``, with ``delay`` the wait before the next try: stop now?"""
        ...


class ClosingGrace:
    """Never while the agent serves; once it is closing, ``grace_s`` after the first failure seen then."""

    def __init__(self, closing: Callable[[], bool], clock: Clock, grace_s: float) -> None:
        self.closing, self.clock, self.grace_s = closing, clock, grace_s
        self.deadline: float | None = None

    def __call__(self, failures: int, delay: float) -> bool:
        if not self.closing():
            return False
        if self.deadline is None:
            self.deadline = self.clock.monotonic() + self.grace_s
        return self.clock.monotonic() > self.deadline


def closing_and_capped(closing: Callable[[], bool], policy: RetryPolicy) -> GiveUp:
    """Never while the agent serves; once it is closing, as soon as the delay has reached the policy's cap."""
    return lambda failures, delay: closing() and delay >= policy.maximum_interval_s


def past(deadline: float, clock: Clock) -> GiveUp:
    """Once the monotonic ``deadline`` has passed."""
    return lambda failures, delay: clock.monotonic() >= deadline


async def retry(attempt: Callable[[], Awaitable[None]], *, policy: RetryPolicy, give_up: GiveUp, clock: Clock,
                what: str) -> bool:
    """Await ``attempt`` until it succeeds (True) or ``give_up`` says stop after a failure (False), waiting
    ``policy.delay(n)`` after the n-th failure. Any exception is a failure: what fails here is Redis or
    the broker, whatever the client library calls it."""
    failures = 0
    while True:
        try:
            await attempt()
            return True
        except Exception as exc:  # noqa: BLE001 - infrastructure trouble: wait and retry
            failures += 1
            delay = policy.delay(failures)
            if give_up(failures, delay):
                log.error("giving up %s after %d failure(s): %r", what, failures, exc)
                return False
            log.warning("%s failed: %r; retry in %.1fs", what, exc, delay)
            await clock.sleep(delay)
