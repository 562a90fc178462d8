"""Tracking targets are egress from the control plane, so only a platform-admin names one: a job's spec cannot carry
a URI, a tenant's admin cannot change its tenant's targets (only read them), a URI at a link-local or cloud-metadata
address, with credentials, or of another scheme is refused (422 naming ``mlflowUri``). What a rank controls — its
metric names (any string: path-like, huge) and the job's directory — cannot move the exporter's TensorBoard files out
of the job's ``tensorboard/`` directory, nor give MLflow a key it refuses (which would fail a whole batch)."""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import TOKEN_A, TOKEN_ADMIN, client_for, seed, spec_with
from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_contract.events import StepMetrics
from trainyard_contract.records import JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_contract.tracking import TenantTracking
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import Keys, StateStore
from trainyard_telemetry.metrics_history import MetricHistory
from trainyard_telemetry.tracking import TrackingExporter
from trainyard_telemetry.tracking_plan import metric_key

pytestmark = [pytest.mark.integration, pytest.mark.security]

TENANT_ADMIN_A = "token-tenant-admin-a"
REFUSED_URIS = [
    "http://169.254.169.254/latest/meta-data", "http://[fe80::1]:5000", "http://metadata.google.internal",
    "http://[::ffff:169.254.169.254]/", "http://user:secret@mlflow:5000", "file:///etc/passwd",
    "gopher://127.0.0.1:6379/_FLUSHALL", "redis://127.0.0.1:6379", "http://mlflow:5000/?x=1", "http://",
    "http://mlflow:5000/\nHost: evil",
]


@pytest.fixture
async def api(env: dict[str, Any], redis: Any) -> AsyncIterator[httpx.ASGITransport]:
    store = StateStore(redis)
    await seed(store, admin=True)
    await store.add_token(TENANT_ADMIN_A, "tenant-a", "ann", role="tenant-admin")
    app = create_app(ApiContext(ApiSettings(**env), store, Outbox(redis, "api")))
    yield httpx.ASGITransport(app=app)


async def test_a_job_spec_cannot_name_a_tracking_uri(api: httpx.ASGITransport) -> None:
    async with client_for("http://api", TOKEN_A, transport=api) as c:
        for tracking in ({"mlflowUri": "http://127.0.0.1:6379"}, {"uri": "http://169.254.169.254"},
                         {"mlflow": "http://127.0.0.1:6379"}, {"experimentName": "../../other-tenant/x\n"}):
            refused = await c.post("/v1/training-jobs", json=spec_with(tracking=tracking))
            assert refused.status_code == 422, refused.text
            assert "tracking." in refused.text, refused.text
        accepted = await c.post("/v1/training-jobs", json=spec_with(tracking={"mlflow": False, "runName": "r1"}))
        assert accepted.status_code == 202, accepted.text


async def test_only_a_platform_admin_sets_a_tenants_tracking_targets(api: httpx.ASGITransport, redis: Any) -> None:
    wanted = {"mlflowUri": "http://mlflow.research.internal:5000", "tensorboard": True}
    for token in (TOKEN_A, TENANT_ADMIN_A):
        async with client_for("http://api", token, transport=api) as c:
            refused = await c.put("/v1/admin/tenants/tenant-a/tracking", json=wanted)
            assert refused.status_code == 403, refused.text
    assert await redis.hget(Keys.tracking_tenants, "tenant-a") is None
    async with client_for("http://api", TOKEN_ADMIN, transport=api) as admin:
        for uri in REFUSED_URIS:
            refused = await admin.put("/v1/admin/tenants/tenant-a/tracking", json={"mlflowUri": uri})
            assert refused.status_code == 422 and "mlflowUri" in refused.text, (uri, refused.text)
        assert await redis.hget(Keys.tracking_tenants, "tenant-a") is None
        stored = await admin.put("/v1/admin/tenants/tenant-a/tracking", json=wanted)
        assert stored.status_code == 200, stored.text
        audit = await admin.get("/v1/admin/audit", params={"tenant": "tenant-a"})
        assert any(e["action"] == "tenant.tracking" and e["outcome"] == "ok" for e in audit.json()["entries"])
    async with client_for("http://api", TENANT_ADMIN_A, transport=api) as c:
        read = await c.get("/v1/admin/tenants/tenant-a/tracking")
        assert read.status_code == 200 and read.json()["mlflowUri"] == wanted["mlflowUri"], read.text
        assert (await c.get("/v1/admin/tenants/tenant-b/tracking")).status_code == 403
    # a URI stored around the API (an operator's redis-cli) that no longer passes is not used
    await redis.hset(Keys.tracking_tenants, "tenant-b", '{"mlflowUri": "http://169.254.169.254/", "tensorboard": true}')
    exporter = TrackingExporter(redis, MetricHistory(redis), ArtifactLayout(Path("/nonexistent")), _Settings())
    async with exporter:
        assert set(await exporter.tenants()) == {"tenant-a"}


