"""Checkpoint-interval advice (Young 1974, Daly 2006) from what the platform measured. Pure.

Inputs, all measured by the coordinator:

* the **checkpoint cost** ``delta``: the training time one checkpoint costs, i.e. the stall
  (``StepMetrics.checkpointSeconds``, slowest rank per step, summed over the steps a checkpoint
  holds training up: its start and, in async mode, its completion a few steps later). Without a
  stall measurement, the slowest rank's write time (``ShardWritten.writeSeconds``), else the
  spread between the first and last shard report;
* the **write time**: an asynchronous save overlaps training, but one save is in flight at a
  time, so the interval is never shorter than a write;
* the **step time** (compute, without the stall), to turn seconds into steps;
* the **MTBF** of the job: the device MTBF of its device type, observed as device-seconds of
  training per failed attempt (see :func:`device_mtbf`), divided by the job's device count.

The interval is Daly's higher-order estimate (Young's first-order one is shown beside it),
at least one write and one step long, and given in steps and seconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import CheckpointRecord
from trainyard_contract.spec import CheckpointPolicy
from trainyard_planner.checkpoint import daly_interval, job_mtbf, wasted_fraction, young_interval

#: Llama 3 405B: 466 interruptions in 54 days on 16,384 GPUs, i.e. one per ~1.6e8 GPU-seconds
#: (about 5 years per device). Used until a device type has failed at least once.
PRIOR_DEVICE_MTBF_S = 16_384 * 54 * 86_400 / 466


def counts_as_interruption(reason: str, exit_code: int) -> bool:
    """Whether a rank exit with ``reason`` is a failure of the hardware or the software stack, counted for
    the MTBF (``ExitReason.counts_for_mtbf``): spec, data and numerical errors are the job's own fault;
    revocation and preemption are the platform's choice."""
    return exit_code != 0 and ExitReason.parse(reason).counts_for_mtbf


@dataclass(frozen=True)
class FailureStats:
    """Observed for one device type: failed attempts, and device-seconds of training."""

    failures: int = 0
    exposure_device_seconds: float = 0.0


def device_mtbf(stats: FailureStats, *, prior_s: float = PRIOR_DEVICE_MTBF_S) -> tuple[float, str]:
    """(device MTBF in seconds, "observed" | "prior").

    Observed: device-seconds per failure (the maximum-likelihood estimate of an exponential
    time to failure). With no failure yet, the prior, or the exposure itself when that is
    already longer (no failure in E device-seconds makes an MTBF below E unlikely).
    """
    if stats.failures > 0:
        return max(stats.exposure_device_seconds, 1.0) / stats.failures, "observed"
    return max(prior_s, stats.exposure_device_seconds), "prior"


def checkpoint_stalls(
    ready: Sequence[CheckpointRecord], stall_by_step: dict[tuple[int, int], float]
) -> dict[str, float]:
    """Stall seconds per READY checkpoint id: the per-step stalls (slowest rank) of its attempt
    from its own step up to the next checkpoint's step. Checkpoints without data are left out."""
    by_attempt: dict[int, list[int]] = {}
    for c in ready:
        by_attempt.setdefault(c.attempt, []).append(c.global_step)
    out: dict[str, float] = {}
    for c in ready:
        later = [s for s in by_attempt[c.attempt] if s > c.global_step]
        end = min(later) if later else math.inf
        window = [v for (a, s), v in stall_by_step.items() if a == c.attempt and c.global_step <= s < end]
        if window:
            out[c.checkpoint_id] = sum(window)
    return out


def shard_spread(record: CheckpointRecord) -> float | None:
    if record.first_shard_at is None or record.last_shard_at is None:
        return None
    return max((record.last_shard_at - record.first_shard_at).total_seconds(), 0.0)


