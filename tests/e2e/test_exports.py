"""Exports on the whole stack, proved with the real client: one job trains gpt-tiny on tinycorpus with
`export: {format: hf}` in its spec (checkpoints at steps 10, 20, 30, 40; retention keeps the last three),
so its final model is exported when it succeeds. Then the API exports step 30, `trainyard export --out`
downloads it, a corrupted shard of step 20 fails its export, and what may not be exported is refused.

Each export is loaded with transformers' AutoModelForCausalLM / AutoTokenizer from the directory, offline,
and its logits on fixed inputs equal trainyard's own model loaded from the same checkpoint within 1e-5.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from trainyard_cli import infra
from trainyard_cli.devstack import prepare_and_publish
from trainyard_cli.stack import LocalStack, StackSettings
from trainyard_contract.storage import ArtifactLayout, uri_to_path
from trainyard_runtime.store import StateStore, connect_redis
from tests.support.cli import trainyard
from tests.support.downstream import RegistryFollower

REPO = Path(__file__).resolve().parents[2]
OTHER_TOKEN = "token-of-another-tenant"
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings = StackSettings(
        state_dir=tmp_path_factory.mktemp("exports") / ".trainyard",
        kafka_port=infra.free_port(), redis_port=infra.free_port(), api_port=infra.free_port(),
        nodes=1, devices_per_node=4, ready_timeout_s=180,
    )
    # retention and the retire sweep soon after a checkpoint, so step 10 is retired by the time it is asked for
    stack = LocalStack(settings, extra_env={"TRAINYARD_GC_INTERVAL_S": "2", "TRAINYARD_RETIRE_INTERVAL_S": "1",
                                            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    try:
        stack.up()
        prepare_and_publish(stack)
        asyncio.run(_add_token(stack.redis_url, OTHER_TOKEN, "other-tenant"))
        yield stack
    finally:
        stack.down()


async def _add_token(url: str, token: str, tenant: str) -> None:
    redis = connect_redis(url)
    try:
        await StateStore(redis).add_token(token, tenant, "mallory")
    finally:
        await redis.aclose()


@pytest.fixture(scope="module")
def feed(stack: LocalStack) -> Iterator[RegistryFollower]:
    with RegistryFollower(stack.kafka_bootstrap, f"{stack.s.topic_namespace}trainyard.registry",
                          group="downstream-exports") as follower:
        yield follower


def client_for(stack: LocalStack, token: str | None = None) -> httpx.Client:
    token = token or stack.token_file.read_text().strip()
    return httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.fixture(scope="module")
def job(stack: LocalStack, feed: RegistryFollower) -> dict[str, Any]:
    """The trained job: its id and its artifacts by (type, step)."""
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["name"] = "exported"
    spec["checkpointPolicy"] = {"everySteps": 10, "keepLast": 3}
    spec["export"] = {"format": "hf"}
    with client_for(stack) as client:
        job_id = client.post("/v1/training-jobs", json=spec).raise_for_status().json()["jobId"]
        deadline = time.monotonic() + 600
        while (state := client.get(f"/v1/training-jobs/{job_id}").json()["state"]) not in (
                "succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"{job_id} still {state}"
            time.sleep(1)
        assert state == "succeeded"
        feed.wait(lambda: feed.events(eventType="ArtifactRetired", jobId=job_id), timeout_s=120,
                  what="step 10's retirement (keepLast 3)")
        # the model artifact comes from JobStateChanged (the jobs topic), the retirement from the checkpoints
        # topic: neither waits for the other
        deadline = time.monotonic() + 120
        while True:
            body = client.get("/v1/registry/artifacts", params={"jobId": job_id}).raise_for_status().json()
            artifacts = {(a["type"], a["globalStep"]): a for a in body["artifacts"]}
            if any(kind == "model" for kind, _ in artifacts) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    return {"id": job_id, "artifacts": artifacts}


def wait_export(client: httpx.Client, export_id: str, timeout_s: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        view = client.get(f"/v1/registry/artifacts/{export_id}").raise_for_status().json()
        if view["state"] != "requested":
            return view
        assert time.monotonic() < deadline, f"export {export_id} still requested after {timeout_s}s"
        time.sleep(1)


def assert_loads_like_trainyard(directory: Path, manifest_uri: str) -> None:
    """transformers loads the directory (offline) and its logits are trainyard's own model's, within 1e-5."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainyard_contract.catalog import resolve_model
    from trainyard_trainer.hf import checkpoint_model_state
    from trainyard_trainer.model import build_model

    config = resolve_model("gpt-tiny@v1")
    _, state = checkpoint_model_state(uri_to_path(manifest_uri))
    ours = build_model(config, seed=0, device=torch.device("cpu"))
    ours.load_state_dict(state)
    ours.eval()
    theirs = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, torch_dtype=torch.float32)
    theirs.eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    encoded = tokenizer("the quick brown fox")["input_ids"]
    assert encoded and tokenizer.decode(encoded).strip() == "the quick brown fox"
    ids = torch.tensor([[(i * 37 + 11) % config.vocab_size for i in range(32)], list(range(7, 7 + 32))])
    with torch.no_grad():
        expected, _ = ours(ids)
        got = theirs(ids).logits
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    generated = theirs.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 12)


