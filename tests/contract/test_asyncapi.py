"""The event contract (docs/asyncapi.yaml) is valid AsyncAPI 3.0.0, complete, and what the code does.

No broker and no node: the document is validated against the official AsyncAPI 3.0.0 JSON Schema
vendored beside this file (ASYNCAPI-SCHEMA.md), and what the bus would send for an event (key,
headers, payload) is held to the document.
"""

from __future__ import annotations

import copy
import hashlib
import json
import string
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from trainyard_contract import asyncapi as contract
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
from trainyard_contract.spec import TrainingSpec

HERE = Path(__file__).parent
REPO = HERE.parents[1]
COMMITTED = REPO / "docs" / "asyncapi.yaml"
SCHEMA_FILE = HERE / "asyncapi-3.0.0.json"
SCHEMA_SHA256 = "d4571a420e6ffb7fcc7066c95a6db1202f299a3c51daa103d0706bf30f95e626"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return contract.asyncapi()


@pytest.fixture(scope="module")
def asyncapi_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(SCHEMA_FILE.read_text()))


def payload_validator(doc: dict[str, Any], schema_name: str) -> jsonschema.Draft7Validator:
    """Validates against one of the document's schemas, resolving its ``#/components/...`` references."""
    return jsonschema.Draft7Validator({"$ref": f"#/components/schemas/{schema_name}", "components": doc["components"]})


def test_the_vendored_schema_is_the_official_file() -> None:
    assert hashlib.sha256(SCHEMA_FILE.read_bytes()).hexdigest() == SCHEMA_SHA256, "see ASYNCAPI-SCHEMA.md"


def test_the_document_is_valid_asyncapi_3_0_0(doc: dict[str, Any], asyncapi_validator: jsonschema.Draft7Validator
                                              ) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in asyncapi_validator.iter_errors(doc)]
    assert not errors, "\n".join(errors)
    # the validator looks inside: a bad operation and a bad payload schema are refused
    broken = copy.deepcopy(doc)
    broken["operations"]["scheduler.receive.jobs"]["action"] = "consume"
    broken["components"]["schemas"]["JobStateChanged"]["properties"]["state"]["type"] = 5
    paths = {"/".join(map(str, e.absolute_path)) for e in asyncapi_validator.iter_errors(broken)}
    assert {"operations/scheduler.receive.jobs", "components/schemas/JobStateChanged/properties/state/type"} <= paths


def test_docs_asyncapi_yaml_is_what_the_code_generates() -> None:
    assert COMMITTED.exists(), f"docs/asyncapi.yaml is missing: run `{contract.REGENERATE}`"
    assert COMMITTED.read_text() == contract.asyncapi_yaml(), (
        f"docs/asyncapi.yaml differs from the event models: run `{contract.REGENERATE}` and commit it")
    assert yaml.safe_load(COMMITTED.read_text()) == json.loads(contract.asyncapi_json())


def test_every_event_of_every_topic_is_a_message_with_publishers_and_consumers(doc: dict[str, Any]) -> None:
    in_topics = {cls for classes in ev.TOPIC_EVENTS.values() for cls in classes}
    assert set(contract.FLOWS) == in_topics, "contract.FLOWS and events.TOPIC_EVENTS name different events"
    assert {ch["address"] for ch in doc["channels"].values()} == set(ev.TOPIC_EVENTS) == set(contract.TOPICS)
    parties = {*contract.SERVICES, *contract.OUTSIDE}
    for topic, classes in ev.TOPIC_EVENTS.items():
        channel = doc["channels"][contract.channel_id(topic)]
        assert channel["address"] == topic
        for cls in classes:
            name = contract.event_name(cls)
            assert channel["messages"][name] == {"$ref": f"#/components/messages/{name}"}
            message = doc["components"]["messages"][name]
            assert message["payload"] == {"$ref": f"#/components/schemas/{cls.__name__}"}
            assert doc["components"]["schemas"][cls.__name__]["properties"]["eventType"]["const"] == name
            flow = contract.FLOWS[cls]
            # nobody on either side only when the table says why
            assert (message["x-publishers"] and message["x-consumers"]) or flow.unused, name
            assert {p["party"] for p in message["x-publishers"]} | {c["party"] for c in message["x-consumers"]} \
                <= parties, name
    unused = [name for name, m in doc["components"]["messages"].items() if not m["x-publishers"]]
    assert unused == ["AttemptEnded"]
    public = sorted(name for name, m in doc["components"]["messages"].items() if {"name": "public"} in m["tags"])
    assert {"JobStateChanged", "DatasetVersionPublished"} <= set(public)


