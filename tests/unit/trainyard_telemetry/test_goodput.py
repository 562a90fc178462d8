"""The goodput ledger on synthetic histories; the parts always add up to what was allocated."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_contract.records import AttemptRecord, CheckpointRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_telemetry.goodput import KINDS, Ledger, StepTiming, attempt_ledger, job_ledger, total
from trainyard_api.schemas import EXAMPLE_SPEC as SPEC

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def attempt(n: int, start: float, end: float | None, state: str, world: int = 2, reason: str | None = None
            ) -> AttemptRecord:
    return AttemptRecord(attempt=n, allocation_id=f"a{n}", epoch=n, world_size=world, state=state,  # type: ignore[arg-type]  # a str for a Literal field
                         started_at=at(start), ended_at=at(end) if end is not None else None, failure_reason=reason)


def timing(n: int, *, first_at: float, steps: range, step_s: float = 1.0, stall: float = 0.0,
           keep: int = 10_000) -> StepTiming:
    """Steps of ``step_s`` work each, back to back; the first one ends at ``first_at``."""
    points = [(s, (i + 1) * step_s) for i, s in enumerate(steps)][-keep:]
    return StepTiming(attempt=n, steps=len(steps), first_step=steps[0], first_step_at=at(first_at),
                      first_step_seconds=step_s, last_step=steps[-1],
                      last_step_at=at(first_at + (len(steps) - 1) * step_s + stall), work_seconds=len(steps) * step_s,
                      checkpoint_seconds=stall, points=points)


def seconds(ledger: Ledger) -> dict[str, float]:
    return ledger.seconds()


def test_failure_mid_interval_loses_the_steps_after_the_last_ready_checkpoint() -> None:
    # 10 s launch, steps 1..30 of 1 s each (done at 40 s), READY at step 20; crash at 45 s; 2 ranks.
    a = attempt(1, 0, 45, "failed", reason="error: rank 1 exited 1")
    ledger = attempt_ledger(a, timing(1, first_at=11, steps=range(1, 31)), [20], now=at(1000))
    s = seconds(ledger)
    assert s["allocated"] == 90.0
    assert s["launchRestore"] == 20.0 and s["productive"] == 40.0 and s["lostWork"] == 20.0
    assert s["hang"] == 0.0 and s["inFlight"] == 0.0 and s["idle"] == pytest.approx(10.0)
    assert sum(ledger.parts.values()) == ledger.allocated


def test_a_hang_wastes_last_step_to_end_and_a_refused_checkpoint_saves_nothing() -> None:
    a = attempt(1, 0, 100, "failed", reason="hang: no step for 60s")
    ledger = attempt_ledger(a, timing(1, first_at=5, steps=range(1, 11)), [], now=at(1000))
    s = seconds(ledger)
    assert s["productive"] == 0.0 and s["lostWork"] == 20.0 and s["launchRestore"] == 8.0
    assert s["hang"] == 2 * (100 - 14)
    assert s["idle"] == 0.0 and sum(ledger.parts.values()) == ledger.allocated


def test_preempted_after_a_checkpoint_on_request_loses_nothing_and_stall_is_its_own_part() -> None:
    a = attempt(1, 0, 50, "revoked", world=4, reason="preempted by job-x: checkpointed")
    ledger = attempt_ledger(a, timing(1, first_at=2, steps=range(1, 41), stall=3.0), [20, 40], now=at(1000))
    s = seconds(ledger)
    assert s["lostWork"] == 0.0 and s["productive"] == 160.0 and s["checkpointStall"] == 12.0
    assert s["launchRestore"] == 4.0 and s["allocated"] == 200.0 and s["idle"] == pytest.approx(24.0)


def test_the_succeeded_attempt_keeps_every_step_and_a_running_one_has_work_in_flight() -> None:
    spec = TrainingSpec.model_validate(SPEC)
    job = JobRecord(job_id="j", tenant="t", spec=spec, spec_hash="h", state="running", attempts=[
        attempt(1, 0, 30, "failed", reason="oom: rank 0"), attempt(2, 40, None, "running")])
    checkpoints = [
        CheckpointRecord(job_id="j", tenant="t", attempt=1, epoch=1, global_step=10, world_size=2, state="DELETED",
                         content_hash="h10"),
        CheckpointRecord(job_id="j", tenant="t", attempt=1, epoch=1, global_step=20, world_size=2, state="FAILED",
                         reason="refused at restore by attempt 2: rank 0: missing"),
        CheckpointRecord(job_id="j", tenant="t", attempt=2, epoch=2, global_step=20, world_size=2, state="READY"),
    ]
    timings = {1: timing(1, first_at=2, steps=range(1, 26)), 2: timing(2, first_at=45, steps=range(11, 31))}
    s = job_ledger(job, checkpoints, timings, now=at(70)).seconds()
    # attempt 1: 10 steps saved (the DELETED one was READY; the refused one does not count), 15 lost
    # attempt 2: steps 11..20 saved by its READY at 20, 21..30 in flight
    assert s["productive"] == 2 * 10 + 2 * 10 and s["lostWork"] == 2 * 15 and s["inFlight"] == 2 * 10
    assert s["launchRestore"] == 2 * 1 + 2 * 4 and s["allocated"] == 2 * 30 + 2 * 30

    done = attempt(3, 0, 40, "succeeded")
    assert attempt_ledger(done, timing(3, first_at=5, steps=range(1, 31)), [], now=at(99)).seconds()["productive"] \
        == 60.0


def test_steps_older_than_the_kept_points_are_interpolated_at_the_mean() -> None:
    t = timing(1, first_at=1, steps=range(1, 1001), keep=100)
    assert t.work_through(500) == pytest.approx(500.0)
    assert t.work_through(950) == pytest.approx(950.0)
    assert t.work_through(0) == 0.0 and t.work_through(5000) == 1000.0


def test_an_attempt_without_steps_is_launch_or_hang_and_totals_add() -> None:
    launch = attempt_ledger(attempt(1, 0, 10, "failed", reason="error: x"), None, [], now=at(99))
    hang = attempt_ledger(attempt(2, 0, 10, "failed", reason="hang: no first step"), None, [], now=at(99))
    assert launch.seconds()["launchRestore"] == 20.0 and hang.seconds()["hang"] == 20.0
    both = total([launch, hang])
    assert both.allocated == 40 * 1_000_000 and both.wasted == both.allocated and both.goodput == 0.0


@st.composite
def histories(draw: st.DrawFn) -> tuple[AttemptRecord, StepTiming | None, list[int], datetime]:
    start = draw(st.floats(0, 1e5))
    ended = draw(st.none() | st.floats(0, 1e6))
    state = draw(st.sampled_from(["running", "succeeded", "failed", "revoked"]))
    reason = draw(st.sampled_from([None, "hang: stuck", "error: x", "preempted by y: z"]))
    a = attempt(1, start, start + ended if ended is not None else None, state,
                world=draw(st.integers(0, 4096)), reason=reason)
    steps = draw(st.integers(0, 300))
    t = None
    if steps:
        first = draw(st.integers(0, 10_000))
        t = timing(1, first_at=start + draw(st.floats(-100, 1e5)), steps=range(first, first + steps),
                   step_s=draw(st.floats(0, 1e3)), stall=draw(st.floats(0, 1e4)), keep=draw(st.integers(1, 400)))
    saved = draw(st.lists(st.integers(0, 11_000), max_size=5))
    now = at(start + draw(st.floats(-10, 2e6)))
    return a, t, saved, now


@settings(max_examples=300, deadline=None)
@given(histories())
def test_the_parts_always_add_up_to_allocated_exactly(history: tuple) -> None:
    a, t, saved, now = history
    ledger = attempt_ledger(a, t, saved, now=now)
    assert set(ledger.parts) == set(KINDS)
    assert all(v >= 0 for v in ledger.parts.values())
    assert sum(ledger.parts.values()) == ledger.allocated
    assert ledger.allocated % max(a.world_size, 1) == 0


def test_a_replaced_replica_counts_its_time_down_as_waste_not_as_productive() -> None:
    """faultTolerance: replica 1 failed at 20 s and its newcomer started at 26 s while replica 0 trained on; the
    attempt succeeded. The 6 device-seconds of replica 1 are replicaDown, taken from productive."""
    from trainyard_contract.records import ReplicaReplacement

    a = attempt(1, 0, 50, "succeeded")
    plain = seconds(attempt_ledger(a, timing(1, first_at=11, steps=range(1, 41)), [], now=at(1000)))
    a.replacements = [ReplicaReplacement(rank=1, node_id="n1", generation=1, reason="killed", at=at(20),
                                         started_at=at(26))]
    s = seconds(attempt_ledger(a, timing(1, first_at=11, steps=range(1, 41)), [], now=at(1000)))
    assert s["replicaDown"] == pytest.approx(6.0) and s["productive"] == pytest.approx(plain["productive"] - 6.0)
    assert sum(s[k] for k in KINDS) == pytest.approx(s["allocated"])
    # a newcomer that never started: down from its failure to the attempt's end
    a.replacements = [a.replacements[0].model_copy(update={"started_at": None})]
    assert seconds(attempt_ledger(a, timing(1, first_at=11, steps=range(1, 41)), [], now=at(1000)))[
        "replicaDown"] == pytest.approx(30.0)