def test_a_spec_with_export_is_exported_when_the_job_succeeds(stack: LocalStack, feed: RegistryFollower,
                                                              job: dict[str, Any]) -> None:
    model = job["artifacts"][("model", 40)]
    step = model["artifactId"].rsplit("/", 1)[1]
    export_id = f"{job['id']}/export/{step}/hf"
    (announced,) = feed.wait(lambda: feed.events(eventType="ArtifactRegistered", artifactId=export_id),
                             timeout_s=300, what="the spec's export")
    with client_for(stack) as client:
        view = wait_export(client, export_id)
        listed = client.get("/v1/registry/artifacts", params={"jobId": job["id"]}).raise_for_status().json()
    assert view["state"] == "ready" and view["export"]["requestedBy"] == "spec", view
    artifact = view["artifact"]
    assert (announced["kind"], announced["uri"], announced["hash"]) == ("export", artifact["uri"], artifact["hash"])
    assert announced["lineage"]["parentCheckpoint"] == model["uri"]  # converted from the final checkpoint
    assert announced["lineage"]["specHash"] == model["lineage"]["specHash"]
    assert announced["lineage"]["datasetSha256"] == model["lineage"]["datasetSha256"]
    assert export_id in {a["artifactId"] for a in listed["artifacts"] if a["type"] == "export"}
    directory = uri_to_path(artifact["uri"])
    assert directory == ArtifactLayout(stack.s.artifact_root).export_dir("dev", job["id"], step, "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "trainyard-export.json"} <= {f["name"] for f in view["files"]}
    assert_loads_like_trainyard(directory, model["uri"])


def test_the_api_exports_a_checkpoint_and_the_cli_downloads_a_directory_that_loads(
        stack: LocalStack, job: dict[str, Any], tmp_path: Path) -> None:
    checkpoint = job["artifacts"][("checkpoint", 30)]
    with client_for(stack) as client:
        first = client.post(f"/v1/registry/artifacts/{checkpoint['artifactId']}/export", json={"format": "hf"})
        assert first.status_code == 202, first.text
        export_id = first.json()["artifactId"]
        assert first.headers["location"].endswith(f"/v1/registry/artifacts/{export_id}")
        view = wait_export(client, export_id)
        assert view["state"] == "ready", view
        again = client.post(f"/v1/registry/artifacts/{checkpoint['artifactId']}/export", json={"format": "hf"})
        assert again.status_code == 200 and again.json()["artifactId"] == export_id  # the same export
    with client_for(stack, stack.admin_token_file.read_text().strip()) as admin:
        page = admin.get("/v1/admin/audit", params={"tenant": "dev", "limit": 200}).raise_for_status().json()
    audited = [e for e in page["entries"] if e["action"] == "artifact.export"]
    assert [(e["target"], e["outcome"]) for e in audited[:2]] == [(f"artifact/{checkpoint['artifactId']}", "ok")] * 2
    assert audited[0]["detail"] == f"export {export_id} (ready already)"  # newest first

    out = tmp_path / "step30"
    done = trainyard(stack, "export", job["id"], "--step", "30", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f'from_pretrained("{out}")' in done.stdout
    listing = json.loads((out / "trainyard-export.json").read_text())
    assert listing and (out / "model.safetensors").is_file()
    assert_loads_like_trainyard(out, checkpoint["uri"])


def test_a_corrupted_shard_fails_its_export_and_leaves_no_directory(
        stack: LocalStack, feed: RegistryFollower, job: dict[str, Any]) -> None:
    checkpoint = job["artifacts"][("checkpoint", 20)]
    shards = sorted(p for p in uri_to_path(checkpoint["uri"]).parent.iterdir() if p.suffix == ".distcp")
    data = bytearray(shards[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    shards[-1].write_bytes(bytes(data))
    with client_for(stack) as client:
        asked = client.post(f"/v1/registry/artifacts/{checkpoint['artifactId']}/export", json={"format": "hf"})
        assert asked.status_code == 202, asked.text
        export_id = asked.json()["artifactId"]
        view = wait_export(client, export_id)
    assert view["state"] == "failed" and view["artifact"] is None, view
    assert shards[-1].name in view["export"]["reason"] + " ".join(view["export"]["problems"]), view
    (event,) = feed.wait(lambda: feed.events(eventType="ExportFailed", exportId=export_id), timeout_s=60,
                         what="ExportFailed")
    assert event["reason"] == view["export"]["reason"] and event["checkpointArtifactId"] == checkpoint["artifactId"]
    step = checkpoint["artifactId"].rsplit("/", 1)[1]
    exports = ArtifactLayout(stack.s.artifact_root).export_dir("dev", job["id"], step, "hf").parent
    assert not exports.exists() or list(exports.iterdir()) == []  # nothing half-written, no temporary sibling


def test_what_may_not_be_exported_is_refused_with_the_reason(stack: LocalStack, job: dict[str, Any]) -> None:
    checkpoint = job["artifacts"][("checkpoint", 30)]["artifactId"]
    retired = job["artifacts"][("checkpoint", 10)]["artifactId"]
    with client_for(stack) as client:
        unknown = client.post(f"/v1/registry/artifacts/{checkpoint}/export", json={"format": "onnx"})
        assert unknown.status_code == 422 and unknown.json()["detail"][0]["field"] == "format", unknown.text
        gone = client.post(f"/v1/registry/artifacts/{retired}/export", json={"format": "hf"})
        assert gone.status_code == 409 and gone.json()["detail"].startswith("retired: "), gone.text
        assert "deleted by retention" in gone.json()["detail"] and "--step N" in gone.json()["detail"]
    with client_for(stack, OTHER_TOKEN) as other:
        assert other.post(f"/v1/registry/artifacts/{checkpoint}/export", json={"format": "hf"}).status_code == 404
        assert other.get(f"/v1/registry/artifacts/{checkpoint}").status_code == 404
    refused = trainyard(stack, "export", job["id"], "--step", "10")
    assert refused.returncode == 1 and "READY steps: 20, 30, 40" in refused.stderr, refused.stderr

    # each POST is in the audit log with its outcome, like the other control actions
    with client_for(stack, stack.admin_token_file.read_text().strip()) as admin:
        page = admin.get("/v1/admin/audit", params={"tenant": "dev", "limit": 200}).raise_for_status().json()
    audited = {(e["target"], e["outcome"]) for e in page["entries"] if e["action"] == "artifact.export"}
    assert {(f"artifact/{checkpoint}", "invalid"), (f"artifact/{retired}", "conflict")} <= audited, audited
