"""The tracking exporter: a job's metric history and evaluation results into its tenant's MLflow server and
TensorBoard event files (docs/tracking.md).

    loop tracking (every TRAINYARD_TRACKING_REFRESH_S) ──> TrackingExporter.refresh
        1. jobs      Keys.tracking_jobs (the ingest marks each job rank 0 reports for), the tenants' targets
        2. per job   (at most TRAINYARD_TRACKING_CONCURRENCY at once; one job's failure is its own)
                     targets: tracking_plan.targets_of(tenant's TenantTracking, spec.tracking)
                     per target, from its cursor (Keys.tracking_cursor):
                       a. steps      tracking_plan.next_span over rank 0's history fence → points → the target
                                     → cursor saved (piece by piece: a restart resends at most one piece)
                       b. evals      Keys.evaluations(job) not yet sent → eval/<metric> at their global step
                       c. end        a terminal job, caught up: MLflow's run ends with the job's state
        3. forget    a terminal job whose targets are all done, TRAINYARD_TRACKING_LINGER_S after it ended

A target that fails backs off with :data:`RETRY` (per job and target, in memory), and the other jobs go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
from pydantic import ValidationError
from redis.asyncio import Redis

from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.records import JobRecord
from trainyard_contract.storage import ArtifactLayout, ObjectPath, commit_bytes, commit_bytes_under, open_dir_under
from trainyard_contract.tracking import TenantTracking
from trainyard_runtime.retry import Backoff, RetryPolicy
from trainyard_runtime.store import Keys
from trainyard_telemetry import tracking_plan as plan
from trainyard_telemetry.metrics_history import MetricHistory
from trainyard_telemetry.mlflow_rest import MlflowRest, TrackingError
from trainyard_telemetry.tfevents import by_step, event_file
from trainyard_telemetry.tracking_plan import Cursor, EvalPoint, Span, Target

log = logging.getLogger(__name__)

RETRY = RetryPolicy(initial_interval_s=5.0, backoff_coefficient=2.0, maximum_interval_s=300.0)
EVENT_FILE = "events.out.tfevents.{:010d}.trainyard"


class TrackingSettings(Protocol):
    tracking_span_steps: int
    tracking_spans_per_pass: int
    tracking_concurrency: int
    tracking_linger_s: float


@dataclass
class Piece:
    """What one step of a target's export sends: the steps of ``span`` and their points by exported key."""

    span: Span
    points: dict[str, tuple[np.ndarray, np.ndarray]]
    fence: np.ndarray  # the span's fence (attempt + 1 per step)


# ----------------------------------------------------------------------------- TensorBoard


def _ensure_dir_under(root: Path, path: Path) -> None:
    """Create ``path``'s missing directories below ``root``, each from a handle of its parent (never through a
    link a rank planted in the job's directory: :func:`open_dir_under` refuses it)."""
    parts = path.relative_to(root).parts
    for i in range(len(parts)):
        fd = open_dir_under(root, root.joinpath(*parts[:i]))
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(parts[i], 0o755, dir_fd=fd)
        finally:
            os.close(fd)


def write_event_file(layout: ArtifactLayout, location: Any, data: bytes) -> None:
    """One whole event file at ``location`` under the artifact root: one PUT in an object store, a rename locally."""
    if isinstance(location, ObjectPath):
        commit_bytes(location, data)
        return
    _ensure_dir_under(layout.root, location.parent)
    commit_bytes_under(layout.root, location, data)


