"""The whole pipe on real components: HTTP → Kafka → scheduler (Redis leases) → node agents →
real torch.distributed ranks training gpt-tiny on tinycorpus → shards → verified manifest →
READY → registry artifact with lineage; one trace; malformed events dead-lettered on the way.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from trainyard_cli import infra
from trainyard_cli.devstack import prepare_and_publish
from trainyard_cli.stack import LocalStack, StackSettings
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_contract.storage import ArtifactLayout, sha256_file, uri_to_path
from tests.support import corpora
from tests.support.cli import trainyard
from tests.support.downstream import RegistryFollower
from tests.support.otlp import OtlpSink
from tests.support.waiting import wait_for_state

REPO = Path(__file__).resolve().parents[2]
SERVICES_IN_TRACE = {
    "trainyard-api", "trainyard-scheduler", "trainyard-node-agent", "trainyard-trainer",
    "trainyard-checkpoint-coordinator", "trainyard-registry",
}
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with OtlpSink() as s:
        yield s


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, sink: OtlpSink) -> Iterator[LocalStack]:
    settings = StackSettings(
        state_dir=tmp_path_factory.mktemp("stack") / ".trainyard",
        kafka_port=infra.free_port(), redis_port=infra.free_port(), api_port=infra.free_port(),
        nodes=2, devices_per_node=4, ready_timeout_s=120,
    )
    stack = LocalStack(settings, extra_env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        # retention and the registry's retire sweep soon after a checkpoint, so a retirement is seen quickly
        "TRAINYARD_GC_INTERVAL_S": "2",
        "TRAINYARD_RETIRE_INTERVAL_S": "1",
    })
    try:
        stack.up()
        yield stack
    finally:
        stopped = stack.down()
        assert "broker" in stopped and "redis" in stopped


@pytest.fixture(scope="module")
def dataset(stack: LocalStack) -> str:
    return prepare_and_publish(stack)


def client_for(stack: LocalStack) -> httpx.Client:
    token = stack.token_file.read_text().strip()
    return httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def publish_garbage(stack: LocalStack) -> None:
    async def go() -> None:
        async with Bus(stack.kafka_bootstrap, service_name="e2e", topic_namespace=stack.s.topic_namespace) as bus:
            await bus.publish_raw(ev.JOBS, b'{"eventType":"JobSubmitted","jobId":', key="garbage")
            await bus.publish_raw(ev.CHECKPOINTS, b"\xff\xfe not an event", key="garbage")
            await bus.publish_raw(ev.METRICS, b'{"eventType":"StepMetrics","loss":"NaN?"}', key="garbage")

    asyncio.run(go())


def dead_letters(stack: LocalStack, timeout_s: float = 60.0) -> list[ev.DeadLetter]:
    async def go() -> list[ev.DeadLetter]:
        got: list[ev.DeadLetter] = []
        bus = Bus(stack.kafka_bootstrap, service_name="e2e-dlq", topic_namespace=stack.s.topic_namespace)

        async def on_letter(e: ev.DeadLetter) -> None:
            got.append(e)

        bus.subscribe(ev.DEADLETTER, {ev.DeadLetter: on_letter}, group="e2e-dlq-reader")
        async with bus:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                sources = {d.source_topic for d in got}
                if {ev.JOBS, ev.CHECKPOINTS, ev.METRICS} <= sources:
                    break
                await asyncio.sleep(0.5)
        return got

    return asyncio.run(go())


def wait_for_artifacts(client: httpx.Client, job_id: str, kinds: set[str], timeout_s: float) -> list[dict]:
    """The job's registry artifacts once every kind in ``kinds`` is among them (or the last answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        arts = client.get("/v1/registry/artifacts", params={"jobId": job_id}).raise_for_status().json()
        arts = arts.get("artifacts", arts) if isinstance(arts, dict) else arts
        if kinds <= {a["type"] for a in arts} or time.monotonic() > deadline:
            return arts
        time.sleep(0.5)


