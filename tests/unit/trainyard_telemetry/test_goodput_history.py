"""Goodput over time: buckets, retention, and intervals from cumulative samples."""

from __future__ import annotations

import json

import pytest

from trainyard_telemetry.goodput import WASTE_KINDS
from trainyard_telemetry.goodput_history import (
    GoodputInterval,
    bucket_start,
    expired_buckets,
    intervals,
    parse_samples,
    sample_entry,
)


def cumulative(allocated: float, productive: float, in_flight: float = 0.0, **waste: float) -> dict[str, float]:
    kinds = dict.fromkeys(WASTE_KINDS, 0.0) | waste
    return {"allocated": allocated, "productive": productive, "inFlight": in_flight,
            "wasted": sum(kinds.values()), **kinds}


@pytest.mark.parametrize(("now", "bucket", "expected"), [
    (0, 300, 0), (299.9, 300, 0), (300, 300, 300), (1_767_225_601.5, 300, 1_767_225_600), (59, 60, 0),
])
def test_bucket_start(now: float, bucket: int, expected: int) -> None:
    assert bucket_start(now, bucket) == expected


@pytest.mark.parametrize(("buckets", "now", "retention", "expired"), [
    ([], 1000, 100, []),
    ([0, 300, 600, 900], 1000, 500, [0, 300]),
    ([900, 0, 300], 1000, 700, [0]),  # 300 is exactly 700 s old: kept
    ([600, 900], 1000, 10_000, []),
])
def test_expired_buckets(buckets: list[int], now: float, retention: float, expired: list[int]) -> None:
    assert expired_buckets(buckets, now_s=now, retention_s=retention) == expired


S0, S1, S2 = cumulative(0, 0), cumulative(600, 0, launchRestore=600), cumulative(1800, 800, 200, launchRestore=800)


@pytest.mark.parametrize(("case", "samples", "window", "expected"), [
    ("no samples", [], {}, []),
    ("one sample is no interval", [(300, S1)], {}, []),
    ("differences of consecutive samples", [(0, S0), (300, S1), (900, S2)], {}, [
        GoodputInterval(0, 300, 600, 0, 0, 600, dict.fromkeys(WASTE_KINDS, 0.0) | {"launchRestore": 600}, 600, 0),
        GoodputInterval(300, 900, 1200, 800, 200, 200, dict.fromkeys(WASTE_KINDS, 0.0) | {"launchRestore": 200},
                        1800, 800),
    ]),
    ("unsorted samples are sorted first", [(900, S2), (300, S1)], {}, [
        GoodputInterval(300, 900, 1200, 800, 200, 200, dict.fromkeys(WASTE_KINDS, 0.0) | {"launchRestore": 200},
                        1800, 800),
    ]),
    ("since keeps the intervals ending after it", [(0, S0), (300, S1), (900, S2)], {"since": 300}, [
        GoodputInterval(300, 900, 1200, 800, 200, 200, dict.fromkeys(WASTE_KINDS, 0.0) | {"launchRestore": 200},
                        1800, 800),
    ]),
    ("until keeps the intervals starting before it", [(0, S0), (300, S1), (900, S2)], {"until": 300}, [
        GoodputInterval(0, 300, 600, 0, 0, 600, dict.fromkeys(WASTE_KINDS, 0.0) | {"launchRestore": 600}, 600, 0),
    ]),
    ("a kind missing from a sample counts as 0", [(0, {"allocated": 10.0}), (300, {"allocated": 20.0})], {}, [
        GoodputInterval(0, 300, 10, 0, 0, 0, dict.fromkeys(WASTE_KINDS, 0.0), 20, 0),
    ]),
])
def test_intervals(case: str, samples: list, window: dict, expected: list[GoodputInterval]) -> None:
    assert intervals(samples, **window) == expected


@pytest.mark.parametrize(("interval", "goodput"), [
    (GoodputInterval(0, 300, 600, 0, 0, 600), 0.0),
    (GoodputInterval(300, 900, 1200, 800, 200, 200), pytest.approx(2 / 3)),
    (GoodputInterval(0, 300, 0, 0, 0, 0), None),  # nothing allocated: no goodput, not 0
])
def test_interval_goodput_is_productive_over_allocated(interval: GoodputInterval, goodput: object) -> None:
    assert interval.goodput == goodput


def test_an_interval_credited_late_passes_one_but_goodput_to_date_stays_within_one() -> None:
    # 100 s allocated in the interval, but a checkpoint in it saved 150 s of steps that ran before it
    late = intervals([(0, cumulative(300, 50, 200)), (300, cumulative(400, 200, 50))])[0]
    assert late.goodput == pytest.approx(1.5)
    assert late.goodput_to_date == pytest.approx(0.5)
    assert intervals([(0, cumulative(0, 0)), (300, cumulative(0, 0))])[0].goodput_to_date is None


def test_parse_samples_sorts_by_bucket_and_skips_unreadable_fields() -> None:
    raw = {"900": json.dumps(S2), "300": json.dumps(S1), "x": "{}", "600": "not json", "1200": "[1]"}
    assert parse_samples(raw) == [(300, S1), (900, S2)]


def refreshed(refreshes: list[tuple[float, float]], bucket: int) -> list[GoodputInterval]:
    """The intervals after refreshes at (instant, cumulative allocated) filed as ``accounting.refresh()`` files
    them: one history field per bucket, a later refresh in a bucket overwriting the earlier one."""
    history: dict[str, str] = {}
    for now, allocated in refreshes:
        field_, value = sample_entry(now, bucket, cumulative(allocated, 0))
        history[field_] = value
    return intervals(parse_samples(history))


@pytest.mark.parametrize(("case", "refreshes", "bucket", "expected"), [
    # refreshes every 30 s into 300 s buckets; 2 devices allocated from 600 s: the last sample of the first
    # bucket (at 570 s) has nothing, the last of the second (870 s) 2 x 270 s, the last of the third 2 x 570 s
    ("steady refreshes", [(t, 2 * max(t - 600, 0)) for t in range(0, 1200, 30)], 300,
     [(270, 570, 0.0), (570, 870, 540.0), (870, 1170, 600.0)]),
    # a job on 2 devices from 300 s to 600 s: 540 of its 600 device-seconds are in the 570 s sample, the rest
    # in the 630 s one, which the 870 s refresh overwrites in its bucket
    ("a job within one bucket", [(270, 0), (570, 2 * 270), (630, 600), (870, 600)], 300,
     [(270, 570, 540.0), (570, 870, 60.0)]),
    ("a sample on a bucket boundary", [(300, 0), (600, 100), (900, 250)], 300, [(300, 600, 100.0), (600, 900, 150.0)]),
    ("a gap while no API ran is one long interval", [(10, 0), (310, 20), (1250, 80)], 300,
     [(10, 310, 20.0), (310, 1250, 60.0)]),
    ("fractional instants are kept to the second", [(59.5, 0), (119.9, 6)], 60, [(59, 119, 6.0)]),
])
def test_an_interval_spans_the_instants_its_samples_were_taken(
        case: str, refreshes: list[tuple[float, float]], bucket: int, expected: list[tuple[int, int, float]]) -> None:
    got = refreshed(refreshes, bucket)
    assert [(i.start, i.end, i.allocated) for i in got] == expected


def test_a_sample_recorded_before_samples_carried_their_instant_stands_at_its_bucket_start() -> None:
    raw = {"300": json.dumps(S1), "600": json.dumps({"sampledAt": 890, **S2})}
    assert parse_samples(raw) == [(300, S1), (890, S2)]
