"""The rendezvous port of a new attempt: random over the range, never one a live attempt holds (ports.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.unit.trainyard_scheduler.test_transitions import admitted, new_job
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.ports import SYSTEM_RANDOM, choose_port, live_ports


@pytest.mark.parametrize(("low", "high", "taken", "allowed"), [
    (29400, 29400, set(), {29400}),  # a range of one
    (29400, 29402, {29400, 29402}, {29401}),  # the only free one
    (29400, 29403, {29401}, {29400, 29402, 29403}),
    (29400, 29402, {1, 65000}, {29400, 29401, 29402}),  # taken ports outside the range change nothing
    (29400, 29401, {29400, 29401}, {29400, 29401}),  # every one taken: any (the agent's check decides)
])
def test_a_port_is_drawn_from_the_free_ones_of_the_range(low: int, high: int, taken: set[int],
                                                         allowed: set[int]) -> None:
    rng = random.Random(7)
    drawn = {choose_port(rng, low, high, taken) for _ in range(200)}
    assert drawn == allowed


def test_the_draw_is_uniform_over_the_free_ports_not_a_counter() -> None:
    rng = random.Random(1)
    counts = Counter(choose_port(rng, 29400, 29409, {29400, 29405}) for _ in range(8000))
    assert set(counts) == set(range(29400, 29410)) - {29400, 29405}
    assert all(800 < n < 1200 for n in counts.values()), counts  # 1000 each expected
    successive = [choose_port(rng, 29400, 29999) for _ in range(5)]
    assert successive != list(range(successive[0], successive[0] + 5)), "not the next ports of a counter"


def test_the_same_seed_draws_the_same_ports_and_the_shell_uses_the_os_randomness() -> None:
    first = [choose_port(random.Random(42), 29400, 29999, {29401}) for _ in range(3)]
    assert len(set(first)) == 1  # injected: reproducible
    assert isinstance(SYSTEM_RANDOM, random.SystemRandom)


def test_an_empty_range_is_refused() -> None:
    with pytest.raises(ValueError, match="empty port range"):
        choose_port(random.Random(0), 30000, 29999)


def test_live_ports_are_those_of_starting_or_running_attempts() -> None:
    queued = new_job()
    starting = admitted(new_job())  # master_port 29400
    assert starting.current is not None and tr.is_live(starting.current)
    running = admitted(new_job(), epoch=2).model_copy(deep=True)
    assert running.current is not None
    running.current.master_port, running.current.state = 29555, "running"
    ended = admitted(new_job(), epoch=3).model_copy(deep=True)
    assert ended.current is not None
    ended.current.master_port, ended.current.state = 29777, "failed"
    assert live_ports([queued, starting, running, ended]) == {29400, 29555}
