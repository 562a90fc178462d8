"""The one retry policy: delays, budget, jitter, the loop's failure streak, and each site's numbers."""

from __future__ import annotations

import pytest

from trainyard_runtime import bus, idlefetch, outbox, replication
from trainyard_runtime.retry import Backoff, RetryPolicy


def test_the_retry_policy_doubles_from_its_first_delay_up_to_its_cap() -> None:
    policy = RetryPolicy(initial_interval_s=0.5, maximum_interval_s=3.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5, 100)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_the_coefficient_scales_each_wait_and_a_huge_power_is_the_cap() -> None:
    policy = RetryPolicy(initial_interval_s=1.0, backoff_coefficient=3.0, maximum_interval_s=50.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5000)] == [1.0, 3.0, 9.0, 27.0, 50.0]
    assert RetryPolicy(initial_interval_s=1.0, backoff_coefficient=1.0).delay(40) == 1.0


@pytest.mark.parametrize(("maximum", "attempts", "exhausted"), [
    (None, 10_000, False), (1, 1, True), (3, 2, False), (3, 3, True), (3, 4, True),
])
def test_maximum_attempts_is_the_budget_of_tries_in_all(maximum: int | None, attempts: int, exhausted: bool) -> None:
    assert RetryPolicy(maximum_attempts=maximum).exhausted(attempts) is exhausted


@pytest.mark.parametrize(("draw", "expected"), [(0.0, 1.5), (0.5, 2.0), (0.999999, 2.5)])
def test_jitter_spreads_the_wait_by_its_fraction_either_way(draw: float, expected: float) -> None:
    policy = RetryPolicy(initial_interval_s=2.0, maximum_interval_s=2.0, jitter=0.25)
    assert policy.delay(1, draw=lambda: draw) == pytest.approx(expected, abs=1e-5)


def test_without_jitter_nothing_is_drawn() -> None:
    def draw() -> float:
        raise AssertionError("drawn")

    assert RetryPolicy(initial_interval_s=0.2).delay(2, draw=draw) == 0.4


@pytest.mark.parametrize("bad", [
    {"initial_interval_s": -1.0}, {"maximum_interval_s": -1.0}, {"backoff_coefficient": 0.5},
    {"maximum_attempts": 0}, {"jitter": 1.5},
])
def test_a_policy_that_makes_no_sense_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


def test_a_loops_streak_grows_with_failures_and_a_success_starts_it_over() -> None:
    backoff = Backoff(RetryPolicy(initial_interval_s=0.2, maximum_interval_s=1.0))
    assert [backoff.failed() for _ in range(4)] == [0.2, 0.4, 0.8, 1.0]
    assert backoff.failures == 4
    backoff.succeeded()
    assert backoff.failed() == 0.2


def test_each_site_keeps_the_numbers_it_had_before_the_policy_was_one_type() -> None:
    def first(policy: RetryPolicy, n: int = 6) -> list[float]:
        return [policy.delay(i) for i in range(1, n + 1)]

    assert first(bus.REDELIVERY_RETRY) == [0.4, 0.8, 1.6, 3.2, 6.4, 10.0]
    assert bus.STUCK_AFTER == 5
    assert first(outbox.RELAY_RETRY) == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4]
    assert first(idlefetch.LISTENER_RETRY) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    # redis-py's ExponentialBackoff(cap, base) waited min(cap, base * 2**failures), failures counted from 1
    assert first(replication.STANDALONE_RETRY, 3) == [min(0.5, 0.05 * 2 ** f) for f in (1, 2, 3)]
    assert first(replication.SENTINEL_RETRY, 12) == [min(1.0, 0.1 * 2 ** f) for f in range(1, 13)]


@pytest.mark.parametrize(("policy", "retries"), [(replication.STANDALONE_RETRY, 3), (replication.SENTINEL_RETRY, 12)])
def test_redis_py_retries_as_the_policy_says(policy: RetryPolicy, retries: int) -> None:
    retry = replication.redis_retry(policy)
    assert retry._retries == retries
    assert [retry._backoff.compute(f) for f in range(1, retries + 1)] == [policy.delay(f)
                                                                           for f in range(1, retries + 1)]