_MLFLOW_KEY = re.compile(r"^[/\w.\- :]*$")  # MLflow 3's own check (mlflow.utils.validation), with its path rule


def _mlflow_accepts(key: str) -> bool:
    norm = posixpath.normpath(key)
    return bool(_MLFLOW_KEY.match(key)) and len(key) <= 250 and norm == key and not norm.startswith(("..", "/"))


@pytest.mark.parametrize("name", [
    "../../../../etc/passwd", "/abs", "a//b", ".", "..", "x/", "a/./b", "a/../b", "x" * 100_000, "naïve", "a\nb",
    "a\x00b", "tab\tname", "%2e%2e/%2e%2e", "C:\\windows", "", " ", "ok-name", "grad/norm", "a:b",
])
def test_a_metric_name_a_rank_chose_is_a_key_mlflow_takes_or_nothing(name: str) -> None:
    for section in ("train", "eval"):
        key = metric_key(section, name)
        assert key is None or (_mlflow_accepts(key) and key.startswith(f"{section}/")), (name, key)


@dataclass
class _Settings:
    tracking_span_steps: int = 1000
    tracking_spans_per_pass: int = 4
    tracking_concurrency: int = 2
    tracking_linger_s: float = 3600.0


async def _tensorboard_job(redis: Any, root: Path, names: dict[str, float]) -> tuple[JobRecord, TrackingExporter]:
    store = StateStore(redis)
    spec = TrainingSpec.model_validate(spec_with())
    job = JobRecord(job_id="job-5ec5ec5ec5ec", tenant="tenant-a", spec=spec, spec_hash=spec.spec_hash(),
                    state="running")
    await store.create_job(job)
    await redis.hset(Keys.tracking_tenants, "tenant-a", TenantTracking(tensorboard=True).dumps())
    history = MetricHistory(redis)
    for s in range(5):
        await history.on_step_metrics(StepMetrics(job_id=job.job_id, tenant="tenant-a", attempt=0, rank=0, step=s,
                                                  loss=1.0, consumed_tokens=s, metrics=names))
    await redis.zadd(Keys.tracking_jobs, {job.job_id: 1})
    return job, TrackingExporter(redis, history, ArtifactLayout(root), _Settings())


async def test_metric_names_a_rank_chose_stay_tags_inside_the_jobs_tensorboard_files(redis: Any,
                                                                                      tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    root.mkdir()
    names = {"../../../../../../tmp/owned": 1.0, "/etc/cron.d/x": 2.0, "x" * 5000: 3.0, "a\nb": 4.0, "ok": 5.0}
    job, exporter = await _tensorboard_job(redis, root, names)
    async with exporter:
        await exporter.refresh()
    board = ArtifactLayout(root).job_dir("tenant-a", job.job_id) / "tensorboard"
    written = [p for p in root.rglob("*") if p.is_file()]
    assert written and all(board in p.parents for p in written), written
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(board / "train"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/ok", "train/loss", "train/__/__/__/__/__/__/tmp/owned", "train/_/etc/cron.d/x"} <= tags
    assert not any(len(t) > 250 or "\n" in t for t in tags)


async def test_a_link_planted_in_the_jobs_directory_is_not_written_through(redis: Any, tmp_path: Path) -> None:
    root, outside = tmp_path / "artifacts", tmp_path / "outside"
    outside.mkdir()
    job, exporter = await _tensorboard_job(redis, root, {"ok": 1.0})
    job_dir = ArtifactLayout(root).job_dir("tenant-a", job.job_id)
    job_dir.mkdir(parents=True)
    os.symlink(outside, job_dir / "tensorboard")  # a rank's doing: its job's directory is writable to it
    async with exporter:
        await exporter.refresh()
        assert not exporter._due((job.job_id, "tensorboard"))  # refused, backing off
    assert list(outside.iterdir()) == []
    assert await redis.hget(Keys.tracking_cursor(job.job_id), "tensorboard") is None
