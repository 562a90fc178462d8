"""A tenant's dataset versions are its own, through the real local stack (API → registry, scheduler,
node agents, the trainer; real broker, real Redis).

Tenant alpha publishes two versions through the API: ``private`` (shared with nobody) and ``shared``
(shared with beta). Beta can neither see alpha's private version (list, get; qualified and unqualified
refs) nor train on it — not through the API (a 422 naming ``dataset``, worded as for an unknown one)
and not through a JobSubmitted forged straight onto the bus (the scheduler refuses a submission the API never
stored: dead-lettered ``security: …``, no job record, never placed, no GangAllocated). What alpha shares with
beta, beta trains on.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiokafka import AIOKafkaConsumer, TopicPartition

from trainyard_cli.stack import LocalStack
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout, sha256_file

from tests.security.test_forged_events import finished, tenant_token
from tests.support.stack import running_stack

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
ALPHA, BETA = "alpha", "beta"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "dataset-isolation")


def short_spec(dataset: str) -> dict[str, Any]:
    """The tiny example on one CPU device for a few steps (CI time is tight)."""
    spec = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    spec.update(dataset=dataset, resources={"gpuType": "cpu", "gpuCount": 1}, parallelism={"data": 1})
    spec["training"].update(maxSteps=3, globalBatchSize=8, microBatchSize=8)
    spec["checkpointPolicy"] = {"everySteps": 1000, "keepLast": 1}
    return spec


def own_copy(layout: ArtifactLayout, tenant: str, name: str) -> Path:
    """The stack's tinycorpus@v1 as ``tenant``'s ``name@v1``: the same tokenizer and shards under its
    prefix, the manifest renamed (so its sha256 is its own)."""
    source = layout.dataset_dir("tinycorpus", "v1")
    target = layout.dataset_dir(name, "v1", tenant)
    target.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != "manifest.json":
            (target / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((source / "manifest.json").read_text()) | {"name": name}
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return target / "manifest.json"


def publish_through_api(client: httpx.Client, manifest: Path, shared_with: list[str]) -> str:
    resp = client.post("/v1/datasets", json={"name": manifest.parent.parent.name, "version": "v1",
                                             "sha256": sha256_file(manifest), "sharedWith": shared_with})
    assert resp.status_code == 202, resp.text
    location = resp.headers["location"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = client.get(location)
        if got.status_code == 200 and got.json()["state"] == "verified":
            return str(resp.json()["dataset"])
        assert got.status_code in (200, 404) and got.json().get("state") != "rejected", got.text
        time.sleep(0.5)
    raise AssertionError(f"{location} not verified")


def forge_submission(stack: LocalStack, tenant: str, spec: dict[str, Any]) -> ev.JobSubmitted:
    """A JobSubmitted for ``tenant`` published straight onto the bus, as no API would accept it."""
    parsed = TrainingSpec.model_validate(spec)
    job_id = f"job-forged{uuid.uuid4().hex[:6]}"
    event = ev.JobSubmitted(job_id=job_id, tenant=tenant, spec=parsed, spec_hash=parsed.spec_hash(),
                            submitted_by="forger")

    async def go() -> None:
        async with Bus(stack.kafka_bootstrap, service_name="forger", topic_namespace=stack.s.topic_namespace) as bus:
            await bus.publish(event)

    asyncio.run(go())
    return event


def on_topic(stack: LocalStack, logical: str) -> list[ev.Event]:
    """Every event on a topic so far (read to its current end)."""
    async def go() -> list[ev.Event]:
        topic = stack.s.topic_namespace + logical
        consumer = AIOKafkaConsumer(bootstrap_servers=stack.kafka_bootstrap, group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        try:
            await consumer.topics()  # metadata, so that the topic's partitions are known
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            consumer.assign(partitions)
            ends = await consumer.end_offsets(partitions)
            found: list[ev.Event] = []
            while any([await consumer.position(tp) < end for tp, end in ends.items()]):
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    found.extend(ev.decode_event(logical, record.value or b"") for record in records)
            return found
        finally:
            await consumer.stop()

    return asyncio.run(go())


def allocations_for(stack: LocalStack, job_id: str) -> list[ev.GangAllocated]:
    """Every GangAllocated so far naming ``job_id``."""
    return [e for e in on_topic(stack, ev.ALLOCATIONS) if isinstance(e, ev.GangAllocated) and e.job_id == job_id]


def refused_by_scheduler(stack: LocalStack, event: ev.Event, timeout_s: float = 120) -> ev.DeadLetter:
    """The scheduler's dead letter of ``event``, once it has one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for letter in on_topic(stack, ev.DEADLETTER):
            if isinstance(letter, ev.DeadLetter) and letter.consumer_group.endswith(".scheduler") and \
                    json.loads(base64.b64decode(letter.raw_b64)).get("eventId") == str(event.event_id):
                return letter
        time.sleep(0.5)
    raise AssertionError(f"{event.event_type} {event.event_id}: not refused by the scheduler")