def test_tiny_job_runs_end_to_end(stack: LocalStack, dataset: str, sink: OtlpSink) -> None:
    assert dataset == "tinycorpus@v1"
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    with client_for(stack) as client:
        assert httpx.get(f"{stack.s.api_url}/v1/training-jobs").status_code == 401
        resp = client.post("/v1/training-jobs", json=spec)
        assert resp.status_code == 202, resp.text
        accepted = resp.json()
        assert accepted["state"] == "queued" and accepted["specHash"].startswith("sha256:")
        job_id = accepted["jobId"]

        publish_garbage(stack)  # the job must succeed regardless

        job = wait_for_state(client, job_id, {"succeeded", "failed", "cancelled"}, timeout_s=300)
        assert job["state"] == "succeeded", json.dumps(job)[:3000]
        max_steps = spec["training"]["maxSteps"]
        assert job["progress"]["globalStep"] == max_steps
        assert job["progress"]["consumedTokens"] == max_steps * 32 * 64

        # -- checkpoints: READY only with every shard present and verified
        ckpts = client.get(f"/v1/training-jobs/{job_id}/checkpoints").raise_for_status().json()
        ckpts = ckpts.get("checkpoints", ckpts) if isinstance(ckpts, dict) else ckpts
        ready = [c for c in ckpts if c["state"] == "READY"]
        assert sorted(c["globalStep"] for c in ready) == [20, 40]
        final = max(ready, key=lambda c: c["globalStep"])
        manifest_path = uri_to_path(final["manifestUri"])
        manifest = json.loads(manifest_path.read_text())
        assert manifest["worldSize"] == 2 and len(manifest["shards"]) == 2
        assert sorted(s["rank"] for s in manifest["shards"]) == [0, 1]
        for shard in manifest["shards"] + manifest.get("extraFiles", []):
            path = uri_to_path(shard["uri"])
            assert path.stat().st_size == shard["sizeBytes"]
            assert sha256_file(path) == shard["sha256"]
        assert manifest["contentHash"] == final["contentHash"]
        # the values' hash, as the ranks reported their entries: in the manifest and the API's checkpoint view
        assert final["tensorsHash"].startswith("sha256:") and manifest["tensorsHash"] == final["tensorsHash"]
        assert {"model.wte.weight", "rng.rank_0.torch", "rng.rank_1.torch"} <= {t["key"] for t in manifest["tensors"]}
        assert len({c["tensorsHash"] for c in ready}) == len(ready)  # trained between checkpoints
        shown = trainyard(stack, "jobs", "checkpoints", job_id)
        assert shown.returncode == 0, shown.stderr
        assert "TENSORS HASH" in shown.stdout and final["tensorsHash"][:19] in shown.stdout

        # -- registry: checkpoint artifacts and the final model, with lineage. The registry records the model
        # when it consumes the job's `succeeded`, which the API may show a moment earlier.
        arts = wait_for_artifacts(client, job_id, {"checkpoint", "model"}, timeout_s=60)
        kinds = {a["type"] for a in arts}
        assert kinds == {"checkpoint", "model"}
        model = next(a for a in arts if a["type"] == "model")
        assert model["hash"] == final["contentHash"]
        assert model["tensorsHash"] == final["tensorsHash"]
        lineage = model["lineage"]
        assert lineage["specHash"] == accepted["specHash"]
        assert lineage["codeRevision"] == spec["codeRevision"]
        assert lineage["dataset"] == "tinycorpus@v1" and lineage["datasetSha256"]
        assert lineage["tokenizer"]


    # -- the malformed messages went to the dead-letter topic, with their bytes
    letters = dead_letters(stack)
    by_source = {d.source_topic: d for d in letters}
    assert {ev.JOBS, ev.CHECKPOINTS, ev.METRICS} <= set(by_source)
    assert base64.b64decode(by_source[ev.CHECKPOINTS].raw_b64) == b"\xff\xfe not an event"

    # -- one job, one trace: api → scheduler → node agent → trainer → coordinator → registry
    trace_id = job_trace_id(stack, job_id)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not SERVICES_IN_TRACE <= sink.services_in_trace(trace_id):
        time.sleep(0.5)
    assert SERVICES_IN_TRACE <= sink.services_in_trace(trace_id), sink.services_in_trace(trace_id)


