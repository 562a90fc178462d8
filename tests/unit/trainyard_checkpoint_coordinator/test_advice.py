"""Interval advice: the MTBF estimate, the cost measurement and the Young/Daly interval, pure."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from trainyard_checkpoint_coordinator.advice import (
    PRIOR_DEVICE_MTBF_S,
    FailureStats,
    advise,
    checkpoint_stalls,
    counts_as_interruption,
    device_mtbf,
)
from trainyard_checkpoint_coordinator.assembly import ShardTiming
from trainyard_contract.records import CheckpointRecord
from trainyard_contract.spec import CheckpointPolicy
from trainyard_planner.checkpoint import daly_interval, young_interval

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def ready(step: int, attempt: int = 1, write: float | None = None, spread: float | None = None) -> CheckpointRecord:
    first = NOW if spread is not None else None
    last = NOW + timedelta(seconds=spread) if spread is not None else None
    return CheckpointRecord(job_id="j", tenant="t", attempt=attempt, epoch=1, global_step=step, world_size=2,
                            state="READY", ready_at=NOW, write_seconds=write, first_shard_at=first,
                            last_shard_at=last)


def test_mtbf_is_observed_device_seconds_per_failure_else_the_prior() -> None:
    assert device_mtbf(FailureStats(4, 4000.0)) == (1000.0, "observed")
    assert device_mtbf(FailureStats(0, 10.0)) == (PRIOR_DEVICE_MTBF_S, "prior")
    # no failure in more device-seconds than the prior: the exposure is the better bound
    assert device_mtbf(FailureStats(0, 1e9), prior_s=1e6) == (1e9, "prior")
    assert 1.5e8 < PRIOR_DEVICE_MTBF_S < 1.7e8  # Llama 3: 466 interruptions / 54 days / 16k GPUs


@pytest.mark.parametrize(("reason", "code", "counts"), [
    ("error", 1, True), ("killed", -9, True), ("lost", -9, True), ("hang", -9, True), ("nccl", 1, True),
    ("oom", 6, True), ("ok", 0, False), ("revoked", -15, False), ("preempted", -15, False),
    ("signal-11", -11, True), ("checkpoint", 4, True), ("a-reason-from-a-newer-agent", 1, True), ("", 1, True),
    ("config", 2, False), ("nan", 3, False), ("data", 5, False),
])
def test_which_exits_are_interruptions(reason: str, code: int, counts: bool) -> None:
    assert counts_as_interruption(reason, code) is counts


def test_stall_of_a_checkpoint_includes_the_async_completion_steps_until_the_next_one() -> None:
    records = [ready(10), ready(20), ready(10, attempt=2)]
    stalls = {(1, 10): 0.5, (1, 12): 0.25, (1, 20): 1.0, (1, 23): 0.5, (2, 10): 2.0, (2, 11): 0.0}
    assert checkpoint_stalls(records, stalls) == {
        "step-000000010-a1": 0.75, "step-000000020-a1": 1.5, "step-000000010-a2": 2.0}


def test_daly_interval_in_seconds_and_steps_from_the_measured_stall() -> None:
    stats = FailureStats(failures=2, exposure_device_seconds=2 * 3600.0)  # device MTBF 1 h
    a = advise(job_id="j", device_type="cpu", devices=4, policy=CheckpointPolicy(every_steps=100), max_steps=10_000,
               ready=[ready(100), ready(200)], stall_by_step={(1, 100): 2.0, (1, 200): 2.0}, step_seconds=0.5,
               stats=stats, now=NOW)
    m = 3600.0 / 4
    assert a.mtbf_source == "observed" and a.job_mtbf_seconds == pytest.approx(m)
    assert a.cost_source == "stall" and a.checkpoint_cost_seconds == 2.0
    assert a.young_interval_seconds == pytest.approx(young_interval(2.0, m)) == pytest.approx(math.sqrt(2 * 2 * m))
    assert a.daly_interval_seconds == pytest.approx(daly_interval(2.0, m))
    assert a.interval_steps == round(a.daly_interval_seconds / 0.5)
    assert a.current_interval_seconds == 50.0 and a.current_interval_steps == 100
    # the advised interval wastes less than the spec's (Young's first-order waste)
    assert a.advised_wasted_fraction < a.current_wasted_fraction
    assert '"intervalSteps"' in a.dumps() and '"jobMtbfSeconds"' in a.dumps()


def test_cost_falls_back_to_write_time_then_shard_spread_and_interval_is_never_shorter_than_a_write() -> None:
    common = dict(job_id="j", device_type="cpu", devices=1, policy=CheckpointPolicy(every_steps=5), max_steps=1000,
                  step_seconds=1.0, stats=FailureStats(10, 100.0), now=NOW)  # MTBF 10 s: a tiny interval
    by_write = advise(ready=[ready(5, write=30.0)], stall_by_step={}, **common)  # type: ignore[arg-type]  # the common keyword arguments
    assert by_write.cost_source == "write" and by_write.interval_seconds >= 30.0
    by_spread = advise(ready=[ready(5, spread=0.2)], stall_by_step={}, **common)  # type: ignore[arg-type]  # the common keyword arguments
    assert by_spread.cost_source == "shard-spread" and by_spread.checkpoint_cost_seconds == pytest.approx(0.2)
    nothing = advise(ready=[], stall_by_step={}, **common)  # type: ignore[arg-type]  # the common keyword arguments
    assert nothing.cost_source == "none" and nothing.interval_steps is None and "no checkpoint" in nothing.note


def test_interval_steps_are_capped_at_max_steps_and_need_a_step_time() -> None:
    common = dict(job_id="j", device_type="h100", devices=8, policy=CheckpointPolicy(auto=True), max_steps=50,
                  ready=[ready(10)], stall_by_step={(1, 10): 5.0}, stats=FailureStats(), now=NOW)
    capped = advise(step_seconds=0.1, **common)  # type: ignore[arg-type]  # the common keyword arguments
    assert capped.mtbf_source == "prior" and capped.interval_steps == 50 and capped.auto
    unknown = advise(step_seconds=None, **common)  # type: ignore[arg-type]  # a test double
    assert unknown.interval_steps is None and unknown.interval_seconds is not None


def test_shard_timing_takes_first_and_last_report_and_the_slowest_write() -> None:
    t = ShardTiming.of({0: (NOW, 1.0), 1: (NOW + timedelta(seconds=3), 2.5), 2: (NOW + timedelta(seconds=1), None)})
    assert (t.first_at, t.last_at, t.write_seconds) == (NOW, NOW + timedelta(seconds=3), 2.5)
    assert ShardTiming.of({}) == ShardTiming()