class TensorBoardTarget:
    """Event files under ``<job>/tensorboard/``: ``train/`` one file per piece, ``eval/`` one per batch of new
    evaluations, each named by the cursor's count so that a piece redone after a crash rewrites its own file."""

    name: Target = "tensorboard"

    def __init__(self, layout: ArtifactLayout, clock: Callable[[], float]) -> None:
        self.layout = layout
        self.clock = clock

    def directory(self, job: JobRecord) -> Any:
        return self.layout.job_dir(job.tenant, job.job_id) / "tensorboard"

    async def send(self, job: JobRecord, cursor: Cursor, piece: Piece) -> Cursor:
        restart = piece.span.first if piece.span.restart else None
        data = await asyncio.to_thread(event_file, self.clock(), by_step(piece.points), restart_at=restart)
        location = self.directory(job) / "train" / EVENT_FILE.format(cursor.files)
        await asyncio.to_thread(write_event_file, self.layout, location, data)
        return replace(plan.advanced(cursor, piece.span), files=cursor.files + 1)

    async def send_evals(self, job: JobRecord, cursor: Cursor, evals: list[EvalPoint]) -> Cursor:
        new = [p for p in evals if p.evaluation_job_id not in cursor.evals]
        data = await asyncio.to_thread(event_file, self.clock(), [(p.step, p.values) for p in new])
        location = self.directory(job) / "eval" / EVENT_FILE.format(len(cursor.evals))
        await asyncio.to_thread(write_event_file, self.layout, location, data)
        return replace(cursor, evals=cursor.evals + tuple(p.evaluation_job_id for p in new))

    async def end(self, job: JobRecord, cursor: Cursor) -> Cursor:
        return replace(cursor, ended=job.state)


# ----------------------------------------------------------------------------- MLflow


class MlflowTarget:
    """The job's MLflow run: found by its ``trainyard.jobId`` tag or created (params and tags with it), metrics in
    log-batches of at most 1000, ended with the job's terminal state."""

    name: Target = "mlflow"

    def __init__(self, client: httpx.AsyncClient, uri: str, clock: Callable[[], float],
                 save: Callable[[Cursor], Any]) -> None:
        self.rest = MlflowRest(client, uri)
        self.clock = clock
        self.save = save  # the cursor after each log-batch: a restart resends at most one

    def _ms(self) -> int:
        return int(self.clock() * 1000)

    async def run(self, job: JobRecord, cursor: Cursor) -> Cursor:
        """The cursor with the job's run: the run already tagged with the job, else a new one; its params and tags
        are logged whenever the cursor did not know the run yet (MLflow takes an equal param again)."""
        if cursor.run_id:
            return cursor
        experiment = await self.rest.experiment_id(plan.experiment_name(job))
        tags = plan.run_tags(job)
        run_id = await self.rest.find_run(experiment, "trainyard.jobId", job.job_id)
        if run_id is None:
            run_id = await self.rest.create_run(experiment, plan.run_name(job), self._ms(), tags)
        items = list(plan.run_params(job.spec.wire(), getattr(job, "experiment", None)).items())
        for i in range(0, len(items), plan.MLFLOW_PARAMS_BATCH):
            await self.rest.log_batch(run_id, params=dict(items[i:i + plan.MLFLOW_PARAMS_BATCH]))
        await self.rest.log_batch(run_id, tags=tags)
        cursor = replace(cursor, run_id=run_id)
        await self.save(cursor)
        return cursor

    async def send(self, job: JobRecord, cursor: Cursor, piece: Piece) -> Cursor:
        cursor = await self.run(job, cursor)
        assert cursor.run_id is not None
        now = self._ms()
        span = piece.span
        state: dict[str, str] | None = {"trainyard.state": job.state}  # kept current: with a piece's first batch
        for batch, last in metric_batches(piece.points, span.first, span.last):
            seen = piece.fence[: last - span.first + 1]
            if batch:
                await self.rest.log_batch(cursor.run_id, metrics=[(k, v, now, s) for k, v, s in batch], tags=state)
                state = None
            cursor = replace(cursor, step=last + 1, attempt=max(cursor.attempt, int(seen.max()) if len(seen) else 0))
            await self.save(cursor)
        return plan.advanced(cursor, span)

    async def send_evals(self, job: JobRecord, cursor: Cursor, evals: list[EvalPoint]) -> Cursor:
        cursor = await self.run(job, cursor)
        assert cursor.run_id is not None
        new = [p for p in evals if p.evaluation_job_id not in cursor.evals]
        now = self._ms()
        metrics = [(k, v, now, p.step) for p in new for k, v in p.values.items()]
        for i in range(0, len(metrics), plan.MLFLOW_BATCH):
            await self.rest.log_batch(cursor.run_id, metrics=metrics[i:i + plan.MLFLOW_BATCH])
        return replace(cursor, evals=cursor.evals + tuple(p.evaluation_job_id for p in new))

    async def end(self, job: JobRecord, cursor: Cursor) -> Cursor:
        cursor = await self.run(job, cursor)
        assert cursor.run_id is not None
        status = plan.run_status(job.state)
        await self.rest.log_batch(cursor.run_id, tags={"trainyard.state": job.state})
        if status:
            await self.rest.end_run(cursor.run_id, status, self._ms())
        return replace(cursor, ended=job.state)