class CheckpointAdvice(BaseModel):
    """What GET /v1/training-jobs/{id} can show as ``checkpointAdvice`` (stored as camelCase JSON)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    job_id: str
    device_type: str
    devices: int
    measured_checkpoints: int
    checkpoint_cost_seconds: float | None
    cost_source: Literal["stall", "write", "shard-spread", "none"]
    write_seconds: float | None
    stall_seconds: float | None
    step_seconds: float | None
    failures: int
    exposure_device_seconds: float
    device_mtbf_seconds: float
    job_mtbf_seconds: float
    mtbf_source: Literal["observed", "prior"]
    young_interval_seconds: float | None
    daly_interval_seconds: float | None
    interval_seconds: float | None
    interval_steps: int | None
    current_interval_steps: int | None
    current_interval_seconds: float | None
    current_wasted_fraction: float | None
    advised_wasted_fraction: float | None
    auto: bool
    note: str
    updated_at: datetime

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def advise(
    *,
    job_id: str,
    device_type: str,
    devices: int,
    policy: CheckpointPolicy,
    max_steps: int,
    ready: Sequence[CheckpointRecord],
    stall_by_step: dict[tuple[int, int], float],
    step_seconds: float | None,
    stats: FailureStats,
    now: datetime,
    prior_mtbf_s: float = PRIOR_DEVICE_MTBF_S,
    window: int = 5,
) -> CheckpointAdvice:
    """The Young/Daly interval for one job from its last ``window`` READY checkpoints. Pure."""
    recent = sorted(ready, key=lambda c: (c.attempt, c.global_step))[-window:]
    stalls = list(checkpoint_stalls(recent, stall_by_step).values())
    writes = [c.write_seconds for c in recent if c.write_seconds is not None]
    spreads = [s for c in recent if (s := shard_spread(c)) is not None]
    stall, write = _median(stalls), _median(writes)
    cost, source = _cost(stall, write, _median(spreads))
    d_mtbf, mtbf_source = device_mtbf(stats, prior_s=prior_mtbf_s)
    m = job_mtbf(d_mtbf, devices)
    young = daly = interval = None
    steps = None
    note = "no checkpoint measured yet"
    if cost is not None:
        delta = max(cost, 1e-3)  # a stall measured as 0 still costs something: keep the math finite
        young, daly = young_interval(delta, m), daly_interval(delta, m)
        interval = max(daly, write or 0.0, step_seconds or 0.0)
        note = f"Daly's interval for a {delta:.3g}s checkpoint cost and a {m:.3g}s job MTBF ({mtbf_source})"
        if step_seconds:
            steps = min(max(1, round(interval / step_seconds)), max_steps)
        else:
            note += "; no step time measured yet"
    current_steps, current_s = _current(policy, step_seconds)
    current_waste = advised_waste = None
    if cost is not None and current_s:
        current_waste = wasted_fraction(current_s, max(cost, 1e-3), m)
    if cost is not None and interval:
        advised_waste = wasted_fraction(interval, max(cost, 1e-3), m)
    return CheckpointAdvice(
        job_id=job_id, device_type=device_type, devices=devices, measured_checkpoints=len(recent),
        checkpoint_cost_seconds=cost, cost_source=source, write_seconds=write, stall_seconds=stall,
        step_seconds=step_seconds, failures=stats.failures, exposure_device_seconds=stats.exposure_device_seconds,
        device_mtbf_seconds=d_mtbf, job_mtbf_seconds=m, mtbf_source=mtbf_source,
        young_interval_seconds=young, daly_interval_seconds=daly, interval_seconds=interval, interval_steps=steps,
        current_interval_steps=current_steps, current_interval_seconds=current_s,
        current_wasted_fraction=current_waste, advised_wasted_fraction=advised_waste,
        auto=policy.auto, note=note, updated_at=now,
    )


def _cost(stall: float | None, write: float | None, spread: float | None) -> tuple[float | None, str]:
    if stall is not None:
        return stall, "stall"
    if write is not None:
        return write, "write"
    if spread is not None:
        return spread, "shard-spread"
    return None, "none"


def _current(policy: CheckpointPolicy, step_seconds: float | None) -> tuple[int | None, float | None]:
    """The spec's interval in steps and seconds (as far as the step time allows)."""
    if policy.every_steps is not None:
        return policy.every_steps, policy.every_steps * step_seconds if step_seconds else None
    if policy.every_minutes is not None:
        seconds = policy.every_minutes * 60.0
        return (max(1, round(seconds / step_seconds)) if step_seconds else None), seconds
    return None, None
