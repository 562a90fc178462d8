"""Goodput over time: cumulative ledger samples → intervals. Pure; no Redis or clock.

``accounting.refresh()`` stores, per tenant and per bucket of ``goodput_history_bucket_s``, the tenant's
cumulative ledger seconds (:meth:`Ledger.seconds`) under the bucket's start, with the instant it was taken
(``sampledAt``). Two consecutive samples make an interval: what was allocated, productive and wasted between
them is the difference of the cumulative values. A sample is the last one written in its bucket (several API
processes overwrite each other with the same kind of value), so it stands for the cumulative values late in
its bucket, not at its start: an interval runs from one sample's instant to the next one's. (Read as
bucket starts, every interval came out one bucket early.) A sample stored without its instant stands at its
bucket's start.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainyard_telemetry.goodput import WASTE_KINDS

Sample = tuple[int, Mapping[str, float]]  # (when it was taken, epoch seconds; cumulative seconds by kind)
SAMPLED_AT = "sampledAt"


@dataclass(frozen=True)
class GoodputInterval:
    """Device-seconds between two consecutive samples (``start``, ``end``: epoch seconds)."""

    start: int
    end: int
    allocated: float
    productive: float
    in_flight: float
    wasted: float
    wasted_by_kind: Mapping[str, float] = field(default_factory=dict)
    allocated_to_date: float = 0.0
    productive_to_date: float = 0.0

    @property
    def goodput(self) -> float | None:
        """Δproductive ÷ Δallocated; None when nothing was allocated in the interval. It can pass 1: steps
        count as productive when a checkpoint saves them, which may be an interval after they ran."""
        return self.productive / self.allocated if self.allocated else None

    @property
    def goodput_to_date(self) -> float | None:
        """The tenant's goodput over everything up to the interval's end (always within [0, 1])."""
        return self.productive_to_date / self.allocated_to_date if self.allocated_to_date else None


def bucket_start(now_s: float, bucket_s: int) -> int:
    """The start (epoch seconds) of the bucket ``now_s`` falls in."""
    return int(math.floor(now_s / bucket_s)) * bucket_s


def sample_entry(now_s: float, bucket_s: int, seconds: Mapping[str, float]) -> tuple[str, str]:
    """The history field (the bucket ``now_s`` falls in) and value (the cumulative ``seconds`` and the
    instant, to the second) of a sample taken at ``now_s``."""
    return str(bucket_start(now_s, bucket_s)), json.dumps({SAMPLED_AT: int(math.floor(now_s)), **seconds})


def expired_buckets(buckets: Iterable[int], *, now_s: float, retention_s: float) -> list[int]:
    """The buckets that started more than ``retention_s`` before ``now_s``."""
    return sorted(b for b in buckets if b < now_s - retention_s)


def parse_samples(raw: Mapping[str, str]) -> list[Sample]:
    """A history hash (bucket → JSON) as samples sorted by when they were taken (a sample without its
    instant: its bucket's start); unreadable fields are skipped."""
    samples: list[Sample] = []
    for key, value in raw.items():
        try:
            bucket, seconds = int(key), json.loads(value)
        except (TypeError, ValueError):
            continue
        if isinstance(seconds, dict):
            at = seconds.pop(SAMPLED_AT, bucket)
            numbers = {k: float(v) for k, v in seconds.items() if isinstance(v, int | float)}
            samples.append((int(at) if isinstance(at, int | float) else bucket, numbers))
    return sorted(samples, key=lambda s: s[0])


def intervals(samples: Sequence[Sample], *, since: float | None = None, until: float | None = None
              ) -> list[GoodputInterval]:
    """The intervals between consecutive samples (sorted by instant), oldest first; with ``since`` /
    ``until`` only those that overlap [since, until]."""
    ordered = sorted(samples, key=lambda s: s[0])
    out: list[GoodputInterval] = []
    for (t0, a), (t1, b) in zip(ordered, ordered[1:]):
        if (since is not None and t1 <= since) or (until is not None and t0 >= until):
            continue
        delta = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in {*a, *b}}
        out.append(GoodputInterval(
            start=t0, end=t1, allocated=delta.get("allocated", 0.0), productive=delta.get("productive", 0.0),
            in_flight=delta.get("inFlight", 0.0), wasted=delta.get("wasted", 0.0),
            wasted_by_kind={k: delta.get(k, 0.0) for k in WASTE_KINDS},
            allocated_to_date=b.get("allocated", 0.0), productive_to_date=b.get("productive", 0.0),
        ))
    return out
