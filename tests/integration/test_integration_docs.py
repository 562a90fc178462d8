"""docs/integration.md's examples run as written against the suite's broker (tansu): a pipeline outside
trainyard publishes with confluent-kafka (librdkafka) what trainyard decodes, on the partition trainyard's
own producer picks for the key; a follower outside trainyard (plain aiokafka) sees each JobStateChanged
once, and skips the platform's other job events; the registry's follower keeps what is loadable from the
feed alone, each announcement applied once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
from aiokafka import AIOKafkaConsumer
from aiokafka.partitioner import DefaultPartitioner

from trainyard_contract import asyncapi as contract
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_contract.storage import path_to_uri

DOC = Path(__file__).parents[2] / "docs" / "integration.md"


def example(heading: str) -> dict[str, Any]:
    """Run the first python block after ``heading`` (without its closing ``asyncio.run(…)``); its names."""
    section = DOC.read_text().split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python example under {heading!r} in {DOC}"
    code = re.sub(r"^asyncio\.run\(.*", "", match.group(1), flags=re.S | re.M)
    names: dict[str, Any] = {"__name__": "integration_example"}
    exec(compile(code, str(DOC), "exec"), names)  # noqa: S102 - our own documentation
    return names


async def test_a_confluent_kafka_producer_publishes_what_trainyard_decodes(env: dict[str, Any], tmp_path: Path
                                                                         ) -> None:
    bootstrap, topic = env["kafka_bootstrap"], f"{env['topic_namespace']}{ev.DATASETS}"
    await ensure_topics(bootstrap, partitions=2, topics=[ev.DATASETS], namespace=env["topic_namespace"])
    producer = example("### With confluent-kafka")
    producer["BOOTSTRAP"], producer["TOPIC"] = bootstrap, topic
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"name": "wiki", "shards": []}))
    versions = [f"v{n}" for n in range(4)]
    for version in versions:  # each its own key: four chances for a partitioner that differs to show
        await asyncio.to_thread(producer["publish_dataset"], "wiki", version, manifest, "gpt2", 42)

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"{env['group_prefix']}.docs",
                                auto_offset_reset="earliest", enable_auto_commit=False, session_timeout_ms=6000)
    await consumer.start()
    try:
        records = [await asyncio.wait_for(consumer.getone(), 60) for _ in versions]
    finally:
        await consumer.stop()

    payload = {"$ref": "#/components/schemas/DatasetVersionPublished", "components": contract.asyncapi()["components"]}
    partitions = [0, 1]
    for record in records:
        event = ev.decode_event(ev.DATASETS, record.value)
        assert isinstance(event, ev.DatasetVersionPublished) and event.name == "wiki" and event.num_tokens == 42
        assert event.sha256 == hashlib.sha256(manifest.read_bytes()).hexdigest()
        assert event.manifest_uri == manifest.resolve().as_uri()
        assert record.key == event.key().encode()
        assert dict(record.headers)["content-type"] == b"application/json"
        assert record.partition == DefaultPartitioner()(record.key, partitions, partitions), event.key()
        jsonschema.Draft7Validator(payload).validate(json.loads(record.value))
    assert sorted(ev.decode_event(ev.DATASETS, r.value).version for r in records) == versions


async def test_an_aiokafka_follower_sees_each_job_state_change_once(env: dict[str, Any]) -> None:
    bootstrap, namespace = env["kafka_bootstrap"], env["topic_namespace"]
    await ensure_topics(bootstrap, partitions=2, topics=[ev.JOBS], namespace=namespace)
    follower = example("### With aiokafka")
    handled: list[dict[str, Any]] = []
    last = asyncio.Event()

    async def handle(event: dict[str, Any]) -> None:
        handled.append(event)
        if event["state"] == "succeeded":
            last.set()

    follower["handle"] = handle
    running = ev.JobStateChanged(job_id="job-docs", tenant="acme", state="running", previous_state="queued")
    events: list[ev.Event] = [
        ev.JobControlRequested(job_id="job-docs", tenant="acme", action="pause"),  # not followed
        running, running,  # redelivered: handled once
        ev.JobStateChanged(job_id="job-docs", tenant="acme", state="succeeded", previous_state="running"),
    ]
    async with Bus(bootstrap, service_name="docs-test", topic_namespace=namespace) as bus:
        for event in events:  # one key: one partition, in this order
            await bus.publish(event)
    task = asyncio.create_task(follower["follow"](bootstrap, f"{namespace}{ev.JOBS}"))
    try:
        await asyncio.wait_for(last.wait(), 60)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [(e["eventType"], e["state"]) for e in handled] == [("JobStateChanged", "running"),
                                                               ("JobStateChanged", "succeeded")]
    assert handled[0]["eventId"] == str(running.event_id)


async def test_the_registry_follower_keeps_what_is_loadable(env: dict[str, Any], tmp_path: Path) -> None:
    bootstrap, namespace = env["kafka_bootstrap"], env["topic_namespace"]
    await ensure_topics(bootstrap, partitions=2, topics=[ev.REGISTRY], namespace=namespace)
    follower = example("### The registry's feed with aiokafka")
    handled: list[dict[str, Any]] = []
    last = asyncio.Event()
    apply = follower["handle"]

    async def handle(event: dict[str, Any]) -> None:
        await apply(event)
        handled.append(event)
        if event["eventType"] == "ArtifactRetired":
            last.set()

    follower["handle"] = handle
    manifest = tmp_path / "step 20" / "manifest.json"  # a space: the uri is quoted
    manifest.parent.mkdir()
    manifest.write_text("{}")
    lineage = ev.ArtifactLineage(spec_hash="sha256:" + "a" * 64, code_revision="v1", dataset="acme/wiki@v1")
    common: dict[str, Any] = {"tenant": "acme", "job_id": "job-docs", "hash": "sha256:" + "c" * 64,
                              "lineage": lineage}
    step20 = ev.ArtifactRegistered(artifact_id="job-docs/checkpoint/step-000000020-a1", kind="checkpoint",
                                   uri=path_to_uri(manifest), global_step=20, **common)
    step40 = ev.ArtifactRegistered(artifact_id="job-docs/checkpoint/step-000000040-a1", kind="checkpoint",
                                   uri="file:///art/40/manifest.json", global_step=40, **common)
    model = step40.model_copy(update={"event_id": ev.uuid4(), "artifact_id": "job-docs/model/step-000000040-a1",
                                      "kind": "model"})
    gone = ev.ArtifactRetired(artifact_id=step20.artifact_id, kind="checkpoint", tenant="acme", job_id="job-docs",
                              uri=step20.uri, hash=step20.hash, reason="deleted by retention: keepLast=1")
    async with Bus(bootstrap, service_name="docs-test", topic_namespace=namespace) as bus:
        for event in (step20, step20, step40, model, gone):  # one key: one partition, in this order
            await bus.publish(event)
    assert follower["manifest_path"](step20.uri) == manifest  # the uri resolves to the file
    task = asyncio.create_task(follower["follow_registry"](bootstrap, f"{namespace}{ev.REGISTRY}"))
    try:
        await asyncio.wait_for(last.wait(), 60)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [e["eventId"] for e in handled] == [str(e.event_id) for e in (step20, step40, model, gone)]  # once each
    assert sorted(follower["loadable"]) == sorted([step40.artifact_id, model.artifact_id])
    assert follower["loadable"][model.artifact_id]["lineage"]["dataset"] == "acme/wiki@v1"