def test_a_downstream_consumer_follows_the_registry_feed(stack: LocalStack, dataset: str) -> None:
    """A service outside trainyard (plain aiokafka, its own group and JSON decoding) follows trainyard.registry
    while a short job runs: each checkpoint and the final model is announced once, with the uri, hash and
    lineage the API shows, and the checkpoint retention deletes is announced retired."""
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["name"] = "followed-downstream"
    spec["training"]["maxSteps"] = 20
    spec["checkpointPolicy"] = {"everySteps": 10, "keepLast": 1}  # step 10 goes once step 20 is READY
    topic = f"{stack.s.topic_namespace}trainyard.registry"
    with RegistryFollower(stack.kafka_bootstrap, topic, group="downstream-eval") as feed, \
            client_for(stack) as client:
        job_id = client.post("/v1/training-jobs", json=spec).raise_for_status().json()["jobId"]
        job = wait_for_state(client, job_id, {"succeeded", "failed", "cancelled"}, timeout_s=300)
        assert job["state"] == "succeeded", json.dumps(job)[:3000]

        feed.wait(lambda: feed.events(eventType="ArtifactRetired", jobId=job_id),
                  timeout_s=120, what=f"the retirement of {job_id}'s step 10")
        model = feed.wait(lambda: feed.events(eventType="ArtifactRegistered", jobId=job_id, kind="model"),
                          timeout_s=60, what=f"{job_id}'s model")
        body = client.get("/v1/registry/artifacts", params={"jobId": job_id}).raise_for_status().json()

    artifacts = {a["artifactId"]: a for a in body["artifacts"]}
    registered = feed.events(eventType="ArtifactRegistered", jobId=job_id)
    assert sorted(e["artifactId"] for e in registered) == sorted(artifacts), "each artifact announced once"
    assert {(a["type"], a["globalStep"]) for a in artifacts.values()} == {("checkpoint", 10), ("checkpoint", 20),
                                                                         ("model", 20)}
    for event in registered:
        artifact = artifacts[event["artifactId"]]
        assert (event["kind"], event["tenant"], event["globalStep"], event["consumedTokens"]) == (
            artifact["type"], artifact["tenant"], artifact["globalStep"], artifact["consumedTokens"])
        assert (event["uri"], event["hash"]) == (artifact["uri"], artifact["hash"])
        assert _set(event["lineage"]) == _set(artifact["lineage"])
        assert event["lineage"]["dataset"] == "tinycorpus@v1" and event["lineage"]["datasetSha256"]
        manifest = json.loads(uri_to_path(event["uri"]).read_text()) if artifact["retiredAt"] is None else None
        assert manifest is None or manifest["contentHash"] == event["hash"]  # the uri opens what the hash names
    assert len(model) == 1 and model[0]["globalStep"] == 20

    (gone,) = feed.events(eventType="ArtifactRetired", jobId=job_id)
    step10 = artifacts[gone["artifactId"]]
    assert (step10["type"], step10["globalStep"]) == ("checkpoint", 10) and step10["retiredAt"]
    assert (gone["kind"], gone["uri"], gone["hash"]) == ("checkpoint", step10["uri"], step10["hash"])
    assert "deleted by retention" in gone["reason"]
    assert not uri_to_path(gone["uri"]).exists()  # retired: its manifest is gone