def model_artifacts(client: httpx.Client, job_id: str, timeout_s: float = 60) -> list[dict[str, Any]]:
    """The job's artifacts once its final model is among them (recorded after the job's success)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        artifacts = client.get("/v1/registry/artifacts", params={"jobId": job_id}).raise_for_status().json()
        if any(a["type"] == "model" for a in artifacts["artifacts"]):
            return list(artifacts["artifacts"])
        time.sleep(0.5)
    raise AssertionError(f"{job_id}: no model artifact recorded")


def test_a_tenant_can_neither_see_nor_train_on_another_tenants_dataset_unless_it_is_shared(
    stack: LocalStack,
) -> None:
    layout = ArtifactLayout(stack.s.artifact_root)
    alpha_token, beta_token = tenant_token(stack, ALPHA), tenant_token(stack, BETA)
    alpha = httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {alpha_token}"}, timeout=30)
    beta = httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {beta_token}"}, timeout=30)
    with alpha, beta:
        private = publish_through_api(alpha, own_copy(layout, ALPHA, "private"), [])
        shared = publish_through_api(alpha, own_copy(layout, ALPHA, "shared"), [BETA])
        assert (private, shared) == (f"{ALPHA}/private@v1", f"{ALPHA}/shared@v1")

        # 1. see: beta lists the platform's and what is shared with it, never alpha's private version
        listed = {(d["tenant"], d["name"]) for d in beta.get("/v1/datasets").raise_for_status().json()["datasets"]}
        assert listed == {(None, "tinycorpus"), (ALPHA, "shared")}
        for ref in (private, "private@v1"):
            assert beta.get(f"/v1/datasets/{ref}").status_code == 404, ref
        assert alpha.get("/v1/datasets/private@v1").json()["tenant"] == ALPHA  # its owner resolves it

        # 2. train through the API: a 422 naming dataset, worded as for a version that does not exist
        messages = set()
        for ref in (private, "private@v1", f"{ALPHA}/nosuch@v1"):
            resp = beta.post("/v1/training-jobs", json=short_spec(ref))
            assert resp.status_code == 422, resp.text
            (problem,) = [d for d in resp.json()["detail"] if d["field"] == "dataset"]
            messages.add(problem["message"].replace(repr(ref), "REF"))
        assert len(messages) == 1, messages

        # 3. train through a JobSubmitted forged onto the bus: the API stored no job, so the scheduler refuses it
        # (a job exists only once the API wrote it): no record, never placed
        forged = forge_submission(stack, BETA, short_spec(private))
        letter = refused_by_scheduler(stack, forged)
        assert "security: JobSubmitted refused (unrecorded)" in letter.error, letter.error
        assert beta.get(f"/v1/training-jobs/{forged.job_id}").status_code == 404
        assert forged.job_id not in {j["jobId"] for j in beta.get("/v1/training-jobs").json()["jobs"]}
        assert allocations_for(stack, forged.job_id) == []

        # 4. what alpha shares with beta, beta trains on (and its job names it qualified)
        resp = beta.post("/v1/training-jobs", json=short_spec(shared))
        assert resp.status_code == 202, resp.text
        ended = finished(beta, resp.json()["jobId"], timeout_s=600)
        assert ended["state"] == "succeeded", json.dumps(ended)[:3000]
        assert ended["spec"]["dataset"] == shared
        artifacts = model_artifacts(beta, ended["jobId"])
        assert all(a["lineage"]["dataset"] == shared for a in artifacts), artifacts
        assert {a["lineage"]["datasetSha256"] for a in artifacts} == {
            sha256_file(layout.dataset_dir("shared", "v1", ALPHA) / "manifest.json")}
