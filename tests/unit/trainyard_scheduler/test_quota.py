"""Quotas and fair sharing on their own (trainyard_scheduler.quota): what a tenant holds, what it may take, whether
it borrows, and its weighted dominant share — table-driven, no planner around them."""

from __future__ import annotations

import pytest

from trainyard_scheduler.gang import GangRequest
from trainyard_scheduler.quota import Quota
from trainyard_scheduler.topology import ClusterSnapshot

from .test_planner import config, node, running

TENANTS = config(tenants={"a": {"quotas": {"cpu": {"guaranteed": 4, "borrowLimit": 4}}, "cohort": "lab"},
                          "b": {"quotas": {"cpu": {"guaranteed": 4}}, "cohort": "lab", "weight": 2.0}},
                 cohorts={"lab": {"limits": {"cpu": 10}}})


def quota(*held: tuple[str, int]) -> Quota:
    """``held``: (tenant, devices) running on an 16-device cluster."""
    snapshot = ClusterSnapshot((node("n1", 8), node("n2", 8)))
    jobs = [running(f"{t}{i}", [f"n1:{j}" for j in range(n)], tenant=t) for i, (t, n) in enumerate(held)]
    return Quota(snapshot, TENANTS, jobs)


@pytest.mark.parametrize(("held", "tenant", "need", "problem"), [
    ((), "a", 8, None),  # 4 guaranteed + 4 borrowable
    ((), "a", 9, "tenant a holds 0 cpu devices and may hold 8 (4 guaranteed + 4 borrowable); this job needs 9 more"),
    ((("a", 6),), "a", 2, None),
    ((("a", 6),), "a", 3, "tenant a holds 6 cpu devices and may hold 8"),
    ((("a", 8),), "b", 2, None),  # the cohort holds 10 of its 10
    ((("a", 8),), "b", 3, "cohort lab holds 8 cpu devices of its limit 10; this job needs 3 more"),
])
def test_problem_names_the_cap_or_the_cohort_limit(held: tuple[tuple[str, int], ...], tenant: str, need: int,
                                                   problem: str | None) -> None:
    found = quota(*held).problem(tenant, GangRequest("cpu", need))
    assert found == problem if problem is None else problem in (found or "")


@pytest.mark.parametrize(("held", "borrowing", "within_a_2", "over_cap_a_4"), [
    ((), set(), True, -4),
    ((("a", 4),), set(), False, 0),
    ((("a", 5),), {"a"}, False, 1),
    ((("a", 5), ("b", 2)), {"a"}, False, 1),
])
def test_borrowing_guarantee_and_cap(held: tuple[tuple[str, int], ...], borrowing: set[str], within_a_2: bool,
                                     over_cap_a_4: int) -> None:
    q = quota(*held)
    assert {t for t in ("a", "b") if q.borrowing(t, "cpu")} == borrowing
    assert q.within_guarantee("a", GangRequest("cpu", 2)) is within_a_2
    assert q.over_cap_by("a", GangRequest("cpu", 4)) == over_cap_a_4
    assert q.borrowers("cpu", besides="b") is bool(borrowing - {"b"})
    assert q.borrowers("cpu", besides="a") is bool(borrowing - {"a"})


def test_the_dominant_share_is_weighted_and_follows_what_the_pass_admits() -> None:
    q = quota(("a", 4), ("b", 4))
    assert q.share("a") == pytest.approx(4 / 16)
    assert q.share("b") == pytest.approx(4 / 16 / 2.0)  # weight 2: half the share for the same devices
    q.use("b", "cpu", 4)
    assert q.share("b") == pytest.approx(8 / 16 / 2.0)
    assert q.used("b", "cpu") == 8 and q.cohort_usage[("lab", "cpu")] == 12
