"""The one retry loop of the node agent: the platform's retry policy, and when each caller gives up."""

from __future__ import annotations

import pytest

from trainyard_runtime.retry import RetryPolicy
from trainyard_node_agent.backoff import INFRASTRUCTURE, ClosingGrace, closing_and_capped, past, retry


class FakeClock:
    """Time moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def failing(times: int) -> tuple[list[int], object]:
    calls: list[int] = []

    async def attempt() -> None:
        calls.append(1)
        if len(calls) <= times:
            raise ConnectionError("broker away")

    return calls, attempt


async def test_it_retries_with_the_policy_until_it_succeeds() -> None:
    clock = FakeClock()
    calls, attempt = failing(7)
    assert await retry(attempt, policy=INFRASTRUCTURE, give_up=lambda n, d: False, clock=clock,  # type: ignore[arg-type]  # a test double
                       what="x")
    assert len(calls) == 8
    assert clock.slept == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]  # doubling from 0.2 s, capped at 5 s


async def test_it_reports_giving_up() -> None:
    clock = FakeClock()
    calls, attempt = failing(100)
    assert not await retry(attempt, policy=INFRASTRUCTURE, give_up=lambda n, d: n == 3, clock=clock,  # type: ignore[arg-type]  # a test double
                           what="x")
    assert len(calls) == 3 and clock.slept == [0.2, 0.4]


@pytest.mark.parametrize(("closing", "delay", "gives_up"), [
    (False, 5.0, False), (True, 3.2, False), (True, 5.0, True),
])
def test_closing_and_capped(closing: bool, delay: float, gives_up: bool) -> None:
    assert closing_and_capped(lambda: closing, INFRASTRUCTURE)(1, delay) is gives_up


def test_closing_grace_counts_from_the_first_failure_seen_while_closing() -> None:
    clock, closing = FakeClock(), [False]
    rule = ClosingGrace(lambda: closing[0], clock, 10.0)
    clock.now += 60
    assert not rule(1, 0.2)  # serving: for ever
    closing[0] = True
    assert not rule(2, 0.4)  # the grace starts now
    clock.now += 10.0
    assert not rule(3, 0.8)
    clock.now += 0.1
    assert rule(4, 1.6)


def test_past_a_deadline() -> None:
    clock = FakeClock()
    rule = past(clock.now + 5, clock)
    assert not rule(1, 0.5)
    clock.now += 5
    assert rule(2, 0.5)


async def test_flush_style_retry_stops_at_its_deadline() -> None:
    clock = FakeClock()
    calls, attempt = failing(100)
    policy = RetryPolicy(initial_interval_s=0.5, maximum_interval_s=0.5)
    assert not await retry(attempt, policy=policy, give_up=past(clock.now + 2.0, clock), clock=clock,  # type: ignore[arg-type]  # a test double
                           what="x")
    assert clock.slept == [0.5, 0.5, 0.5, 0.5] and len(calls) == 5