def metric_batches(points: Mapping[str, tuple[np.ndarray, np.ndarray]], first: int,
                   last: int) -> list[tuple[list[tuple[str, float, int]], int]]:
    """The points of steps ``first..last`` as log-batches of at most 1000 (key, value, step), whole steps each,
    with the last step each batch covers (the cursor after it); the last batch covers to ``last``."""
    rows = sorted((int(s), key, float(v)) for key, (steps, values) in points.items()
                  for s, v in zip(steps, values, strict=True))
    out: list[tuple[list[tuple[str, float, int]], int]] = []
    batch: list[tuple[str, float, int]] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][0] == rows[i][0]:
            j += 1
        if batch and len(batch) + (j - i) > plan.MLFLOW_BATCH:
            out.append((batch, rows[i][0] - 1))
            batch = []
        batch += [(k, v, s) for s, k, v in rows[i:j]]
        i = j
    out.append((batch, last))
    return out


# ----------------------------------------------------------------------------- the exporter

Sender = TensorBoardTarget | MlflowTarget


class TrackingExporter:
    """The ``tracking`` loop's pass (:meth:`refresh`) over every marked job; ``aclose`` closes its HTTP client."""

    def __init__(self, redis: Redis, history: MetricHistory, layout: ArtifactLayout, settings: TrackingSettings, *,
                 clock: Callable[[], float] = time.time, client: httpx.AsyncClient | None = None,
                 timeout_s: float = 10.0) -> None:
        self.redis = redis
        self.history = history
        self.layout = layout
        self.settings = settings
        self.clock = clock
        self._own_client = client is None
        self.client = client or httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)
        self._waits: dict[tuple[str, Target], tuple[Backoff, float]] = {}
        self._closed = False

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._own_client:
            await self.client.aclose()

    async def __aenter__(self) -> TrackingExporter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def refresh(self) -> None:
        """1. the marked jobs and the tenants' targets 2. each job's export, a few at once."""
        jobs: list[str] = await self.redis.zrange(Keys.tracking_jobs, 0, -1)  # type: ignore[assignment]  # decoded
        if not jobs:
            return
        tenants = await self.tenants()
        gate = asyncio.Semaphore(self.settings.tracking_concurrency)

        async def one(job_id: str) -> None:
            async with gate:
                try:
                    await self.export_job(job_id, tenants)
                except Exception:  # one job's trouble is logged; the others go on
                    log.exception("tracking: export of %s failed", job_id)

        await asyncio.gather(*(one(j) for j in jobs))

    async def tenants(self) -> dict[str, TenantTracking]:
        """Every tenant's targets; an entry that no longer validates (a URI refused since) is left out, logged."""
        raw: dict[str, str] = await self.redis.hgetall(Keys.tracking_tenants)  # type: ignore[assignment]  # decoded
        out: dict[str, TenantTracking] = {}
        for tenant, text in raw.items():
            try:
                out[tenant] = TenantTracking.model_validate_json(text)
            except ValidationError as exc:
                log.warning("tracking: tenant %s's targets refused, nothing exported: %s", tenant,
                            exc.errors()[0]["msg"])
        return out

    async def export_job(self, job_id: str, tenants: Mapping[str, TenantTracking]) -> None:
        """Each of the job's targets from its cursor (a failing one backs off alone); 3. forget a finished job."""
        raw = await self.redis.get(Keys.job(job_id))
        if raw is None:
            await self._forget(job_id)
            return
        job = JobRecord.model_validate_json(raw)
        config = tenants.get(job.tenant)
        cursors: dict[str, str] = await self.redis.hgetall(Keys.tracking_cursor(job_id))  # type: ignore[assignment]
        done = True
        for name in plan.targets_of(config, job.spec.tracking):
            assert config is not None
            if not self._due((job_id, name)):
                done = False
                continue
            try:
                done &= await self.export(job, self._sender(name, job, config), Cursor.loads(cursors.get(name)))
                self._waits.pop((job_id, name), None)
            except Exception as exc:  # noqa: BLE001 - any failure of a target backs off that target only
                done = False
                self._failed((job_id, name), exc)
        ended = job.state in TERMINAL_STATES
        if done and ended and self.clock() - job.updated_at.timestamp() >= self.settings.tracking_linger_s:
            await self._forget(job_id)

    async def _forget(self, job_id: str) -> None:
        await self.redis.zrem(Keys.tracking_jobs, job_id)
        for target in plan.TARGETS:
            self._waits.pop((job_id, target), None)

    def _sender(self, name: Target, job: JobRecord, config: TenantTracking) -> Sender:
        if name == "tensorboard":
            return TensorBoardTarget(self.layout, self.clock)
        assert config.mlflow_uri is not None

        async def save(cursor: Cursor) -> None:
            await self.save(job.job_id, "mlflow", cursor)

        return MlflowTarget(self.client, config.mlflow_uri, self.clock, save)

    async def save(self, job_id: str, target: Target, cursor: Cursor) -> None:
        await self.redis.hset(Keys.tracking_cursor(job_id), target, cursor.dumps())

    async def export(self, job: JobRecord, sender: Sender, cursor: Cursor) -> bool:
        """a. steps b. evaluations c. the end, from ``cursor``; True when the target has everything (and a
        terminal job's end)."""
        keys = plan.series_keys(await self.history.custom_series(job.job_id))
        for _ in range(self.settings.tracking_spans_per_pass):
            base = plan.fence_base(cursor)
            fence = await self.history.fence(job.job_id, base)
            span = plan.next_span(cursor, fence, base, self.settings.tracking_span_steps,
                                  settled=job.state in TERMINAL_STATES)
            if span is None:
                break
            found = await self.history.points(job.job_id, list(keys), span.first, span.last)
            piece = Piece(span, {keys[n]: sv for n, sv in found.items() if len(sv[0])},
                          fence[span.first - base: span.last - base + 1])
            cursor = await sender.send(job, cursor, piece)
            await self.save(job.job_id, sender.name, cursor)
        else:
            return False  # more than one pass's worth: the rest next pass
        evals = await self._evals(job.job_id)
        if {p.evaluation_job_id for p in evals} - set(cursor.evals):
            cursor = await sender.send_evals(job, cursor, evals)
            await self.save(job.job_id, sender.name, cursor)
        if job.state not in TERMINAL_STATES:
            return True
        if cursor.ended != job.state:
            cursor = await sender.end(job, cursor)
            await self.save(job.job_id, sender.name, cursor)
        return True

    async def _evals(self, job_id: str) -> list[EvalPoint]:
        key_of = getattr(Keys, "evaluations", None)  # the registry's evaluation results (issue 36), where present
        if key_of is None:
            return []
        return plan.eval_points(await self.redis.hgetall(key_of(job_id)))  # type: ignore[arg-type]  # decoded

    def _due(self, key: tuple[str, Target]) -> bool:
        wait = self._waits.get(key)
        return wait is None or self.clock() >= wait[1]

    def _failed(self, key: tuple[str, Target], exc: Exception) -> None:
        backoff = self._waits[key][0] if key in self._waits else Backoff(RETRY)
        delay = backoff.failed()
        self._waits[key] = (backoff, self.clock() + delay)
        if isinstance(exc, TrackingError | OSError):
            log.warning("tracking: %s of %s failed (%s); next try in %.0f s", key[1], key[0], exc, delay)
        else:
            log.warning("tracking: %s of %s failed; next try in %.0f s", key[1], key[0], delay, exc_info=exc)
