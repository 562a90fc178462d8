"""The tracking exporter against a real MLflow server (from PyPI, in .tools/mlflow) and tensorboard's own reader,
over a real Redis: a job's metric history, written through the telemetry ingest, reaches its tenant's MLflow run
(params, tags, every point of every curve, evaluations, the end state) and TensorBoard event files, through a
restart of the exporter mid-way and a resumed attempt that replays steps; a tenant whose MLflow server is down
does not hold up another's export. One MLflow server for the module (~17 s to start)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import spec_with
from tests.support.mlflowserver import mlflow_server
from trainyard_cli import infra
from trainyard_contract.events import StepMetrics
from trainyard_contract.records import EvaluationResult, ExperimentOrigin, JobRecord, utcnow
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_contract.tracking import TenantTracking
from trainyard_runtime.store import Keys, StateStore
from trainyard_telemetry.ingest import Ingest
from trainyard_telemetry.jobmetrics import JobSeries
from trainyard_telemetry.metrics_history import MetricHistory
from trainyard_telemetry.progress import ProgressProjector
from trainyard_telemetry.steptiming import StepTimingStore
from trainyard_telemetry.tracking import TrackingExporter

pytestmark = pytest.mark.integration

STEPS = 400
ODD = {"grad/norm": 0.5, "../escape": 1.0, "a//b": 2.0, "/abs": 3.0}  # names a rank chose


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@dataclass
class Settings:
    tracking_span_steps: int = 120
    tracking_spans_per_pass: int = 2
    tracking_concurrency: int = 4
    tracking_linger_s: float = 0.0


@pytest.fixture
async def store(redis: Any) -> StateStore:
    return StateStore(redis)


@pytest.fixture
async def history(redis: Any) -> AsyncIterator[MetricHistory]:
    h = MetricHistory(redis)
    yield h
    await h.aclose()


def _exporter(redis: Any, history: MetricHistory, root: Path) -> TrackingExporter:
    return TrackingExporter(redis, history, ArtifactLayout(root), Settings(), timeout_s=5.0)


async def _job(store: StateStore, job_id: str, tenant: str, **spec: Any) -> JobRecord:
    wire = spec_with(name=None, **spec)
    wire.pop("name")
    parsed = TrainingSpec.model_validate(wire)
    job = JobRecord(job_id=job_id, tenant=tenant, spec=parsed, spec_hash=parsed.spec_hash(), state="running",
                    experiment=ExperimentOrigin(experiment_id="exp-1", experiment_name="lr-sweep", trial=3,
                                                params={"training.learningRate": 0.003}))
    assert await store.create_job(job)
    return job


async def _report(ingest: Ingest, job_id: str, attempt: int, steps: range, offset: float = 0.0) -> None:
    batch = [StepMetrics(job_id=job_id, tenant="t", attempt=attempt, rank=0, step=s, loss=5.0 - s / 1000 + offset,
                         lr=1e-3, consumed_tokens=s * 64, step_seconds=0.25, metrics=ODD)
             for s in steps]
    for i in range(0, len(batch), 250):
        await ingest.on_step_metrics_batch(batch[i:i + 250])


async def _mlflow(url: str, path: str, body: dict[str, Any] | None = None, **params: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"{url}/api/2.0/mlflow/", timeout=10) as client:
        answer = await (client.post(path, json=body) if body is not None else client.get(path, params=params))
        answer.raise_for_status()
        return dict(answer.json())


async def _history(url: str, run_id: str, key: str) -> list[tuple[int, float]]:
    got: list[tuple[int, float]] = []
    token = None
    while True:
        page = await _mlflow(url, "metrics/get-history", run_id=run_id, metric_key=key, max_results=25000,
                             **({"page_token": token} if token else {}))
        got += [(int(m["step"]), float(m["value"])) for m in page.get("metrics", [])]
        if not (token := page.get("next_page_token")):
            return sorted(got)


def _scalars(directory: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag}: a step read twice"
    return {e.step: e.value for e in events}


async def test_a_jobs_curves_reach_mlflow_and_tensorboard_through_a_restart_and_a_replay(
        redis: Any, store: StateStore, history: MetricHistory, mlflow_url: str, tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    root.mkdir()
    job = await _job(store, "job-7ac7ac7ac7ac", "team-a", **{"tracking": {"runName": "trial-3"}})
    await redis.hset(Keys.tracking_tenants, "team-a",
                     TenantTracking(mlflow_uri=mlflow_url, tensorboard=True).dumps())
    ingest = Ingest(StepTimingStore(redis), history, ProgressProjector(redis), JobSeries())
    await _report(ingest, job.job_id, 1, range(STEPS))

    exporter = _exporter(redis, history, root)
    await exporter.refresh()  # two pieces of 120 steps: a pass does not finish a long backlog
    cursors = await redis.hgetall(Keys.tracking_cursor(job.job_id))
    assert json.loads(cursors["mlflow"])["step"] == 240 and json.loads(cursors["tensorboard"])["step"] == 240
    await exporter.aclose()  # the telemetry service restarts

    exporter = _exporter(redis, history, root)
    await exporter.refresh()
    # attempt 2 resumed from step 300's checkpoint: it replays 300.. with its own values, then goes on; until it
    # has replayed them, attempt 1's 350..399 are a stale tail the exporter waits at (not sent again)
    await _report(ingest, job.job_id, 2, range(300, 350), offset=-1.0)
    await exporter.refresh()
    cursors = await redis.hgetall(Keys.tracking_cursor(job.job_id))
    assert json.loads(cursors["mlflow"])["step"] == 350 and json.loads(cursors["tensorboard"])["step"] == 350
    await _report(ingest, job.job_id, 2, range(350, STEPS + 50), offset=-1.0)
    await redis.hset(Keys.evaluations(job.job_id), "job-e0e0e0e0e0e0", EvaluationResult(
        evaluation_job_id="job-e0e0e0e0e0e0", checkpoint_id=f"{job.job_id}/checkpoint/step-000000200-a1",
        global_step=200, metrics={"loss": 2.5, "perplexity": 12.2}, finished_at=utcnow()).dumps())
    await exporter.refresh()
    await store.put_job(job.model_copy(update={"state": "succeeded",
                                               "updated_at": utcnow() - timedelta(seconds=1)}))
    await exporter.refresh()
    await exporter.refresh()  # ended and lingered: the job is forgotten
    assert await redis.zscore(Keys.tracking_jobs, job.job_id) is None
    await exporter.aclose()

    # MLflow: one run, found by the job's tag, with the spec's and the trial's params and every point
    experiment = (await _mlflow(mlflow_url, "experiments/get-by-name", experiment_name="team-a/lr-sweep"))
    runs = (await _mlflow(mlflow_url, "runs/search", {"experiment_ids": [experiment["experiment"]["experiment_id"]],
                                                      "filter": f"tags.`trainyard.jobId` = '{job.job_id}'"}))["runs"]
    assert len(runs) == 1
    run = runs[0]
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == "trial-3"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert params["training.learningRate"] == str(job.spec.training.learning_rate)
    assert params["training.globalBatchSize"] == str(job.spec.training.global_batch_size)
    assert params["dataset"] == job.spec.dataset and "modelConfig" in params
    assert params["trial.training.learningRate"] == "0.003"
    assert tags["trainyard.specHash"] == job.spec_hash and tags["trainyard.state"] == "succeeded"
    assert tags["trainyard.tenant"] == "team-a" and tags["trainyard.trial"] == "3"
    run_id = run["info"]["run_id"]
    loss = await _history(mlflow_url, run_id, "train/loss")
    assert sorted({s for s, _ in loss}) == list(range(STEPS + 50))
    sent = Counter(s for s, _ in loss)  # the exporter's restart sent no step twice; a replayed step has both values
    assert all(sent[s] == (2 if 300 <= s < STEPS else 1) for s in range(STEPS + 50)), sent
    assert dict(loss)[420] == pytest.approx(5.0 - 0.42 - 1.0, abs=1e-5)
    odd = {m["key"] for m in run["data"]["metrics"]}
    assert {"train/grad/norm", "train/__/escape", "train/a/_/b", "train/_/abs", "eval/perplexity"} <= odd
    assert await _history(mlflow_url, run_id, "eval/loss") == [(200, 2.5)]

    # TensorBoard: every point once, the replayed steps with attempt 2's values, evaluations in their own run
    board = root / "tenants" / "team-a" / "jobs" / job.job_id / "tensorboard"
    curve = _scalars(board / "train", "train/loss")
    assert sorted(curve) == list(range(STEPS + 50))
    assert curve[350] == pytest.approx(5.0 - 0.35 - 1.0, abs=1e-5) and curve[10] == pytest.approx(4.99, abs=1e-5)
    assert set(_scalars(board / "train", "train/__/escape")) == set(range(STEPS + 50))
    assert _scalars(board / "eval", "eval/perplexity") == {200: pytest.approx(12.2)}
    # names a rank chose are tags inside the files: nothing was written outside the job's tensorboard directory
    written = [p for p in root.rglob("*") if p.is_file()]
    assert written and all(board in p.parents for p in written)


async def test_a_tenant_whose_mlflow_is_down_backs_off_without_holding_up_another(
        redis: Any, store: StateStore, history: MetricHistory, mlflow_url: str, tmp_path: Path) -> None:
    up = await _job(store, "job-0b0b0b0b0b0b", "team-up")
    down = await _job(store, "job-0d0d0d0d0d0d", "team-down")
    await redis.hset(Keys.tracking_tenants, mapping={
        "team-up": TenantTracking(mlflow_uri=mlflow_url).dumps(),
        "team-down": TenantTracking(mlflow_uri=f"http://127.0.0.1:{infra.free_port()}").dumps()})
    ingest = Ingest(StepTimingStore(redis), history, ProgressProjector(redis), JobSeries())
    for job in (up, down):
        await _report(ingest, job.job_id, 1, range(50))
    now = [1000.0]
    exporter = TrackingExporter(redis, history, ArtifactLayout(tmp_path), Settings(), clock=lambda: now[0],
                                timeout_s=2.0)
    async with exporter:
        await exporter.refresh()
        assert json.loads((await redis.hget(Keys.tracking_cursor(up.job_id), "mlflow")) or "{}")["step"] == 50
        assert await redis.hget(Keys.tracking_cursor(down.job_id), "mlflow") is None
        assert not exporter._due((down.job_id, "mlflow"))  # backing off (RetryPolicy: 5 s, then 10 s …)
        now[0] += 6.0
        assert exporter._due((down.job_id, "mlflow"))


async def test_tensorboard_files_go_to_an_object_store_root_whole(
        redis: Any, store: StateStore, history: MetricHistory, tmp_path: Path) -> None:
    from tests.objectstore import moto_s3
    from trainyard_contract.storage import object_filesystem

    job = await _job(store, "job-53535353f00d", "team-s3")
    await redis.hset(Keys.tracking_tenants, "team-s3", TenantTracking(tensorboard=True).dumps())
    ingest = Ingest(StepTimingStore(redis), history, ProgressProjector(redis), JobSeries())
    await _report(ingest, job.job_id, 1, range(200))
    with moto_s3() as root:
        async with TrackingExporter(redis, history, ArtifactLayout(root), Settings()) as exporter:
            await exporter.refresh()
            await exporter.refresh()
        board = ArtifactLayout(root).job_dir("team-s3", job.job_id) / "tensorboard" / "train"
        fs = object_filesystem(root)
        local = tmp_path / "train"
        local.mkdir()
        for key in fs.find(str(board).removeprefix("s3://")):
            (local / Path(key).name).write_bytes(fs.cat_file(key))
    assert len(list(local.iterdir())) == 2  # 200 steps in pieces of 120
    assert sorted(_scalars(local, "train/loss")) == list(range(200))
