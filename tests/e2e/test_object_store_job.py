"""A real job on a stack whose artifact root is an object store (moto's S3 server, reached over HTTP by every
service and rank through the AWS_* configuration): tinycorpus@v1 is uploaded under the root, the ranks read
its shards through the node's shard cache, write their checkpoints as S3 objects, and a rank killed mid-run
resumes from the S3 checkpoint; each node's own files (rank logs, spools, the cache) stay on the node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.objectstore import moto_s3
from trainyard_cli import infra
from trainyard_cli.devstack import DATASET, prepare_and_publish
from trainyard_cli.stack import LocalStack, StackSettings
from trainyard_contract.storage import ArtifactLayout, ObjectPath, object_filesystem, read_bytes, sha256_of, stat_size

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    with moto_s3() as root:
        yield root


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, store: str) -> Iterator[LocalStack]:
    settings = StackSettings(
        state_dir=tmp_path_factory.mktemp("s3-stack") / ".trainyard",
        kafka_port=infra.free_port(), redis_port=infra.free_port(), api_port=infra.free_port(),
        nodes=1, devices_per_node=2, ready_timeout_s=120, drain_timeout_s=0, artifact_store=store,
    )
    port = infra.free_ports(101)  # rendezvous ports of its own: another stack on this host uses the default range
    stack = LocalStack(settings, extra_env={"TRAINYARD_RENDEZVOUS_PORT_MIN": str(port),
                                            "TRAINYARD_RENDEZVOUS_PORT_MAX": str(port + 100)})
    try:
        stack.up()
        prepare_and_publish(stack)  # `trainyard dev data`: built in the stack's directory, uploaded, verified
        yield stack
    finally:
        stack.down()


def wait_for(client: httpx.Client, job_id: str, what: str, done: Callable[[dict[str, Any]], Any],
             timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        if (found := done(job)) is not None and found is not False:
            return found
        if job["state"] in ("failed", "cancelled"):
            break
        time.sleep(0.3)
    raise AssertionError(f"job {job_id}: no {what} (state {job.get('state')}): {json.dumps(job)[:3000]}")


def rank_pids(stack: LocalStack, job_id: str, attempt: int) -> dict[int, int] | None:
    import redis

    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        entries = [json.loads(raw) for raw in client.hgetall("ty:agent:node-0:ranks").values()]
    finally:
        client.close()
    found = {int(e["rank"]): int(e["pid"]) for e in entries if e["jobId"] == job_id and int(e["attempt"]) == attempt}
    return found or None


def test_a_job_checkpoints_to_s3_and_a_killed_rank_resumes_from_there(stack: LocalStack, store: str) -> None:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["name"] = "object-store"
    spec["training"]["maxSteps"] = 60
    spec["checkpointPolicy"] = {"everySteps": 10, "keepLast": 2}
    token = stack.token_file.read_text().strip()
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as client:
        job_id = client.post("/v1/training-jobs", json=spec).raise_for_status().json()["jobId"]

        # once a checkpoint is READY in the store (and well before the end), kill -9 one rank of the running attempt
        attempt = wait_for(client, job_id, "READY checkpoint while running", lambda j: j["state"] == "running" and any(
            c["state"] == "READY" and c["globalStep"] < 40 for c in _checkpoints(client, job_id))
            and j["attempts"][-1]["attempt"])
        pids = wait_for(client, job_id, "rank pids", lambda _: rank_pids(stack, job_id, attempt))
        os.kill(pids[max(pids)], signal.SIGKILL)

        job = wait_for(client, job_id, "end", lambda j: j if j["state"] in ("succeeded",) else None, timeout_s=180)
        # retention (keepLast 2) deletes older checkpoints after the last one is READY: read them once it has
        checkpoints = wait_for(client, job_id, "retention to keep the last 2", lambda _: (lambda cs: cs if len(
            [c for c in cs if c["state"] == "READY"]) <= 2 else None)(_checkpoints(client, job_id)))
        # every rank's log, as the API serves it from the segments the node agent shipped to the store
        served = {(a["attempt"], r): client.get(f"/v1/training-jobs/{job_id}/logs", params={
            "attempt": a["attempt"], "rank": r, "tail": 100_000}).raise_for_status().content
            for a in job["attempts"] for r in (0, 1)}

    assert job["progress"]["globalStep"] == 60 and job["progress"]["consumedTokens"] == 60 * 32 * 64
    killed, resumed = job["attempts"][attempt - 1], job["attempts"][attempt]
    assert killed["state"] == "failed" and "killed" in (killed.get("failureReason") or ""), killed
    start = resumed.get("startCheckpoint") or {}
    assert start.get("globalStep", 0) >= 10 and start["manifestUri"].startswith(f"{store}/"), resumed

    # -- the READY checkpoints are S3 objects: the manifest (the commit point) and every shard it lists, verified
    ready = [c for c in checkpoints if c["state"] == "READY"]
    assert ready and max(c["globalStep"] for c in ready) == 60
    prefix = f"{store}/tenants/dev/jobs/{job_id}/checkpoints/"
    for checkpoint in ready:
        assert checkpoint["manifestUri"].startswith(prefix), checkpoint
        manifest = json.loads(read_bytes(ObjectPath.parse(checkpoint["manifestUri"])))
        assert sorted(s["rank"] for s in manifest["shards"]) == [0, 1]
        for shard in manifest["shards"] + manifest.get("extraFiles", []):
            location = ObjectPath.parse(shard["uri"])
            assert shard["uri"].startswith(prefix)
            assert stat_size(location) == shard["sizeBytes"] and sha256_of(location) == shard["sha256"]
    fs = object_filesystem(store)
    listed = fs.find(ObjectPath.parse(prefix).path)
    assert any(key.endswith("/manifest.json") for key in listed), listed

    # -- the attempts' own files stayed on the node; of them the store holds only the shipped rank logs, and the
    # API serves each rank's whole log from there (the killed rank's too: what it wrote before it died)
    local = ArtifactLayout(stack.s.artifact_root)
    resumed_log = local.rank_log("dev", job_id, attempt + 1, 0).read_text()
    assert f"resumed from {store}/" in resumed_log, resumed_log[-3000:]
    for (n, r), body in served.items():
        assert body and body == local.rank_log("dev", job_id, n, r).read_bytes(), (n, r, body[-2000:])
    attempts = fs.find(ObjectPath.parse(f"{store}/tenants/dev/jobs/{job_id}/attempts").path)
    assert attempts and all(re.search(r"/attempts/\d+/logs/rank-[01]/\d{16}\.log$", key) for key in attempts), \
        attempts

    # -- the dataset's shards were read through the node's shard cache: verified copies named by their sha256
    dataset = json.loads(read_bytes(ArtifactLayout(store).dataset_dir(*DATASET) / "manifest.json"))
    cache = stack.s.artifact_root / "nodes" / "node-0" / "shard-cache"
    cached = {p.stem for p in cache.glob("*.bin")}
    assert cached and cached <= {s["sha256"] for s in dataset["shards"]}, (cached, cache)


def _checkpoints(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    body = client.get(f"/v1/training-jobs/{job_id}/checkpoints").raise_for_status().json()
    return body.get("checkpoints", body) if isinstance(body, dict) else body


def test_a_job_starts_from_a_hugging_face_model_imported_into_the_store(stack: LocalStack, store: str,
                                                                       tmp_path: Path) -> None:
    """`trainyard models import` uploads a transformers Llama into the store; a job with initFrom.huggingFace is
    accepted (the API reads the prefix), its ranks fetch the model into the node once and start from it."""
    from tests.support.hfmodels import save_transformers_model
    from trainyard_cli.models import import_model
    from trainyard_contract.catalog import MODEL_CATALOG

    save_transformers_model(tmp_path / "hf", MODEL_CATALOG["llama-tiny@v1"], seed=7)
    imported = import_model(tmp_path / "hf", ArtifactLayout(store), "dev", "llama")
    assert str(imported.directory) == f"{store}/tenants/dev/models/llama"
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec |= {"name": "from-s3-hugging-face", "modelConfig": "llama-tiny@v1",
             "initFrom": {"huggingFace": "models/llama"}}
    spec["training"] |= {"maxSteps": 2, "learningRate": 1e-9, "lrSchedule": {"name": "constant"}, "sequenceLength": 32}
    spec["checkpointPolicy"] = {"everySteps": 1, "keepLast": 1}
    token = stack.token_file.read_text().strip()
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as client:
        resp = client.post("/v1/training-jobs", json=spec)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["jobId"]
        job = wait_for(client, job_id, "end", lambda j: j if j["state"] == "succeeded" else None, timeout_s=180)
        log = client.get(f"/v1/training-jobs/{job_id}/logs", params={"rank": 1, "tail": 100_000}).raise_for_status()
    assert job["huggingFaceStart"]["uri"] == f"{store}/tenants/dev/models/llama", job.get("huggingFaceStart")
    assert "initialised from the Hugging Face directory models/llama" in log.text, log.text[-3000:]
    copies = list((stack.s.artifact_root / "hf-cache").glob("*/.complete"))
    assert len(copies) == 1, copies  # one download for the node's two ranks