def test_every_publisher_sends_and_every_consumer_receives_in_its_group(doc: dict[str, Any]) -> None:
    ops = doc["operations"]
    for topic, classes in ev.TOPIC_EVENTS.items():
        cid = contract.channel_id(topic)
        for cls in classes:
            ref = {"$ref": f"#/channels/{cid}/messages/{contract.event_name(cls)}"}
            for p in contract.FLOWS[cls].producers:
                op = ops[f"{p.party}.send.{cid}"]
                assert op["action"] == "send" and ref in op["messages"]
            for c in contract.FLOWS[cls].consumers:
                # a party reading a topic in a second group has a second operation: "<party>.receive.<cid>.<group>"
                base = f"{c.party}.receive.{cid}"
                mine = [o for k, o in ops.items() if (k == base or k.startswith(f"{base}.")) and ref in o["messages"]]
                assert len(mine) == 1, (base, ref)
                op = mine[0]
                assert op["action"] == "receive"
                if c.group:
                    group = op["bindings"]["kafka"]["groupId"]
                    assert group.get("const") == f"trainyard.{c.group}" or re.match(group["pattern"],
                                                                                  "trainyard.node-agent.node-0")
    assert ops["scheduler.receive.metrics"]["bindings"]["kafka"]["groupId"]["const"] == "trainyard.scheduler-metrics"
    assert ops["scheduler.receive.nodes.node-admin"]["bindings"]["kafka"]["groupId"]["const"] == \
        "trainyard.scheduler-node-admin"  # the drains and quarantines: a group of their own beside the heartbeats'
    assert ops["scheduler.receive.workers"]["bindings"]["kafka"]["groupId"]["const"] == "trainyard.scheduler-workers"
    # an operation's messages are its channel's (AsyncAPI requires a subset; the JSON Schema cannot say so)
    for op_id, op in ops.items():
        channel = op["channel"]["$ref"].removeprefix("#/channels/")
        for m in op["messages"]:
            assert m["$ref"].startswith(f"#/channels/{channel}/messages/"), op_id


def test_every_reference_resolves(doc: dict[str, Any]) -> None:
    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in refs(v)]
        return [r for v in node for r in refs(v)] if isinstance(node, list) else []

    for ref in refs(doc):
        target: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            assert isinstance(target, dict) and part in target, f"{ref} does not resolve"
            target = target[part]


def sample_events() -> list[ev.Event]:
    spec = TrainingSpec.model_validate(yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text()))
    return [
        ev.JobStateChanged(job_id="job-1", tenant="acme", state="running", previous_state="queued", attempt=1),
        ev.DatasetVersionPublished(name="wiki", version="v3", manifest_uri="file:///data/wiki/v3/manifest.json",
                                   sha256="ab" * 32, tokenizer="gpt2", num_tokens=1000),
        ev.DatasetVersionPublished(name="wiki", version="v4", manifest_uri="file:///t/acme/wiki/v4/manifest.json",
                                   sha256="ab" * 32, tenant="acme", shared_with=["beta"]),
        ev.DatasetRejected(name="wiki", version="v4", tenant="acme", manifest_uri="file:///t/acme/wiki/v4/manifest.json",
                           sha256="ab" * 32, reason="shard-00000.bin: sha256 differs"),
        ev.ArtifactRegistered(artifact_id="acme/wiki@v4", kind="dataset", tenant="acme",
                              uri="file:///t/acme/wiki/v4/manifest.json", hash="ab" * 32, dataset="acme/wiki@v4"),
        ev.ArtifactRetired(artifact_id="art-1", kind="checkpoint", tenant="acme", job_id="job-1",
                           uri="file:///t/acme/jobs/job-1/checkpoints/x/manifest.json", hash="cd" * 32,
                           reason="deleted by retention"),
        ev.JobSubmitted(job_id="job-1", tenant="acme", spec=spec, spec_hash="cd" * 32),
        ev.NodeHeartbeat(node_id="node-0", host="h0", devices=[ev.DeviceInfo(index=0, type="cpu", memory_bytes=1)]),
        ev.StepMetrics(job_id="job-1", attempt=1, rank=0, step=3, loss=2.5, consumed_tokens=96, metrics={"gn": 1.0}),
        ev.DeadLetter(source_topic="trainyard.jobs", partition=1, offset=7, consumer_group="trainyard.scheduler",
                      raw_b64="e30=", error="invalid"),
    ]


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.event_type)
async def test_what_the_bus_sends_is_what_the_document_says(doc: dict[str, Any], event: ev.Event) -> None:
    sent: list[tuple[str, bytes, str | None, dict[str, str]]] = []

    async def record(topic: str, payload: bytes, *, key: str | None = None, headers: Any = None) -> None:
        sent.append((topic, payload, key, dict(headers or {})))

    bus = Bus("127.0.0.1:1", service_name="contract-test")
    bus.publish_raw = record  # type: ignore[method-assign]  # a test double's method
    await bus.publish(event, traceparent=TRACEPARENT)
    ((topic, payload, key, headers),) = sent
    message = doc["components"]["messages"][event.event_type]
    assert doc["channels"][contract.channel_id(topic)]["messages"][event.event_type]
    fields = json.loads(payload)
    templates = message["bindings"]["kafka"]["key"]["x-templates"]
    applies = next(t for t in templates
                   if all(fields.get(f) is not None for _, f, _, _ in string.Formatter().parse(t) if f))
    assert key == applies.format(**fields)
    errors = [e.message for e in payload_validator(doc, type(event).__name__).iter_errors(json.loads(payload))]
    assert not errors, errors
    # the trace continues: the same trace id (the span id is the publishing span's when tracing is on)
    assert headers["traceparent"].split("-")[1] == TRACEPARENT.split("-")[1]
    assert set(headers) <= set(doc["components"]["schemas"]["Headers"]["properties"])
    assert not list(payload_validator(doc, "Headers").iter_errors(headers))


