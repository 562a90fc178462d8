"""EASY backfill: a reservation protects the head's start; only what the head will not need at its
reserved start, or devices given back before it, go to the jobs behind it."""

from __future__ import annotations

from datetime import timedelta

import pytest

from trainyard_contract.spec import TrainingSpec
from trainyard_scheduler.planner import PlanStats, expected_duration_s, plan

from .test_planner import T0, config, job, kinds, node, running, snapshot_with, summary


def blocked_head() -> tuple[list, object]:
    """Two nodes of 4; n1 busy until t=100; the head wants all 8 and holds n2 for itself."""
    return [node("n1"), node("n2")], running("r", ["n1:0", "n1:1", "n1:2", "n1:3"], ends=100)


@pytest.mark.parametrize(
    ("size", "duration", "expected"),
    [
        (2, 50.0, "backfill"),    # ends before the head's reserved start (t=100)
        (4, 100.0, "backfill"),   # ends exactly at it: still does not delay the head
        (2, 101.0, "priority"),   # would delay the head by a second
        (2, 5000.0, "priority"),  # would delay the head by hours
        (2, None, "priority"),    # no expected duration: never backfilled past a reservation
        (5, 10.0, "capacity"),    # does not fit even with the held devices: waits for capacity
    ],
)
def test_backfill_past_the_reservation_only_when_it_ends_before_the_reserved_start(
        size: int, duration: float | None, expected: str) -> None:
    nodes, busy = blocked_head()
    decisions = plan(snapshot_with(nodes, busy), [job("head", 8, at=0), job("late", size, at=1, duration=duration)],
                     T0, running=[busy])
    outcome = dict(summary(decisions)).get("late") if expected == "backfill" else kinds(decisions).get("late")
    assert outcome == expected
    assert kinds(decisions)["head"] == "capacity"


@pytest.mark.parametrize(
    ("head", "late", "expected"),
    [
        # the head needs 6: at t=100, n1's 4 come back, so only 2 of n2's free 4 must be held;
        # the other 2 are "extra" and go to a job of any length
        (6, 2, "admit"),
        (6, 3, "priority"),
        (8, 1, "priority"),   # the head needs all of n2: nothing extra
        (4, 4, "admit"),     # the head fits now: it starts and the late job takes... nothing left
    ],
)
def test_only_what_the_head_needs_at_its_start_is_held(head: int, late: int, expected: str) -> None:
    nodes, busy = blocked_head()
    stats = PlanStats()
    decisions = plan(snapshot_with(nodes, busy), [job("head", head, at=0), job("late", late, at=1, duration=None)],
                     T0, running=[busy], stats=stats)
    got = dict(summary(decisions))
    if head == 4:  # the head is admitted on n2; the late job then waits for capacity
        assert got["head"] == "admit" and kinds(decisions)["late"] == "capacity"
        return
    assert (got["late"] if expected == "admit" else kinds(decisions)["late"]) == expected
    (reservation,) = stats.reservations
    assert reservation.start == T0 + timedelta(seconds=100)
    assert len(reservation.devices) == max(0, head - 4)


def test_unknown_running_ends_hold_everything_and_allow_no_backfill() -> None:
    nodes = [node("n1"), node("n2")]
    busy = running("r", ["n1:0", "n1:1", "n1:2", "n1:3"], ends=None)
    stats = PlanStats()
    decisions = plan(snapshot_with(nodes, busy), [job("head", 6, at=0), job("late", 1, at=1, duration=1.0)],
                     T0, running=[busy], stats=stats)
    assert kinds(decisions)["late"] == "priority"
    (reservation,) = stats.reservations
    assert reservation.start is None and len(reservation.devices) == 4


@pytest.mark.parametrize(("depth", "held_for"), [(1, ["head"]), (2, ["head", "second"])])
def test_the_reservation_depth_protects_that_many_blocked_jobs(depth: int, held_for: list[str]) -> None:
    nodes, busy = blocked_head()
    stats = PlanStats()
    queue = [job("head", 8, at=0), job("second", 8, at=1), job("late", 2, at=2, duration=5000.0)]
    decisions = plan(snapshot_with(nodes, busy), queue, T0, running=[busy],
                     policy=config(tenants={}, reservations=depth), stats=stats)
    assert [r.job_id for r in stats.reservations] == held_for
    assert kinds(decisions)["late"] == "priority"


def test_expected_duration_comes_from_the_spec_and_keeps_old_hashes() -> None:
    base = {
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "abc",
        "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
        "checkpointPolicy": {"everySteps": 10},
        "training": {"sequenceLength": 64, "microBatchSize": 8, "globalBatchSize": 32, "learningRate": 0.003,
                     "maxSteps": 40},
    }
    plain = TrainingSpec.model_validate(base)
    timed = TrainingSpec.model_validate({**base, "resources": {**base["resources"], "expectedDurationMinutes": 90}})
    assert "expectedDurationMinutes" not in plain.wire()["resources"]
    assert plain.spec_hash() != timed.spec_hash()
    assert expected_duration_s(timed.resources.expected_duration_minutes) == 5400.0
    assert expected_duration_s(plain.resources.expected_duration_minutes) is None
    with pytest.raises(ValueError, match="expectedDurationMinutes|expected_duration_minutes"):
        TrainingSpec.model_validate({**base, "resources": {**base["resources"], "expectedDurationMinutes": 0}})
