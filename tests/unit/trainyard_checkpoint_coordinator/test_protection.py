"""assess_protection: when a running job counts as CheckpointsStalled (no READY checkpoint for N intervals)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainyard_checkpoint_coordinator.protection import Protection, assess_protection

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def assess(step: int, protected: int, *, every: int = 10, previous: Protection | None = None,
           attempt: int = 1, now: datetime = T0) -> Protection:
    return assess_protection(job_id="j", attempt=attempt, step=step, protected_step=protected, every_steps=every,
                             threshold=3, now=now, previous=previous)


@pytest.mark.parametrize(("step", "protected", "intervals", "stalled"), [
    (0, 0, 0, False),
    (19, 10, 0, False),  # a save in flight and the next one due: normal
    (29, 10, 1, False),
    (39, 10, 2, False),
    (40, 10, 3, True),  # three whole intervals past the newest READY checkpoint
    (99, 0, 9, True),  # an attempt that never got a READY checkpoint
])
def test_a_job_is_stalled_three_intervals_past_its_newest_ready_checkpoint(
        step: int, protected: int, intervals: int, stalled: bool) -> None:
    p = assess(step, protected)
    assert (p.unprotected_intervals, p.stalled) == (intervals, stalled)
    assert ("no READY checkpoint for" in p.reason) is stalled


def test_the_condition_keeps_when_it_began_until_it_clears_or_the_attempt_changes() -> None:
    first = assess(40, 0)
    assert first.since == T0 and "none of its checkpoints is READY" in first.reason
    later = assess(55, 0, previous=first, now=T0 + timedelta(seconds=5))
    assert later.since == T0
    cleared = assess(56, 50, previous=later, now=T0 + timedelta(seconds=6))
    assert not cleared.stalled and cleared.since is None
    next_attempt = assess(80, 40, attempt=2, previous=later, now=T0 + timedelta(seconds=9))
    assert next_attempt.stalled and next_attempt.since == T0 + timedelta(seconds=9)


def test_a_time_based_policy_is_never_flagged_by_steps() -> None:
    assert not assess(500, 0, every=0).stalled


def test_the_condition_round_trips_as_camel_case_json() -> None:
    p = assess(40, 0)
    assert '"unprotectedIntervals":4' in p.dumps() and '"protectedStep":0' in p.dumps()
    assert Protection.loads(p.dumps()) == p
