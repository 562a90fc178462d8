"""Hang detection: which allocations are hung, and what the detail says."""

from __future__ import annotations

from trainyard_node_agent.watchdog import RankProgress, find_hangs


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
