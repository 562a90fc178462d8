"""Reservations and EASY backfill on their own (trainyard_scheduler.backfill): what a reservation holds back, when a
job may use held devices, and that the pass's end gives them all back — without the planner around them."""

from __future__ import annotations

from datetime import timedelta

from trainyard_scheduler.backfill import Reservations, most_free
from trainyard_scheduler.decisions import PlanStats, Wait
from trainyard_scheduler.gang import GangRequest, Placement, Unschedulable
from trainyard_scheduler.placement import place
from trainyard_scheduler.topology import RACK, ClusterSnapshot

from .test_planner import T0, config, job, node, running


def reservations(snapshot: ClusterSnapshot, *busy: object, stats: PlanStats | None = None) -> Reservations:
    live = {r.job_id: r for r in busy}  # type: ignore[attr-defined]  # the test's records
    return Reservations(snapshot, config(), T0, live, place, stats)


def test_the_head_reserves_the_free_devices_it_will_need_and_the_end_gives_them_back() -> None:
    snap = ClusterSnapshot((node("n1", 4), node("n2", 4, leased=(0, 1, 2, 3))))
    busy = running("r", ["n2:0", "n2:1", "n2:2", "n2:3"], ends=600)
    stats = PlanStats()
    r = reservations(snap, busy, stats=stats)
    head = job("head", 6)
    waiting = r.wait_for_capacity(head, Unschedulable("waiting for 6 free cpu devices (4 free)"))
    assert waiting.kind == "capacity" and "next in line for cpu" in (waiting.reason or "")
    assert "expected start" in (waiting.reason or "")
    # EASY's extra devices: the 4 freed at 600 s cover 4 of its 6, so only 2 of the free 4 are held
    assert r.held["cpu"] == 2 and snap.free_devices("cpu") == 2
    assert r.until["cpu"] == T0 + timedelta(seconds=600) and stats.reservations[0].job_id == "head"
    r.undo()
    assert snap.free_devices("cpu") == 4


def test_a_job_ending_before_the_reserved_start_backfills_and_one_that_does_not_waits() -> None:
    snap = ClusterSnapshot((node("n1", 4), node("n2", 4, leased=(0, 1, 2, 3))))
    r = reservations(snap, running("r", ["n2:0", "n2:1", "n2:2", "n2:3"], ends=600))
    r.wait_for_capacity(job("head", 8), Unschedulable("waiting for 8 free cpu devices (4 free)"))
    short = r.backfill(job("short", 2, duration=300))
    assert isinstance(short, Placement) and short.world_size == 2
    assert r.held["cpu"] == 2  # the backfilled job took two of the held devices
    long = r.backfill(job("long", 2, duration=3600))
    assert isinstance(long, Wait) and long.kind == "priority" and "held for head" in (long.reason or "")
    unknown = r.backfill(job("unknown", 2))  # no expected duration: never past a reservation
    assert isinstance(unknown, Wait) and unknown.kind == "priority"


def test_backfill_is_not_the_question_when_no_reservation_blocks() -> None:
    snap = ClusterSnapshot((node("n1", 4, leased=(0, 1)),))
    r = reservations(snap)
    assert r.backfill(job("big", 4, duration=60)) is None  # nothing held: capacity, not a reservation, blocks it
    r.wait_for_capacity(job("head", 4), Unschedulable("waiting for 4 free cpu devices (2 free)"))
    assert r.backfill(job("huge", 8, duration=60)) is None  # held + free would not hold it either


def test_reservations_per_type_are_capped_by_the_policy() -> None:
    snap = ClusterSnapshot((node("n1", 4, leased=(0, 1)),))
    r = reservations(snap)
    first = r.wait_for_capacity(job("a", 4), Unschedulable("waiting"))
    second = r.wait_for_capacity(job("b", 4), Unschedulable("waiting"))
    assert "next in line" in (first.reason or "") and second.reason == "capacity: waiting"
    assert r.count["cpu"] == 1


def test_most_free_picks_the_roomiest_rack() -> None:
    snap = ClusterSnapshot((node("a1", 4, rack="a", leased=(0, 1, 2)), node("b1", 4, rack="b", leased=(0,)),
                            node("c1", 4, rack="c", leased=(0, 1))))
    agg = snap.aggregates_for(GangRequest("cpu", 2))
    assert snap.rack_names[most_free(snap, agg, RACK)] == "b"
