"""Checkpoint size, write time, storage, and the interval that wastes the least.

Size: a checkpoint holds what resuming needs, the weights and the optimizer (master copy, Adam m
and v) but not the gradients, which are rebuilt by the next backward: 2 + 4 + 8 = 14 bytes per
parameter with mixed-precision Adam, about 1 TB for 70B (the seed's "约 1TB").

Interval (``delta`` = write time, ``M`` = mean time between failures of the whole job,
``R`` = restart time, ``tau`` = compute time between checkpoints):

- Young 1974, "A first order approximation to the optimum checkpoint interval":
  ``tau = sqrt(2 delta M)``.
- Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps":
  ``tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + delta / 9M] - delta`` for ``delta < 2M``,
  else ``tau = M``; and the exact optimum of his cost model
  ``T_wall = M e^(R/M) (e^((tau + delta)/M) - 1) T_solve / tau``, which solves
  ``(tau/M - 1) e^((tau + delta)/M) + 1 = 0``.
"""

from __future__ import annotations

import math

from pydantic import Field

from trainyard_planner._private import Model
from trainyard_planner.memory import MIXED_PRECISION_ADAM, BytesPerParameter


def checkpoint_bytes(
    parameters: float,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    *,
    include_gradients: bool = False,
    extra_bytes: float = 0,
) -> float:
    """Bytes of one full training checkpoint (every rank's shards together)."""
    per_param = bytes_per_parameter.total - (0 if include_gradients else bytes_per_parameter.gradients)
    return parameters * per_param + extra_bytes


def write_seconds(size_bytes: float, bandwidth: float) -> float:
    """Stall to write ``size_bytes`` at ``bandwidth`` bytes/s: 1 TB at 10 GB/s is 100 s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return size_bytes / bandwidth


def storage_bytes(size_bytes: float, *, keep_last: int, jobs: int = 1, in_flight: int = 0) -> float:
    """Hot storage for ``keep_last`` checkpoints of ``jobs`` jobs, plus ``in_flight`` being written
    (staging) per job: 1 TB x 3 x 100 jobs = 300 TB."""
    return size_bytes * (keep_last + in_flight) * jobs


def young_interval(write_time: float, mtbf: float) -> float:
    """Young's first-order optimum ``sqrt(2 delta M)`` (seconds in, seconds out)."""
    _check(write_time, mtbf)
    return math.sqrt(2 * write_time * mtbf)


def daly_interval(write_time: float, mtbf: float) -> float:
    """Daly's higher-order estimate; ``M`` itself once the write takes ``2M`` or more."""
    _check(write_time, mtbf)
    d, m = write_time, mtbf
    if d >= 2 * m:
        return m
    return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (9 * m)) - d


def daly_optimal_interval(write_time: float, mtbf: float) -> float:
    """The exact minimiser of Daly's expected wall time (independent of restart time)."""
    _check(write_time, mtbf)
    eps = write_time / mtbf
    # g(u) = (u - 1) e^(u + eps) + 1 with u = tau / M, written with expm1 to keep precision when
    # u is small; g is increasing and convex on (0, 1] with g(0) < 0 < g(1), so Newton from u = 1
    # descends monotonically onto the root.
    u = 1.0
    for _ in range(200):
        g = (u - 1) * math.expm1(u + eps) + u
        step = g / (u * math.exp(u + eps))
        u -= step
        if abs(step) < 1e-15 * max(u, 1e-300):
            break
    return u * mtbf


def wasted_fraction(interval: float, write_time: float, mtbf: float, *, restart_time: float = 0.0) -> float:
    """Young's first-order expected waste per unit of time: checkpoint overhead ``delta / tau``
    plus expected rework ``tau / (2M)`` (on a failure, half an interval is lost on average) plus
    ``R / M`` for restarts. Minimised by :func:`young_interval`; accurate while
    ``delta << tau << M``."""
    _check(write_time, mtbf)
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    return write_time / interval + interval / (2 * mtbf) + restart_time / mtbf


def daly_wasted_fraction(interval: float, write_time: float, mtbf: float, *, restart_time: float = 0.0) -> float:
    """``1 - T_solve / T_wall`` under Daly's exponential-failure cost model (exact, not first order)."""
    _check(write_time, mtbf)
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    m = mtbf
    slowdown = m * math.exp(restart_time / m) * math.expm1((interval + write_time) / m) / interval
    return 1 - 1 / slowdown


def job_mtbf(device_mtbf: float, devices: int) -> float:
    """A synchronous job fails when any of its devices does: ``M_device / devices``."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return device_mtbf / devices


class CheckpointPlan(Model):
    size_bytes: float
    write_seconds: float
    storage_bytes: float
    mtbf_seconds: float
    young_interval_seconds: float
    daly_interval_seconds: float
    daly_optimal_interval_seconds: float
    interval_seconds: float = Field(description="the interval evaluated: the given one, else Daly's optimum")
    wasted_fraction: float = Field(description="Young's first-order waste at interval_seconds")
    daly_wasted_fraction: float = Field(description="Daly's exact waste at interval_seconds")
    recommended_wasted_fraction: float = Field(description="Daly's exact waste at Daly's optimum")
    interval_steps: int | None = Field(default=None, description="the interval in whole steps, given a step time")


def plan_checkpoint(
    size_bytes: float,
    *,
    write_bandwidth: float,
    mtbf_seconds: float,
    keep_last: int = 3,
    jobs: int = 1,
    interval_seconds: float | None = None,
    restart_seconds: float = 0.0,
    step_seconds: float | None = None,
) -> CheckpointPlan:
    """Write time, storage, the Young and Daly intervals and the waste at a chosen interval."""
    delta = write_seconds(size_bytes, write_bandwidth)
    optimum = daly_optimal_interval(delta, mtbf_seconds)
    tau = interval_seconds or optimum
    steps = max(1, round(tau / step_seconds)) if step_seconds else None
    return CheckpointPlan(
        size_bytes=size_bytes,
        write_seconds=delta,
        storage_bytes=storage_bytes(size_bytes, keep_last=keep_last, jobs=jobs),
        mtbf_seconds=mtbf_seconds,
        young_interval_seconds=young_interval(delta, mtbf_seconds),
        daly_interval_seconds=daly_interval(delta, mtbf_seconds),
        daly_optimal_interval_seconds=optimum,
        interval_seconds=tau,
        wasted_fraction=wasted_fraction(tau, delta, mtbf_seconds, restart_time=restart_seconds),
        daly_wasted_fraction=daly_wasted_fraction(tau, delta, mtbf_seconds, restart_time=restart_seconds),
        recommended_wasted_fraction=daly_wasted_fraction(optimum, delta, mtbf_seconds, restart_time=restart_seconds),
        interval_steps=steps,
    )


def _check(write_time: float, mtbf: float) -> None:
    if write_time < 0 or mtbf <= 0:
        raise ValueError(f"write time must be >= 0 and MTBF positive, got {write_time} and {mtbf}")
