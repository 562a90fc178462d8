"""The ingest: every StepMetrics into each read model, StragglerDetected into the job's straggler list.

    trainyard.metrics (group ``telemetry-metrics``, a batch at a time) ──> Ingest.on_step_metrics_batch
                                                                         ──> Ingest.on_step_metrics, each
        1. step timing     every rank's breakdown; rank 0's step ledger and recent work time (steptiming.py)
        2. metric history  every rank's series, down-sampled levels (metrics_history.py); rank 0's job is
                           marked in ``Keys.tracking_jobs`` for the tracking exporter (tracking.py)
        3. progress        rank 0's Progress, with the planner's calibration samples in its transaction
        4. job series      the per-job Prometheus series (jobmetrics.py)
    trainyard.workers ──> StragglerDetected ──> Keys.stragglers(job)

Each step is idempotent (a re-delivered or late StepMetrics changes nothing: the Lua scripts and the WATCH
compare the step with what is recorded), so the consumer commits after all four and a crash between
them redoes the event whole. Rank 0's step time is split once (:mod:`.steps`); the read models all use
that split, and the checkpoint coordinator reads the step-timing read model instead of deriving its own.
"""

from __future__ import annotations

import time

from trainyard_contract.events import METRICS, WORKERS, StepMetrics, StragglerDetected
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import Keys
from trainyard_telemetry.jobmetrics import JobSeries
from trainyard_telemetry.metrics_history import MetricHistory
from trainyard_telemetry.progress import ProgressProjector
from trainyard_telemetry.steptiming import StepTimingStore


METRICS_GROUP = "telemetry-metrics"  # the consumer group of the StepMetrics batches (after the group prefix)


class Ingest:
    """The StepMetrics and StragglerDetected handlers over the read models' writers."""

    def __init__(self, timing: StepTimingStore, history: MetricHistory, projector: ProgressProjector,
                 series: JobSeries) -> None:
        self.timing = timing
        self.history = history
        self.projector = projector
        self.series = series

    def install(self, runtime: ServiceRuntime) -> None:
        """Subscribe (before ``runtime.start()``) in the service's own consumer group."""
        # a batch at a time, in a group of its own: one StepMetrics per rank and step is the platform's busiest
        # stream (design.md §3.10)
        runtime.bus.subscribe_batch(METRICS, StepMetrics, self.on_step_metrics_batch,
                                    group=f"{runtime.bus.group_prefix}.{METRICS_GROUP}", background=True)
        runtime.bus.subscribe(WORKERS, {StragglerDetected: self.timing.on_straggler}, background=True)

    async def on_step_metrics_batch(self, batch: list[StepMetrics]) -> None:
        """A fetched batch: 1. step timing and 2. metric history of every event in one pipelined round trip
        (each rank's steps in their order; the scripts are idempotent per step) 3. progress, rank 0's events one
        by one (an optimistic transaction each) 4. job series."""
        async with self.timing.redis.pipeline(transaction=False) as pipe:
            for m in batch:
                await self.timing.stage(pipe, m)
                await self.history.stage(pipe, m)
            if jobs := {m.job_id for m in batch if m.rank == 0}:
                pipe.zadd(Keys.tracking_jobs, dict.fromkeys(jobs, time.time() * 1000))
            await pipe.execute()
        for m in batch:
            if m.rank == 0:
                await self.projector.on_step_metrics(m)
        for m in batch:
            self.series.on_step(m)

    async def on_step_metrics(self, m: StepMetrics) -> None:
        """1. step timing 2. metric history 3. progress (and calibration samples) 4. job series."""
        await self.timing.on_step_metrics(m)
        await self.history.on_step_metrics(m)
        if m.rank == 0:
            await self.timing.redis.zadd(Keys.tracking_jobs, {m.job_id: time.time() * 1000})
        await self.projector.on_step_metrics(m)
        self.series.on_step(m)