def test_payload_schemas_are_camel_case_and_refuse_what_trainyard_refuses(doc: dict[str, Any]) -> None:
    good = json.loads(sample_events()[0].to_bytes())
    validator = payload_validator(doc, "JobStateChanged")
    assert validator.is_valid(good)
    snake = {("job_id" if k == "jobId" else k): v for k, v in good.items()}
    assert not validator.is_valid(snake)  # the wire is camelCase: jobId is required
    assert not validator.is_valid({**good, "state": "exploded"})
    assert not validator.is_valid({k: v for k, v in good.items() if k != "eventId"})  # the envelope is required
    assert validator.is_valid({**good, "addedLater": 1})  # unknown fields are ignored, as consumers do


def test_every_public_message_has_an_example_the_contract_accepts(doc: dict[str, Any]) -> None:
    for name, message in doc["components"]["messages"].items():
        if {"name": "public"} not in message["tags"]:
            continue
        assert message.get("examples"), f"public {name} has no example in contract.FLOWS"
        for example in message["examples"]:
            schema = message["payload"]["$ref"].removeprefix("#/components/schemas/")
            assert not list(payload_validator(doc, schema).iter_errors(example["payload"])), name
            assert not list(payload_validator(doc, "Headers").iter_errors(example["headers"])), name
            assert type(ev.decode_event(ev.EVENT_TYPES[name].topic, json.dumps(example["payload"]).encode())) \
                is ev.EVENT_TYPES[name]


@pytest.mark.parametrize("cls", list(contract.FLOWS), ids=lambda c: c.__name__)
def test_the_key_template_is_what_key_returns(cls: type[ev.Event]) -> None:
    fields = {name: f"<{f.alias}>" for name, f in cls.model_fields.items()}
    event = cls.model_construct(**fields)  # unvalidated placeholders: only key() is asked
    first = contract.key_templates(cls)[0]  # every field set: the first alternative applies
    assert event.key() == first.format(**{f.alias: f"<{f.alias}>" for f in cls.model_fields.values()})


@pytest.mark.parametrize("cls", [c for c in contract.FLOWS if len(contract.key_templates(c)) > 1],
                         ids=lambda c: c.__name__)
def test_a_key_falls_back_to_its_next_template_when_a_field_is_null(cls: type[ev.Event]) -> None:
    first, second = contract.key_templates(cls)[:2]
    unset = {f for _, f, _, _ in string.Formatter().parse(first) if f} - \
        {f for _, f, _, _ in string.Formatter().parse(second) if f}
    fields = {name: None if f.alias in unset else f"<{f.alias}>" for name, f in cls.model_fields.items()}
    event = cls.model_construct(**fields)
    assert event.key() == second.format(**{f.alias: f"<{f.alias}>" for f in cls.model_fields.values()})


def test_a_new_event_without_a_flow_is_refused() -> None:
    class Orphan(ev.Event):
        topic = ev.JOBS
        event_type: str = "Orphan"
        job_id: str

    with pytest.raises(ValueError, match="Orphan"):
        contract.asyncapi({ev.JOBS: (ev.JobSubmitted, Orphan)})


def test_the_cli_prints_yaml_or_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert contract.main([]) == 0
    assert capsys.readouterr().out == contract.asyncapi_yaml()
    assert contract.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == contract.asyncapi()