def test_a_users_corpus_and_tokenizer_land_and_a_trigger_trains_on_them(
    stack: LocalStack, dataset: str, tmp_path: Path,
) -> None:
    """Data in, as an upstream pipeline brings it: a trigger waits for the tenant's `user-corpus`; a JSONL
    corpus (plain and gzip) is imported with the user's own tokenizer.json of 70,000 tokens (uint32 ids) and
    published (`trainyard datasets import --publish`); the registry verifies it; the trigger submits one job on
    the new version, which trains on it; the artifacts name that version in their lineage; and the tokens the
    loader reads back decode to the original documents."""
    from tokenizers import Tokenizer

    from trainyard.data import TokenDataset

    vocabulary = corpora.words()
    tokenizer = corpora.train_bpe(tmp_path / "tokenizer.json", vocabulary)
    documents = corpora.documents(vocabulary, count=300)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "part-0.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents[:150])))
    (tmp_path / "corpus" / "part-1.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps({"text": d}) + "\n" for d in documents[150:]).encode(), mtime=0))

    template = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    del template["dataset"]
    template |= {"name": "on-new-user-corpus",
                 "modelConfig": {"vocabSize": corpora.LARGE_VOCAB, "nLayers": 1, "nHeads": 2, "dModel": 32,
                                 "maxSeqLen": 32}}
    template["training"] |= {"maxSteps": 4, "sequenceLength": 32, "lrSchedule": {"name": "constant"}}
    template["checkpointPolicy"] = {"everySteps": 4, "keepLast": 1}
    (tmp_path / "template.yaml").write_text(yaml.safe_dump(template))
    made = trainyard(stack, "triggers", "create", "--dataset", "user-corpus", "--template",
                     str(tmp_path / "template.yaml"), "--json")
    assert made.returncode == 0, made.stdout + made.stderr
    trigger_id = json.loads(made.stdout)["triggerId"]

    imported = trainyard(stack, "datasets", "import", "--publish", "--name", "user-corpus", "--version", "v1",
                         "--tokenizer", str(tokenizer), "--artifact-root", str(stack.s.artifact_root),
                         "--workers", "2", "--no-progress", str(tmp_path / "corpus"), timeout_s=600)
    assert imported.returncode == 0, imported.stdout + imported.stderr

    with client_for(stack) as client:
        deadline = time.monotonic() + 120
        while not (started := client.get(f"/v1/triggers/{trigger_id}").raise_for_status().json()["jobs"]):
            assert time.monotonic() < deadline, "the trigger started no job on the verified version"
            time.sleep(1.0)
        ((ref, job_id),) = [(j["dataset"], j["jobId"]) for j in started]
        assert ref == "dev/user-corpus@v1"
        version = client.get(f"/v1/datasets/{ref}").raise_for_status().json()
        small = yaml.safe_load((REPO / "examples/tiny.yaml").read_text()) | {"dataset": "user-corpus@v1"}
        refused = client.post("/v1/training-jobs", json=small)  # gpt-tiny's 1,024 ids cannot embed 70,000
        assert refused.status_code == 422 and [p["field"] for p in refused.json()["detail"]] == ["modelConfig"]
        job = wait_for_state(client, job_id, {"succeeded", "failed", "cancelled"}, timeout_s=300)
        assert job["state"] == "succeeded", json.dumps(job)[:3000]
        assert job["spec"]["dataset"] == ref and job["triggeredBy"]["triggerId"] == trigger_id
        artifacts = client.get("/v1/registry/artifacts", params={"jobId": job_id}).raise_for_status().json()
        again = client.get(f"/v1/triggers/{trigger_id}").raise_for_status().json()["jobs"]

    assert again == started  # one job for the version, however often it is announced
    manifest_path = ArtifactLayout(stack.s.artifact_root).dataset_dir("user-corpus", "v1", "dev") / "manifest.json"
    assert version["state"] == "verified" and version["sha256"] == sha256_file(manifest_path)
    assert (version["vocabSize"], version["dtype"]) == (corpora.LARGE_VOCAB, "uint32")
    manifest = json.loads(manifest_path.read_text())
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["vocabSize"] == corpora.LARGE_VOCAB
    assert manifest["tokenizer"]["sha256"] == sha256_file(tokenizer)  # the user's tokenizer, byte for byte
    lineages = [a["lineage"] for a in artifacts["artifacts"]]
    assert lineages and all(lin["dataset"] == ref and lin["datasetSha256"] == version["sha256"] for lin in lineages)

    # What the loader serves, read back from the version the job trained on, decodes to the documents.
    data, seq = TokenDataset(manifest_path, 32), 32
    shards = [np.fromfile(manifest_path.parent / s["file"], dtype="<u4") for s in manifest["shards"]]
    for index, tokens in enumerate(shards):  # the windows of each shard, in order, are that shard
        windows = [data.window(i) for i in range(len(data)) if data.locate(i)[0] == index]
        served = np.concatenate([*(w[:seq] for w in windows), windows[-1][seq:]])
        assert len(tokens) - len(served) < seq and np.array_equal(served, tokens[: len(served)])
    stream = np.concatenate(shards)
    assert int(stream.max()) > 65_535  # ids beyond uint16, stored and served
    eos = manifest["importInfo"]["eosTokenId"]
    decoder = Tokenizer.from_file(str(manifest_path.parent / "tokenizer.json"))
    cuts = np.flatnonzero(stream == eos)
    assert [decoder.decode(part[:-1].tolist()) for part in np.split(stream, cuts + 1)[:-1]] == documents


def _set(fields: dict) -> dict:
    """A JSON object without its null fields (the API leaves some out, the feed sends them as null)."""
    return {k: v for k, v in fields.items() if v is not None}


def job_trace_id(stack: LocalStack, job_id: str) -> str:
    from trainyard_runtime.store import StateStore, connect_redis

    async def go() -> str:
        redis = connect_redis(stack.redis_url)
        try:
            job = await StateStore(redis).get_job(job_id)
        finally:
            await redis.aclose()
        assert job is not None and job.traceparent, "the API stores the job's trace context"
        return job.traceparent.split("-")[1]

    return asyncio.run(go())


def test_oversized_job_stays_queued_and_says_why(stack: LocalStack, dataset: str) -> None:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["resources"]["gpuCount"] = 16
    spec["parallelism"]["data"] = 16
    spec["training"]["globalBatchSize"] = 128
    with client_for(stack) as client:
        resp = client.post("/v1/training-jobs", json=spec)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["jobId"]
        deadline = time.monotonic() + 30
        job: dict = {}
        while time.monotonic() < deadline:
            job = client.get(f"/v1/training-jobs/{job_id}").json()
            if job.get("queuedReason"):
                break
            time.sleep(0.5)
        assert job["state"] == "queued"
        assert "16" in job["queuedReason"] and "8" in job["queuedReason"], job["queuedReason"]
        assert client.post(f"/v1/training-jobs/{job_id}/cancel").status_code in (200, 202)
        wait_for_state(client, job_id, {"cancelled"}, timeout_s=30)


def test_bad_specs_are_refused_with_the_field_named(stack: LocalStack, dataset: str) -> None:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    with client_for(stack) as client:
        bad = {**spec, "training": {**spec["training"], "globalBatchSize": 30}}
        resp = client.post("/v1/training-jobs", json=bad)
        assert resp.status_code == 422
        assert "globalBatchSize" in resp.text
        resp = client.post("/v1/training-jobs", json={**spec, "modelConfig": "gpt-huge@v9"})
        assert resp.status_code == 422 and "gpt-huge@v9" in resp.text
        resp = client.post("/v1/training-jobs", json={**spec, "dataset": "nosuch@v1"})
        assert resp.status_code == 422 and "nosuch@v1" in resp.text


def _long_spec(max_steps: int, every: int) -> dict:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["name"] = f"pausable-{max_steps}"
    spec["training"]["maxSteps"] = max_steps
    spec["checkpointPolicy"] = {"everySteps": every, "keepLast": 5}
    return spec


def _wait_for_step(client: httpx.Client, job_id: str, step: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    job: dict = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        if (job.get("progress") or {}).get("globalStep", 0) >= step or job["state"] in {"failed", "succeeded"}:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not reach step {step} in {timeout_s}s: {json.dumps(job)[:2000]}")


def _checkpoints(client: httpx.Client, job_id: str) -> list[dict]:
    body = client.get(f"/v1/training-jobs/{job_id}/checkpoints").raise_for_status().json()
    return body.get("checkpoints", body) if isinstance(body, dict) else body


def test_pause_checkpoints_releases_and_resume_continues(stack: LocalStack, dataset: str) -> None:
    """pause = checkpoint at an agreed step, then release the gang (state paused); resume = a new
    attempt from exactly that checkpoint, which trains on to maxSteps."""
    max_steps, every = 600, 5000  # no scheduled checkpoint before the end: the pause makes the only one
    with client_for(stack) as client:
        job_id = client.post("/v1/training-jobs", json=_long_spec(max_steps, every)).raise_for_status().json()["jobId"]
        running = _wait_for_step(client, job_id, 5, timeout_s=180)
        assert running["state"] == "running", json.dumps(running)[:2000]

        assert client.post(f"/v1/training-jobs/{job_id}/pause").status_code == 202
        paused = wait_for_state(client, job_id, {"paused", "failed", "succeeded", "cancelled"}, timeout_s=120)
        assert paused["state"] == "paused", json.dumps(paused)[:3000]
        first = paused["attempts"][0]
        assert first["state"] == "revoked" and first["endedAt"], first  # the gang is released
        ready = [c for c in _checkpoints(client, job_id) if c["state"] == "READY"]
        assert len(ready) == 1, ready  # the checkpoint the pause asked for
        pause_step = ready[0]["globalStep"]
        assert 5 <= pause_step < max_steps and pause_step % every != 0

        time.sleep(2.0)  # paused stays paused: no new attempt is placed
        still = client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        assert still["state"] == "paused" and len(still["attempts"]) == 1

        assert client.post(f"/v1/training-jobs/{job_id}/resume").status_code == 202
        done = wait_for_state(client, job_id, {"succeeded", "failed", "cancelled"}, timeout_s=400)
        assert done["state"] == "succeeded", json.dumps(done)[:3000]
        second = done["attempts"][1]
        assert second["startCheckpoint"]["globalStep"] == pause_step
        assert done["progress"]["globalStep"] == max_steps
        assert done["progress"]["consumedTokens"] == max_steps * 32 * 64  # nothing trained twice or skipped

        # -- goodput: two attempts of 2 devices; everything allocated is productive or wasted by a cause
        ledger = done["goodput"]
        parts = ledger["productiveDeviceSeconds"] + ledger["inFlightDeviceSeconds"] + sum(ledger["wasted"].values())
        assert ledger["allocatedDeviceSeconds"] == pytest.approx(parts, abs=1e-3)
        assert ledger["inFlightDeviceSeconds"] == 0  # succeeded: nothing is in flight
        assert 0 < ledger["goodput"] < 1 and ledger["wasted"]["launchRestore"] > 0
        assert ledger["wasted"]["lostWork"] == pytest.approx(0, abs=1e-6)  # the pause saved its last step
        tenant = client.get("/v1/goodput").raise_for_status().json()
        assert tenant["ledger"]["allocatedDeviceSeconds"] >= ledger["allocatedDeviceSeconds"]


def test_cancel_stops_now_and_keeps_ready_checkpoints(stack: LocalStack, dataset: str) -> None:
    with client_for(stack) as client:
        job_id = client.post("/v1/training-jobs", json=_long_spec(2000, 10)).raise_for_status().json()["jobId"]
        _wait_for_step(client, job_id, 12, timeout_s=180)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(c["state"] == "READY" for c in _checkpoints(client, job_id)):
            time.sleep(0.5)
        assert client.post(f"/v1/training-jobs/{job_id}/cancel").status_code == 202
        done = wait_for_state(client, job_id, {"cancelled", "failed", "succeeded"}, timeout_s=60)
        assert done["state"] == "cancelled", json.dumps(done)[:2000]
        assert done["attempts"][-1]["state"] == "revoked"
        time.sleep(3.0)  # whatever was in flight settles; nothing deletes READY checkpoints on cancel
        ready = [c for c in _checkpoints(client, job_id) if c["state"] == "READY"]
        assert ready, _checkpoints(client, job_id)
        for c in ready:
            manifest = json.loads(uri_to_path(c["manifestUri"]).read_text())
            for shard in manifest["shards"]:
                assert sha256_file(uri_to_path(shard["uri"])) == shard["sha256"]
