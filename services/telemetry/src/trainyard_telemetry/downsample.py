"""Shape-preserving down-sampling of step series: pure functions over numpy arrays.

* :func:`lttb` — Largest-Triangle-Three-Buckets (Steinarsson 2013) for curves; past four candidates
  per point on a min/max preselection (MinMaxLTTB, Van Der Donckt et al. 2023). A spike survives both
  stages: it is its bucket's extreme, and the largest triangle of its LTTB bucket. Both run in
  ``tsdownsample`` (Rust, by the MinMaxLTTB paper's authors): a 1M-point curve in a few milliseconds.
* :func:`minmax` — each equal step range's minimum and maximum.
* :func:`bucket_stats` — equal step buckets (the same edges for every rank) with mean, min and max,
  for the per-rank heat map; an entry may stand for a block of steps (its mean, count and extremes).

Nothing here reads Redis or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from tsdownsample import LTTBDownsampler, MinMaxDownsampler, MinMaxLTTBDownsampler

Steps = NDArray[np.int64]
Values = NDArray[np.float64]


def lttb(steps: Steps, values: Values, max_points: int) -> tuple[Steps, Values]:
    """At most ``max_points`` of (steps, values), shape preserved; all of them when they fit."""
    n = len(steps)
    if n <= max_points:
        return steps, values
    if max_points < 3:
        keep = np.array([0, n - 1][:max_points], dtype=np.int64)
        return steps[keep], values[keep]
    sampler = MinMaxLTTBDownsampler() if n > 4 * max_points else LTTBDownsampler()
    keep = np.asarray(sampler.downsample(steps, values, n_out=max_points), dtype=np.int64)
    return steps[keep], values[keep]


def minmax(steps: Steps, values: Values, max_points: int) -> tuple[Steps, Values]:
    """Each of ``max_points // 2`` equal step ranges' minimum and maximum, in step order (with two or three
    points, the whole window is the one range); ``max_points`` is at least 2 (a range's two extremes)."""
    if max_points < 2:
        raise ValueError(f"min/max down-sampling keeps a range's two extremes: max_points {max_points} < 2")
    if len(steps) <= max_points:
        return steps, values
    if max_points < 4:
        # tsdownsample needs two ranges at least: with one it panics (a Rust panic, a BaseException)
        keep = np.unique(np.array([np.argmin(values), np.argmax(values)], dtype=np.int64))
    else:
        keep = np.unique(np.asarray(MinMaxDownsampler().downsample(steps, values, n_out=max_points // 2 * 2),
                                    dtype=np.int64))
    return steps[keep], values[keep]


@dataclass(frozen=True)
class Buckets:
    """Equal step buckets over ``[first, last]``: bucket ``i`` holds steps ``[edges[i], edges[i+1])``."""

    edges: Steps

    @classmethod
    def over(cls, first: int, last: int, count: int, *, align: int = 1) -> Buckets:
        """``count`` (or fewer) buckets; with ``align`` > 1 the inner edges are multiples of it, so each
        aligned block of steps falls in one bucket (the ends stay ``first`` and ``last + 1``)."""
        span = last - first + 1
        count = max(1, min(count, span))
        edges = np.linspace(first, last + 1, count + 1).astype(np.int64)
        if align > 1:
            edges = np.round(edges / align).astype(np.int64) * align
            edges = np.clip(edges, first, last + 1)
            edges[0], edges[-1] = first, last + 1
        return cls(np.unique(edges))

    @property
    def starts(self) -> Steps:
        return self.edges[:-1]


def bucket_stats(buckets: Buckets, steps: Steps, values: Values, *, counts: Values | None = None,
                 lows: Values | None = None, highs: Values | None = None) -> tuple[Values, Values, Values]:
    """Mean, min and max of ``values`` per bucket (NaN where a bucket holds none of ``steps``).

    Each entry may stand for several steps (a block of the history's coarser levels): ``values`` is then
    its mean over ``counts`` steps, ``lows`` / ``highs`` its extremes; it falls in the bucket of its step.
    """
    k = len(buckets.starts)
    weight = np.ones(len(steps)) if counts is None else np.asarray(counts, dtype=np.float64)
    lows = values if lows is None else lows
    highs = values if highs is None else highs
    order = np.argsort(steps, kind="stable")
    inside = order[(steps[order] >= buckets.edges[0]) & (steps[order] < buckets.edges[-1])]
    steps, values, weight, lows, highs = steps[inside], values[inside], weight[inside], lows[inside], highs[inside]
    if not len(steps):
        nan = np.full(k, np.nan)
        return nan, nan.copy(), nan.copy()
    # entries sorted by step: each bucket is one contiguous run, reduced at its first index
    at = np.searchsorted(steps, buckets.starts, side="left")
    n = np.diff(np.append(np.cumsum(np.concatenate([[0.0], weight]))[at], weight.sum()))
    sums = np.diff(np.append(np.cumsum(np.concatenate([[0.0], values * weight]))[at], (values * weight).sum()))
    empty = n == 0
    # a sentinel past the end keeps every index valid; the last bucket's run then ends on it (its identity)
    lo = np.minimum.reduceat(np.append(lows, np.inf), at)
    hi = np.maximum.reduceat(np.append(highs, -np.inf), at)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(empty, np.nan, sums / np.where(empty, 1, n))
    lo[empty] = np.nan
    hi[empty] = np.nan
    return mean, lo, hi
