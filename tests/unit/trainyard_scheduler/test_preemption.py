"""Preemption on its own (trainyard_scheduler.preemption): whose jobs may be victims, which set is cheapest, what
the preemptor waits for, and the counting shortcut (fits_after_freeing) agreeing with placing."""

from __future__ import annotations

import pytest

from trainyard_scheduler.backfill import Reservations
from trainyard_scheduler.decisions import Preempt, RunningJob, Wait
from trainyard_scheduler.gang import GangRequest, Placement
from trainyard_scheduler.placement import place
from trainyard_scheduler.policy import QueueConfig
from trainyard_scheduler.preemption import Preemption, fits_after_freeing
from trainyard_scheduler.quota import Quota
from trainyard_scheduler.topology import ClusterSnapshot

from .test_planner import T0, config, job, node, running, snapshot_with


def preemption(snapshot: ClusterSnapshot, busy: list[RunningJob], policy: QueueConfig | None = None) -> Preemption:
    policy = policy or config()
    live = {r.job_id: r for r in busy}
    quota = Quota(snapshot, policy, busy)
    return Preemption(snapshot, policy, T0, live, quota, Reservations(snapshot, policy, T0, live, place, None),
                      place, None)


def full_cluster() -> tuple[ClusterSnapshot, list[RunningJob]]:
    busy = [running("low", ["n1:0", "n1:1"], priority=-5, started=-600),
            running("lower-old", ["n1:2", "n1:3"], priority=-10, started=-7200),
            running("lower-new", ["n2:0", "n2:1"], priority=-10, started=-600),
            running("high", ["n2:2", "n2:3"], priority=10)]
    return snapshot_with([node("n1"), node("n2")], *busy), busy


def test_the_cheapest_victims_go_first_lowest_priority_then_newest() -> None:
    snap, busy = full_cluster()
    decisions = preemption(snap, busy).maybe_preempt(job("urgent", 2, priority=5), None)
    assert isinstance(decisions[0], Preempt) and decisions[0].victims == ("lower-new",)
    assert "lower priority" in decisions[0].reason
    assert isinstance(decisions[1], Wait) and decisions[1].kind == "preemption"


def test_nobody_is_preempted_by_a_job_without_the_rights() -> None:
    snap, busy = full_cluster()
    p = preemption(snap, busy)
    assert p.maybe_preempt(job("equal", 2, priority=-10), None) == []  # not above any victim's priority
    assert p.maybe_preempt(job("other", 2, priority=50, tenant="t2"), None) == []  # another tenant, no borrowing
    off = preemption(snap, busy, config(preemption={"enabled": False}))
    assert off.maybe_preempt(job("urgent", 2, priority=5), None) == []


def test_a_victim_is_taken_once_and_a_preemption_in_progress_holds_its_devices() -> None:
    snap, busy = full_cluster()
    p = preemption(snap, busy)
    first = p.maybe_preempt(job("u1", 2, priority=5), None)
    second = p.maybe_preempt(job("u2", 2, priority=5), None)
    victims = {d.victims for d in first + second if isinstance(d, Preempt)}
    assert victims == {("lower-new",), ("lower-old",)}
    again = preemption(snap, busy).in_progress(job("u1", 2, priority=5, preempting=("lower-new",)))
    assert again is not None and "waiting for lower-new to checkpoint and stop" in (again.reason or "")
    assert preemption(snap, busy).in_progress(job("u3", 2, preempting=("gone",))) is None


def test_borrowed_capacity_is_reclaimed_for_a_tenant_within_its_guarantee() -> None:
    policy = config(tenants={"a": {"quotas": {"cpu": {"guaranteed": 4}}}, "b": {"quotas": {"cpu": {"guaranteed": 4}}}})
    busy = [running("a1", ["n1:0", "n1:1", "n1:2", "n1:3"], tenant="a"),
            running("a2", ["n2:0", "n2:1", "n2:2", "n2:3"], tenant="a", started=-60 * 60)]
    snap = snapshot_with([node("n1"), node("n2")], *busy)
    decisions = preemption(snap, busy, policy).maybe_preempt(job("b1", 4, tenant="b", priority=-5), None)
    assert isinstance(decisions[0], Preempt) and len(decisions[0].victims) == 1
    assert "borrowed capacity reclaimed" in decisions[0].reason


@pytest.mark.parametrize(("freed", "need", "mode"), [
    (["n1:0", "n1:1"], 2, "pack"), (["n1:0"], 2, "pack"), (["n1:0", "n2:0"], 2, "domain"),
    (["n1:0", "n1:1", "n2:0", "n2:1"], 4, "rack"), (["n1:0", "n1:1", "n1:2", "n1:3"], 4, "domain"),
])
def test_counting_on_the_index_agrees_with_placing(freed: list[str], need: int, mode: str) -> None:
    busy = [running("all1", [f"n1:{i}" for i in range(4)]), running("all2", [f"n2:{i}" for i in range(4)])]
    snap = snapshot_with([node("n1", rack="r"), node("n2", rack="r")], *busy)
    request = GangRequest("cpu", need, mode=mode)
    devices = [d for r in busy for d in r.devices if f"{d.node_id}:{d.index}" in freed]
    counted = fits_after_freeing(snap, snap.aggregates_for(request), request, devices)
    snap.give_devices("cpu", devices)
    assert counted == isinstance(place(snap, request), Placement)
