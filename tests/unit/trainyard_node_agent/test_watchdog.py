"""Hang detection: which allocations are hung, what the detail says, and what counts as progress (events;
for user code, output too)."""

from __future__ import annotations

import pytest
from trainyard_node_agent.watchdog import (
    Hung,
    Liveness,
    RankProgress,
    find_hangs,
    observe,
)


def rank(alloc: str, r: int, since: float, progressed: bool = True, state: str | None = "S") -> RankProgress:
    return RankProgress(alloc, r, 1000 + r, since, progressed, state)


def test_one_late_rank_hangs_its_whole_allocation_and_only_that_one() -> None:
    hung = find_hangs([rank("a", 0, 1.0), rank("a", 1, 40.0, state="T"), rank("b", 2, 5.0)],
                      timeout_s=30, first_step_timeout_s=600)
    assert [h.allocation_id for h in hung] == ["a"]
    assert "rank 1 (pid 1001)" in hung[0].detail and "rank 0" not in hung[0].detail.split(":")[1]
    assert "stopped (SIGSTOP or a debugger): rank 1" in hung[0].detail


def test_before_the_first_event_the_longer_limit_applies() -> None:
    starting = [rank("a", 0, 100.0, progressed=False), rank("a", 1, 100.0, progressed=False)]
    assert find_hangs(starting, timeout_s=30, first_step_timeout_s=600) == []
    late = find_hangs([rank("a", 0, 700.0, progressed=False)], timeout_s=30, first_step_timeout_s=600)
    assert len(late) == 1 and "no first step for 700s (limit 600s)" in late[0].detail


def test_nothing_is_hung_at_the_limit() -> None:
    assert find_hangs([rank("a", 0, 30.0)], timeout_s=30, first_step_timeout_s=600) == []
    assert find_hangs([], timeout_s=30, first_step_timeout_s=600) == []


def test_a_rank_saving_on_request_is_not_hung_until_the_deadline() -> None:
    saving = RankProgress("a", 0, 1000, 500.0, True, "S", saving_on_request=True)
    assert find_hangs([saving, rank("a", 1, 1.0)], timeout_s=30, first_step_timeout_s=600) == []
    past_deadline = RankProgress("a", 0, 1000, 500.0, True, "S", saving_on_request=False)
    assert [h.allocation_id for h in find_hangs([past_deadline], timeout_s=30, first_step_timeout_s=600)] == ["a"]


# ----------------------------------------------------------------------------- observing progress

BEFORE = Liveness(at=10.0, spool_bytes=100, log_bytes=50)


@pytest.mark.parametrize(("last", "spool", "log", "expected"), [
    # the built-in trainer (log None): only events count, whatever it prints
    (BEFORE, 100, None, BEFORE),
    (BEFORE, 180, None, Liveness(20.0, 180, 50, reported=True)),
    # user code: output counts as progress, but is not an event (the first-step limit stays)
    (BEFORE, 100, 50, BEFORE),
    (BEFORE, 100, 90, Liveness(20.0, 100, 90, printed=True)),
    (BEFORE, 180, 90, Liveness(20.0, 180, 90, reported=True, printed=True)),
    (BEFORE, 180, 50, Liveness(20.0, 180, 50, reported=True)),
    # a log that shrank (replaced) is a new baseline, not progress; growth after it is
    (BEFORE, 100, 10, Liveness(10.0, 100, 10)),
    (Liveness(10.0, 100, 10), 100, 20, Liveness(20.0, 100, 20, printed=True)),
    # what was seen once stays seen; silence keeps the old clock
    (Liveness(5.0, 100, 50, reported=True, printed=True), 100, 50, Liveness(5.0, 100, 50, True, True)),
], ids=["trainer-silent", "trainer-event", "code-silent", "code-prints", "code-both", "code-event",
        "log-shrank", "after-shrink", "silent-after-progress"])
def test_observe(last: Liveness, spool: int, log: int | None, expected: Liveness) -> None:
    assert observe(last, spool_bytes=spool, log_bytes=log, now=20.0) == expected


def test_a_printing_script_lives_and_a_silent_one_hangs_under_the_first_step_limit() -> None:
    """Through observe and find_hangs together: a plain script (no events) printing every 10 s outlives
    the limit many times over; one that printed once and went quiet is hung past the limit."""
    printing = silent = Liveness(at=0.0)
    for t in range(10, 200, 10):
        printing = observe(printing, spool_bytes=0, log_bytes=t, now=float(t))  # a line every 10 s
        silent = observe(silent, spool_bytes=0, log_bytes=min(t, 10), now=float(t))  # one line at 10 s
    assert not printing.reported and not silent.reported  # output is not an event: still the first-step limit

    def judge(live: Liveness) -> list[Hung]:
        return find_hangs([RankProgress("a", 0, 1000, 190.0 - live.at, live.reported, "S", output_counts=True)],
                          timeout_s=5, first_step_timeout_s=30)

    assert judge(printing) == []
    [hung] = judge(silent)
    assert hung.detail.startswith("no first step and no output for 180s (limit 30s)")


def test_restarting_the_window_keeps_what_was_seen() -> None:
    live = Liveness(1.0, 10, 20, reported=True, printed=True)
    assert live.restarted(9.0) == Liveness(9.0, 10, 20, reported=True, printed=True)


def test_the_detail_says_no_output_only_when_output_counted() -> None:
    [trainer] = find_hangs([rank("a", 0, 40.0)], timeout_s=30, first_step_timeout_s=600)
    assert trainer.detail.startswith("no step progress for 40s")
    code = RankProgress("a", 0, 1000, 40.0, True, "S", output_counts=True)
    [user] = find_hangs([code], timeout_s=30, first_step_timeout_s=600)
    assert user.detail.startswith("no step progress and no output for 40s (limit 30s)")
