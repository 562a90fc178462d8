"""The `trainyard` CLI against a real API (uvicorn + runtime on the real broker and Redis)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from trainyard_api import ApiServer, ApiSettings
from trainyard_telemetry import TelemetryService, TelemetrySettings
from trainyard_cli.client import ApiClient
from trainyard_cli.follow import EXIT_SUCCEEDED, follow_job
from trainyard_cli.main import app
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_contract.records import DatasetRecord

REPO = Path(__file__).resolve().parents[2]
TOKEN = "cli-test-token"


@pytest.fixture
async def server(env: dict) -> AsyncIterator[ApiServer]:
    # the telemetry service beside the API: it keeps the progress that `trainyard follow` shows
    async with TelemetryService(TelemetrySettings(**env)), ApiServer(ApiSettings(**env, api_port=0)) as api:
        await api.runtime.store.add_token(TOKEN, "tenant-cli", "cli")
        await api.runtime.store.put_dataset(DatasetRecord(
            name="tinycorpus", version="v1", manifest_uri="file:///m.json", sha256="0" * 64))
        yield api


async def cli(server: ApiServer, *args: str) -> tuple[int, str]:
    """Run the CLI in a thread (the API serves on this event loop meanwhile)."""
    result = await asyncio.to_thread(
        CliRunner().invoke, app, ["--api-url", server.url, "--token", TOKEN, *args])
    return result.exit_code, result.output


async def test_submit_list_get_cancel_and_a_rejected_spec(server: ApiServer, tmp_path: Path) -> None:
    code, out = await cli(server, "submit", str(REPO / "examples" / "tiny.yaml"))
    assert code == 0, out
    job_id = out.split("submitted ", 1)[1].split()[0]
    assert job_id.startswith("job-")

    code, out = await cli(server, "jobs", "list")
    assert code == 0 and job_id in out and "queued" in out

    code, out = await cli(server, "jobs", "get", job_id, "--json")
    assert code == 0 and json.loads(out)["jobId"] == job_id

    code, out = await cli(server, "jobs", "cancel", job_id)
    assert code == 0 and "cancel requested" in out

    code, out = await cli(server, "jobs", "get", "job-000000000000")
    assert code == 1 and "no job" in out

    spec = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    spec["training"]["globalBatchSize"] = 33
    spec["dataset"] = "missing@v1"
    (tmp_path / "bad.json").write_text(json.dumps(spec))
    code, out = await cli(server, "submit", str(tmp_path / "bad.json"))
    assert code == 1
    assert "training.globalBatchSize:" in out and "multiple" in out

    code, out = await cli(server, "--token", "wrong", "jobs", "list")
    assert code == 1 and "refused the token" in out


async def test_follow_job_shows_progress_until_the_job_succeeds(server: ApiServer, env: dict) -> None:
    store = server.runtime.store
    with ApiClient(server.url, TOKEN) as api:
        job_id = (await asyncio.to_thread(api.submit, yaml.safe_load((REPO / "examples/tiny.yaml").read_text()))).job_id
        buffer = io.StringIO()
        following = asyncio.create_task(asyncio.to_thread(
            follow_job, api, job_id, console=Console(file=buffer, width=200), poll_s=0.2, timeout_s=60))

        # play the scheduler and the ranks: running, metrics, then succeeded
        job = await store.get_job(job_id)
        assert job is not None
        await store.put_job(job.model_copy(update={"state": "running"}))
        async with Bus(env["kafka_bootstrap"], service_name="cli-test", topic_namespace=env["topic_namespace"]) as bus:
            await bus.publish(ev.StepMetrics(job_id=job_id, attempt=1, rank=0, step=40, max_steps=40, loss=1.25,
                                             consumed_tokens=81920, tokens_per_second=4000.0))
        for _ in range(150):
            progress = await store.get_progress(job_id)
            if progress and progress.global_step == 40:
                break
            await asyncio.sleep(0.2)
        await store.put_job(job.model_copy(update={"state": "succeeded"}))
        code = await asyncio.wait_for(following, 90)

    text = buffer.getvalue()
    assert code == EXIT_SUCCEEDED, text
    assert f"{job_id} succeeded at step 40" in text and "loss 1.2500" in text


async def test_triggers_create_list_show_delete_and_a_rejected_template(server: ApiServer, tmp_path: Path) -> None:
    code, out = await cli(server, "triggers", "create", "--dataset", "tiny*", "--source", "platform",
                          "--template", str(REPO / "examples" / "tiny.yaml"))
    assert code == 0, out
    assert "left out" in out  # the example names a dataset: each new version fills it in
    trigger_id = out.split("created trigger ", 1)[1].split()[0]
    assert trigger_id.startswith("trg-") and "(tiny)" in out

    code, out = await cli(server, "triggers", "list")
    assert code == 0 and trigger_id in out and "tiny*" in out and "platform" in out

    code, out = await cli(server, "triggers", "show", trigger_id)
    assert code == 0 and "gpt-tiny@v1" in out and "no jobs started yet" in out
    code, out = await cli(server, "triggers", "show", trigger_id, "--json")
    assert code == 0 and json.loads(out)["triggerId"] == trigger_id

    spec = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    spec["resources"]["gpus"] = 2
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    code, out = await cli(server, "triggers", "create", "--dataset", "wiki-*", "--template", str(tmp_path / "bad.yaml"))
    assert code == 1 and "rejected the trigger" in out and "template.resources.gpus:" in out

    code, out = await cli(server, "triggers", "delete", trigger_id)
    assert code == 0 and f"deleted trigger {trigger_id}" in out
    code, out = await cli(server, "triggers", "show", trigger_id)
    assert code == 1 and "no trigger" in out


async def test_what_the_api_stores_and_says_prints_as_text_and_a_broken_spec_names_its_file(
    server: ApiServer, tmp_path: Path
) -> None:
    spec = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    spec["name"] = "[b]x[/b]"
    (tmp_path / "named.yaml").write_text(yaml.safe_dump(spec))
    code, out = await cli(server, "submit", str(tmp_path / "named.yaml"))
    assert code == 0, out
    job_id = out.split("submitted ", 1)[1].split()[0]

    code, out = await cli(server, "jobs", "list")
    assert code == 0 and job_id in out and "[b]x[/b]" in out
    code, out = await cli(server, "jobs", "get", job_id)
    assert code == 0 and "[b]x[/b]" in out

    spec["resources"]["gpus"] = [1, 2]  # refused by the API, the field named
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    code, out = await cli(server, "submit", str(tmp_path / "bad.yaml"))
    assert code == 1 and "resources.gpus" in out

    (tmp_path / "broken.yaml").write_text("name: x\n  training: [1, 2]\n")
    code, out = await cli(server, "submit", str(tmp_path / "broken.yaml"))
    assert code == 2 and f"{tmp_path / 'broken.yaml'}, line 2, column 11: " in " ".join(out.split())
