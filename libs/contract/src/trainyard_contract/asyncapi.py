"""The event contract as a document any client can read: AsyncAPI 3.0, generated from the event models.

    python -m trainyard_contract.asyncapi > docs/asyncapi.yaml        (--json: the same as JSON)

``FLOWS`` says, next to the models, who publishes each event and who consumes it (the catalogue of
docs/design.md §4.2 as data); :func:`asyncapi` turns the models of ``TOPIC_EVENTS`` and ``FLOWS``
into the document: every topic a channel, every event a message with its JSON-Schema payload (camelCase,
as it travels), its partition key and its headers (the W3C trace context), and a send or receive
operation for each party and topic. The API serves it at ``/v1/asyncapi.yaml`` and ``/v1/asyncapi.json``;
tests/contract/test_asyncapi.py validates it against the official AsyncAPI 3.0.0 JSON Schema and fails
when docs/asyncapi.yaml differs from what this module generates.

A new event: add it to ``TOPIC_EVENTS``, give it a ``Flow`` here (a new topic also a line in ``TOPICS``;
an event that overrides ``key()`` its ``key``; a public one an ``example``), and regenerate the document.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import yaml
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from trainyard_contract import events as ev
from trainyard_contract.settings import ServiceSettings

ASYNCAPI_VERSION = "3.0.0"
KAFKA_BINDING = "0.5.0"
CONTENT_TYPE = "application/json"
REGENERATE = "python -m trainyard_contract.asyncapi > docs/asyncapi.yaml"

# ----------------------------------------------------------------------------- parties

SERVICES: dict[str, str] = {
    "api": "trainyard's REST API (services/api)",
    "telemetry": "keeps the StepMetrics read models the API serves (services/telemetry)",
    "scheduler": "places gangs, owns job state (services/scheduler)",
    "node-agent": "one per node: runs ranks and relays what they write to their spool (services/node-agent)",
    "checkpoint-coordinator": "turns shard reports into READY checkpoints (services/checkpoint-coordinator)",
    "registry": "datasets and artifacts with lineage (services/registry)",
    "cli": "the `trainyard` command line (libs/cli)",
}
"""trainyard's own parties: each is a process with its own broker client."""

OUTSIDE: dict[str, str] = {
    "upstream": "a data pipeline outside trainyard (docs/integration.md)",
    "downstream": "a service outside trainyard that follows the platform: evaluation, serving, billing "
                  "(docs/integration.md); its own consumer group",
    "admin": "an operator publishing by hand",
    "operators": "people and tests reading the topic; no trainyard code consumes it",
}
"""Parties that are not trainyard processes."""


@dataclass(frozen=True)
class Producer:
    party: str
    how: str  # outbox, direct, relayed from a rank's spool, ...


@dataclass(frozen=True)
class Consumer:
    party: str
    does: str
    group: str | None = None  # the consumer group after the prefix ("scheduler" → "trainyard.scheduler")


@dataclass(frozen=True)
class Flow:
    """Who publishes an event, who consumes it, and what it means to them."""

    summary: str
    producers: tuple[Producer, ...]
    consumers: tuple[Consumer, ...]
    public: bool = False  # supported for clients outside trainyard (docs/integration.md)
    unused: str | None = None  # why an event without producers or consumers is still defined
    key: str | None = None  # the partition key, for an event that overrides Event.key(); "a | b": the first
    #                         template whose fields are all set (not null) in the payload
    example: ev.Event | None = None  # shown in the document as the bus sends it


def _sends(how: str, *parties: str) -> tuple[Producer, ...]:
    return tuple(Producer(p, how) for p in parties)


_EXAMPLE_ID = UUID("7c9e6679-7425-40de-944b-e07fc1f90ae7")
_EXAMPLE_AT = datetime(2026, 12, 1, 16, 50, tzinfo=UTC)

_RELAYED = "relayed from a trainer rank's spool (the rank writes it, its node agent publishes it)"
_ADMIN_ROUTE = "POST /v1/admin/nodes/{{id}}/{}, `by` = the admin"

FLOWS: dict[type[ev.Event], Flow] = {
    # jobs
    ev.JobSubmitted: Flow(
        "A job was accepted: its immutable spec, the spec hash and the tenant.",
        (Producer("api", "outbox, after POST /v1/training-jobs"),
         Producer("upstream", "any publisher with broker access (the API is the checked way in)")),
        (Consumer("scheduler", "queues the job", "scheduler"),)),
    ev.JobControlRequested: Flow(
        "A tenant asked to cancel, pause or resume its job.",
        (Producer("api", "outbox"),),
        (Consumer("scheduler", "applies it, ignored unless `tenant` owns the job", "scheduler"),)),
    ev.JobStateChanged: Flow(
        "A job moved from one state to another (queued, running, paused, succeeded, failed, cancelled).",
        (Producer("scheduler", "outbox, in the same transaction as the job record"),),
        (Consumer("registry", "`succeeded` registers the final model artifact", "registry"),
         Consumer("downstream", "follows jobs: evaluates, serves or bills finished ones")),
        public=True,
        example=ev.JobStateChanged(event_id=_EXAMPLE_ID, occurred_at=_EXAMPLE_AT, job_id="job-5f0c2a9e41d7",
                                   tenant="acme", state="succeeded", previous_state="running", attempt=2,
                                   reason="reached maxSteps")),
    # nodes
    ev.NodeHeartbeat: Flow(
        "A node agent's inventory: devices, health, running allocations, drain.",
        (Producer("node-agent", "direct, every TRAINYARD_HEARTBEAT_S"),),
        (Consumer("scheduler", "inventory and node lease renewal", "scheduler-nodes"),)),
    ev.NodeQuarantined: Flow(
        "A node the scheduler stops placing on.",
        (Producer("scheduler", "direct, reputation (`by: reputation`)"),
         Producer("admin", "published directly")),
        (Consumer("scheduler", "stops placing there", "scheduler-node-admin"),)),
    ev.NodeReinstated: Flow(
        "A quarantined node is placeable again.",
        (Producer("scheduler", "direct, its score decayed"), Producer("api", _ADMIN_ROUTE.format("reinstate"))),
        (Consumer("scheduler", "places there again", "scheduler-node-admin"),)),
    ev.NodeDrained: Flow(
        "A node taken out of service on purpose (maintenance).",
        (Producer("api", _ADMIN_ROUTE.format("drain")),
         Producer("node-agent", "while its Kubernetes Node is cordoned (`by` = kubernetes)")),
        (Consumer("scheduler", "nothing new there; its attempts checkpoint and stop, interrupted by maintenance",
                  "scheduler-node-admin"),)),
    ev.NodeUndrained: Flow(
        "A drained node takes new work again.",
        (Producer("api", _ADMIN_ROUTE.format("undrain")),
         Producer("node-agent", "once its Kubernetes Node is uncordoned (only a drain `by` kubernetes)")),
        (Consumer("scheduler", "places there again", "scheduler-node-admin"),)),
    # allocations
    ev.GangAllocated: Flow(
        "An attempt was placed: every node and rank of the gang, its epoch and start checkpoint.",
        (Producer("scheduler", "outbox; republished by reconcile"),),
        (Consumer("node-agent", "starts the ranks placed on its node", "node-agent.{nodeId}"),)),
    ev.CheckpointRequested: Flow(
        "Checkpoint soon and stop: preemption, pause or a drain.",
        (Producer("scheduler", "outbox (preemption, pause, drain)"),
         Producer("node-agent", "a stopping node agent, to its own ranks")),
        (Consumer("node-agent", "hands it to its ranks (request file and SIGUSR1)", "node-agent.{nodeId}"),)),
    ev.ReplicaReplaced: Flow(
        "A failed replica of a fault-tolerant attempt is started again while the others train on.",
        (Producer("scheduler", "outbox, with the newcomer's grant (ty:replica) in the same MULTI"),),
        (Consumer("node-agent", "starts the rank again as the named generation, if granted and leased to it",
                  "node-agent.{nodeId}"),)),
    ev.AllocationRevoked: Flow(
        "An attempt's allocation is withdrawn.",
        (Producer("scheduler", "outbox"),),
        (Consumer("node-agent", "stops the ranks; a stale epoch is ignored", "node-agent.{nodeId}"),)),
    # workers
    ev.WorkerStarted: Flow(
        "A rank's process started.",
        (Producer("node-agent", "outbox"),),
        (Consumer("scheduler", "marks the attempt running; a batch's ranks of one gang in one write",
                  "scheduler-workers"),)),
    ev.EnvironmentPreparing: Flow(
        "A node builds a job's environment (code.environment) or found it cached, before its ranks start.",
        (Producer("node-agent", "outbox"),),
        (Consumer("scheduler", "shows it on the attempt; restarts the attempt's start time-out",
                  "scheduler-workers"),)),
    ev.WorkerExited: Flow(
        "A rank's process ended, with the classified reason.",
        (Producer("node-agent", "outbox"),),
        (Consumer("scheduler", "ends or retries the attempt", "scheduler-workers"),
         Consumer("checkpoint-coordinator", "failure statistics for the checkpoint interval advice",
                  "checkpoint-coordinator-measurements"))),
    ev.AttemptEnded: Flow(
        "An attempt ended (defined for the record; job state travels in JobStateChanged).",
        (), (), unused="defined, never published or consumed"),
    ev.StragglerDetected: Flow(
        "A rank is markedly slower than the median rank.",
        (Producer("scheduler", "direct, from StepMetrics"),),
        (Consumer("telemetry", "the job's step-timing read model", "telemetry"),)),
    ev.SecurityViolation: Flow(
        "A rank claimed what a rank may not; the job fails, not retried.",
        (Producer("node-agent", "outbox, when a rank's spool line is a forgery"),),
        (Consumer("scheduler", "fails the job, not retried", "scheduler-workers"),)),
    # checkpoints
    ev.ShardWritten: Flow(
        "A rank wrote its checkpoint shard durably.",
        (Producer("node-agent", _RELAYED),),
        (Consumer("checkpoint-coordinator", "assembles the manifest", "checkpoint-coordinator"),)),
    ev.CheckpointReady: Flow(
        "Every shard of a step is written and verified: the checkpoint can be restored.",
        (Producer("checkpoint-coordinator", "outbox"),),
        (Consumer("scheduler", "records the job's latest checkpoint", "scheduler"),
         Consumer("registry", "registers the checkpoint artifact", "registry"))),
    ev.CheckpointFailed: Flow(
        "A checkpoint will never be READY.",
        (Producer("checkpoint-coordinator", "outbox"),),
        (Consumer("scheduler", "a final checkpoint that failed fails the job (checkpoint-missing)", "scheduler"),)),
    ev.CheckpointRefused: Flow(
        "A rank's restore verification refused a READY checkpoint.",
        (Producer("node-agent", _RELAYED + "; rank 0"),),
        (Consumer("checkpoint-coordinator", "marks it FAILED", "checkpoint-coordinator"),
         Consumer("registry", "retires the artifact", "registry"))),
    ev.EvaluationReported: Flow(
        "An evaluation job's numbers for the checkpoint it evaluated (its spec's initFrom); bounded: 1 to 32 "
        "finite metrics with plain names.",
        (Producer("node-agent", _RELAYED + "; rank 0 (`run.report_evaluation`)"),),
        (Consumer("registry", "attaches them to the checkpoint the evaluation job's spec names (ty:evals:<job>), "
                              "never to one the event names", "registry"),)),
    # metrics
    ev.StepMetrics: Flow(
        "One rank's numbers for one training step.",
        (Producer("node-agent", _RELAYED),),
        (Consumer("telemetry", "progress, step timing, metric history, goodput, calibration", "telemetry"),
         Consumer("scheduler", "straggler detection", "scheduler-metrics"),
         Consumer("checkpoint-coordinator", "checkpoint interval advice", "checkpoint-coordinator-measurements"))),
    # datasets
    ev.DatasetVersionPublished: Flow(
        "A dataset version's manifest is in place: register it.",
        (Producer("api", "outbox, on POST /v1/datasets (tenant: the caller's; manifestUri under its prefix)"),
         Producer("cli", "`trainyard dev data`"), Producer("upstream", "a data pipeline, after writing the files")),
        (Consumer("registry", "verifies the manifest and every shard against their sha256, then records the "
                              "version for its tenant (first publish wins); else DatasetRejected", "registry"),),
        public=True, key="{tenant}/{name}@{version} | {name}@{version}",
        example=ev.DatasetVersionPublished(
            event_id=_EXAMPLE_ID, occurred_at=_EXAMPLE_AT, name="wiki-en", version="2026-12-01",
            manifest_uri="file:///srv/trainyard/artifacts/datasets/wiki-en/2026-12-01/manifest.json",
            sha256="9f2b5c0e7a31d4c8b6e5f4a3d2c1b0a99f8e7d6c5b4a39281706f5e4d3c2b1a0", tokenizer="gpt2",
            num_tokens=1_250_000_000)),
    ev.DatasetRejected: Flow(
        "The registry refused a published version; it stays invisible and `reason` says why.",
        (Producer("registry", "outbox, with the rejection record, after verifying a DatasetVersionPublished"),),
        (Consumer("upstream", "the pipeline that published it learns why (also GET /v1/datasets/{ref})"),),
        public=True, key="{tenant}/{name}@{version} | {name}@{version}",
        example=ev.DatasetRejected(
            event_id=_EXAMPLE_ID, occurred_at=_EXAMPLE_AT, name="wiki-en", version="2026-12-01", tenant="acme",
            manifest_uri="file:///srv/trainyard/artifacts/tenants/acme/datasets/wiki-en/2026-12-01/manifest.json",
            sha256="9f2b5c0e7a31d4c8b6e5f4a3d2c1b0a99f8e7d6c5b4a39281706f5e4d3c2b1a0",
            reason="shard-00003.bin: sha256 differs from the manifest",
            problems=["shard-00003.bin: sha256 differs from the manifest"])),
    # registry (downstream)
    ev.ArtifactRegistered: Flow(
        "The registry recorded an artifact: a verified dataset version, a READY checkpoint, a finished "
        "job's model or an export of a checkpoint (kind `export`: a Hugging Face model directory, hash the "
        "sha256 of its trainyard-export.json listing), with its uri, hash and full lineage.",
        (Producer("registry", "outbox, with the record (an export's: with its ExportRecord ready)"),),
        (Consumer("api", "a new dataset version starts the jobs of the triggers that match it; a READY checkpoint "
                         "the evaluations of the checkpointReady triggers that watch its job", "api-triggers"),
         Consumer("downstream", "evaluates, serves or bills artifacts without reading internal topics; an "
                                "export loads with transformers' from_pretrained")),
        public=True, key="{jobId} | {artifactId}",
        example=ev.ArtifactRegistered(
            event_id=_EXAMPLE_ID, occurred_at=_EXAMPLE_AT, artifact_id="job-5f0c2a9e41d7/model/step-000002000-a2",
            kind="model",
            tenant="acme", job_id="job-5f0c2a9e41d7", global_step=2000, consumed_tokens=65_536_000,
            uri="file:///srv/trainyard/artifacts/tenants/acme/jobs/job-5f0c2a9e41d7/checkpoints/"
                "step-000002000-a2/manifest.json",
            hash="sha256:4a1d0c9b8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b",
            tensors_hash="sha256:7c2e9a41d0b8f6e3c5a7d9b1f0e2c4a6b8d0f2e4a6c8b0d2f4e6a8c0b2d4f6e8",
            lineage=ev.ArtifactLineage(
                spec_hash="0d1c2b3a4f5e6d7c8b9a0f1e2d3c4b5a6f7e8d9c0b1a2f3e4d5c6b7a8f9e0d1c",
                code_revision="v1.4.0", dataset="acme/wiki-en@2026-12-01",
                dataset_manifest_uri="file:///srv/trainyard/artifacts/tenants/acme/datasets/wiki-en/"
                                     "2026-12-01/manifest.json",
                dataset_sha256="9f2b5c0e7a31d4c8b6e5f4a3d2c1b0a99f8e7d6c5b4a39281706f5e4d3c2b1a0",
                tokenizer="gpt2", model_config_ref="gpt-small@v1",
                parent_checkpoint="file:///srv/trainyard/artifacts/tenants/acme/jobs/job-5f0c2a9e41d7/"
                                  "checkpoints/step-000001500-a1/manifest.json"))),
    ev.ArtifactRetired: Flow(
        "An artifact stopped being loadable (retention deleted its checkpoint, or a restore refused it).",
        (Producer("registry", "outbox, with the retirement"),),
        (Consumer("downstream", "stops serving or evaluating it"),),
        public=True, key="{jobId} | {artifactId}",
        example=ev.ArtifactRetired(
            event_id=_EXAMPLE_ID, occurred_at=_EXAMPLE_AT, artifact_id="job-5f0c2a9e41d7/checkpoint/step-000001500-a1",
            kind="checkpoint", tenant="acme", job_id="job-5f0c2a9e41d7",
            uri="file:///srv/trainyard/artifacts/tenants/acme/jobs/job-5f0c2a9e41d7/checkpoints/"
                "step-000001500-a1/manifest.json",
            hash="sha256:7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d",
            reason="checkpoint step-000001500-a1 deleted by retention: keepLast=3")),
    ev.ExportFailed: Flow(
        "An export could not be made: its checkpoint is retired, fails verification against its manifest, "
        "or cannot be converted; `reason` says which and no directory is left.",
        (Producer("registry", "outbox, with the ExportRecord failed, after an ExportRequested"),),
        (Consumer("downstream", "the service waiting for the export learns why (the API shows the same "
                                "reason: GET /v1/registry/artifacts/{exportId}, `trainyard export`)"),),
        public=True, key="{jobId}",
        example=ev.ExportFailed(
            event_id=_EXAMPLE_ID, occurred_at=_EXAMPLE_AT, export_id="job-5f0c2a9e41d7/export/step-000002000-a2/hf",
            checkpoint_artifact_id="job-5f0c2a9e41d7/checkpoint/step-000002000-a2", job_id="job-5f0c2a9e41d7",
            tenant="acme", format="hf",
            reason="checkpoint verification failed: rank-00001.distcp: sha256 differs from the manifest",
            problems=["rank-00001.distcp: sha256 differs from the manifest"])),
    # exports
    ev.ExportRequested: Flow(
        "Convert a READY checkpoint into another format (`hf`: a Hugging Face model directory).",
        (Producer("api", "outbox, on POST /v1/registry/artifacts/{id}/export, with the ExportRecord requested"),
         Producer("registry", "outbox, with the model artifact of a job whose spec says export "
                              "(requestedBy `spec`)")),
        (Consumer("registry", "verifies the checkpoint, converts it (trainyard-export) and records an export "
                              "artifact (ArtifactRegistered kind export), else ExportFailed", "registry-exports"),),
        key="{jobId}",
        example=ev.ExportRequested(
            event_id=_EXAMPLE_ID, occurred_at=_EXAMPLE_AT, export_id="job-5f0c2a9e41d7/export/step-000002000-a2/hf",
            checkpoint_artifact_id="job-5f0c2a9e41d7/checkpoint/step-000002000-a2", job_id="job-5f0c2a9e41d7",
            tenant="acme", format="hf", requested_by="tok_3f2a9c1b7e4d")),
    # dead letters
    ev.DeadLetter: Flow(
        "A message a consumer could not decode or validate, kept with where it came from.",
        _sends("its bus, for a message its handler refused", "api", "scheduler", "checkpoint-coordinator",
               "registry") + (Producer("node-agent", "its bus; and spool lines it could not read"),),
        (Consumer("operators", "none in code: for operators and tests"),),
        key="{sourceTopic}/{partition}/{offset}"),
}

TOPICS: dict[str, str] = {
    ev.JOBS: "Job lifecycle: submissions, control requests and state changes.",
    ev.NODES: "Node inventory and administration: heartbeats, quarantine, drain.",
    ev.ALLOCATIONS: "What the scheduler tells node agents: placements, checkpoint requests, revocations.",
    ev.WORKERS: "What happens to ranks: started, exited, stragglers, security violations.",
    ev.CHECKPOINTS: "Checkpoint shards, and checkpoints becoming READY, failing or refused.",
    ev.METRICS: "Per-step training metrics from every rank.",
    ev.DATASETS: "Dataset versions published for training, and the registry's refusals.",
    ev.REGISTRY: "What the registry recorded and retired: the public feed of artifacts for downstream services "
                 "(and the exports it could not make).",
    ev.EXPORTS: "Requests to convert a READY checkpoint into another format (a Hugging Face model directory).",
    ev.DEADLETTER: "Messages a consumer refused.",
}
"""A line about each topic, for its channel."""

# ----------------------------------------------------------------------------- the document

ENVELOPE: dict[str, str] = {
    "eventId": "uuid of this event; consumers deduplicate by it (at-least-once delivery)",
    "eventType": "the event's name, the discriminator among the events of a topic",
    "schemaVersion": "1 so far; changes are additive, a breaking change is a new event name",
    "occurredAt": "when it happened (UTC, RFC 3339)",
}

DESCRIPTION = f"""\
The events trainyard's services exchange over Kafka, and the ones clients outside trainyard publish
(`DatasetVersionPublished`) and follow (`JobStateChanged`, and the registry's feed on `trainyard.registry`:
`ArtifactRegistered`, `ArtifactRetired`, `ExportFailed`); messages tagged `public` are those.

* **Encoding**: one JSON object per message (`{CONTENT_TYPE}`), camelCase field names. Every event
  carries {", ".join(f"`{k}`" for k in ENVELOPE)}.
* **Keys**: the Kafka key is the partition key in each message's kafka binding: the job id for job
  events, the node id for node events (`name@version` for datasets; on the registry's feed the job id, or
  the dataset's ref), so per-job order holds within a topic.
* **Headers**: `content-type`, and the W3C trace context (`traceparent`, `tracestate`) of the span that
  published it; a consumer that continues the trace extracts it.
* **Delivery**: at least once. Consumers commit after handling, deduplicate by `eventId` and ignore
  unknown fields; each consumer has its own group.
* **Evolution**: changes are additive (new optional fields); a breaking change is a new event name.
* **Topic names**: `TRAINYARD_TOPIC_NAMESPACE` prefixes every address (empty in production); consumer
  groups start with `TRAINYARD_GROUP_PREFIX` (`trainyard`).

Generated from libs/contract/src/trainyard_contract/events.py and asyncapi.py (`{REGENERATE}`);
docs/integration.md shows how to publish and consume.
"""


class _Schema(GenerateJsonSchema):
    """Pydantic's JSON Schema without the titles it makes up from field names ("Eventid")."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def channel_id(topic: str) -> str:
    return topic.removeprefix("trainyard.")


def event_name(cls: type[ev.Event]) -> str:
    return str(cls.model_fields["event_type"].default)


def key_templates(cls: type[ev.Event]) -> list[str]:
    """The partition key as templates over the payload's fields (what ``Event.key()`` returns): the
    first whose fields are all set in the payload applies."""
    return [t.strip() for t in key_template(cls).split("|")]


def key_template(cls: type[ev.Event]) -> str:
    """The partition key as a template over the payload's fields; "a | b": a, else b (see key_templates)."""
    flow = FLOWS[cls]
    if cls.key is not ev.Event.key:
        if flow.key is None:
            raise ValueError(f"{cls.__name__} overrides key(): say its key in contract.FLOWS")
        return flow.key
    if "job_id" in cls.model_fields:
        return "{jobId}"
    if "node_id" in cls.model_fields:
        return "{nodeId}"
    raise ValueError(f"{cls.__name__} has neither jobId nor nodeId: it needs its own key()")


def _payload_schemas(classes: Iterable[type[ev.Event]]) -> dict[str, Any]:
    _, top = models_json_schema([(c, "validation") for c in classes], by_alias=True,
                                ref_template="#/components/schemas/{model}", schema_generator=_Schema)
    schemas: dict[str, Any] = top.get("$defs", {})
    _drop_openapi_discriminators(schemas)
    for cls in classes:
        schema = schemas[cls.__name__]
        for field, text in ENVELOPE.items():
            schema["properties"][field]["description"] = text
        # trainyard always sends the envelope; a producer that left eventId out would defeat deduplication
        schema["required"] = [*ENVELOPE, *(f for f in schema.get("required", []) if f not in ENVELOPE)]
    return dict(sorted(schemas.items()))


def _drop_openapi_discriminators(node: Any) -> None:
    """Pydantic writes OpenAPI's discriminator object; AsyncAPI's is a property name (``oneOf`` stays)."""
    if isinstance(node, dict):
        if isinstance(node.get("discriminator"), dict) and "propertyName" in node["discriminator"]:
            del node["discriminator"]
        for value in node.values():
            _drop_openapi_discriminators(value)
    elif isinstance(node, list):
        for value in node:
            _drop_openapi_discriminators(value)


def _headers_schema() -> dict[str, Any]:
    trace_fields = sorted(TraceContextTextMapPropagator().fields)  # traceparent, tracestate
    descriptions = {
        "traceparent": "W3C trace context of the publishing span (version-traceid-spanid-flags)",
        "tracestate": "W3C vendor trace state, when the publishing span has one",
    }
    props: dict[str, Any] = {"content-type": {"type": "string", "const": CONTENT_TYPE}}
    for name in trace_fields:
        props[name] = {"type": "string", "description": descriptions.get(name, "W3C trace context")}
    props["traceparent"]["pattern"] = "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
    return {"type": "object", "description": "Kafka record headers (UTF-8 strings).", "properties": props}


def _parties(flow: Flow) -> dict[str, list[dict[str, str]]]:
    return {
        "x-publishers": [{"party": p.party, "how": p.how} for p in flow.producers],
        "x-consumers": [{"party": c.party, "does": c.does} | ({"group": f"trainyard.{c.group}"} if c.group else {})
                        for c in flow.consumers],
    }


def _message(cls: type[ev.Event], flow: Flow) -> dict[str, Any]:
    name = event_name(cls)
    keys = key_templates(cls)
    who = "; ".join(f"{p.party} ({p.how})" for p in flow.producers) or "nobody"
    whom = "; ".join(f"{c.party} ({c.does})" for c in flow.consumers) or "nobody"
    description = f"Published by: {who}.\n\nConsumed by: {whom}."
    if flow.unused:
        description += f"\n\nUnused: {flow.unused}."
    return {
        "name": name,
        "title": name,
        "summary": flow.summary,
        "description": description,
        "contentType": CONTENT_TYPE,
        "tags": [{"name": "public" if flow.public else "internal"}],
        "headers": {"$ref": "#/components/schemas/Headers"},
        "payload": {"$ref": f"#/components/schemas/{cls.__name__}"},
        "bindings": {"kafka": {
            "key": {"type": "string", "description": "partition key: " + ", else ".join(f"`{k}`" for k in keys),
                    "x-templates": keys},
            "bindingVersion": KAFKA_BINDING,
        }},
        **({"examples": [_example(flow.example)]} if flow.example is not None else {}),
        **_parties(flow),
    }


def _example(event: ev.Event) -> dict[str, Any]:
    return {
        "name": f"{event.event_type}-example",
        "summary": f"key `{event.key()}`",
        "headers": {"content-type": CONTENT_TYPE,
                    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        "payload": json.loads(event.to_bytes()),
    }


def _channel(topic: str, classes: tuple[type[ev.Event], ...], partitions: int) -> dict[str, Any]:
    return {
        "address": topic,
        "title": topic,
        "description": TOPICS[topic],
        "messages": {event_name(c): {"$ref": f"#/components/messages/{event_name(c)}"} for c in classes},
        "bindings": {"kafka": {"partitions": partitions, "bindingVersion": KAFKA_BINDING}},
    }


def _operations(topic_events: dict[str, tuple[type[ev.Event], ...]]) -> dict[str, Any]:
    """A send operation per (publisher, topic), a receive operation per (consumer, topic, consumer group): a
    party reading a topic in a second group has a second operation, its id ending in that group's name."""
    ops: dict[str, dict[str, Any]] = {}
    groups: dict[str, str | None] = {}
    for topic, classes in topic_events.items():
        cid = channel_id(topic)
        for cls in classes:
            flow = FLOWS[cls]
            ref = {"$ref": f"#/channels/{cid}/messages/{event_name(cls)}"}
            for p in flow.producers:
                op = ops.setdefault(f"{p.party}.send.{cid}", _operation("send", p.party, cid, topic))
                op["messages"].append(ref)
            for c in flow.consumers:
                op_id = f"{c.party}.receive.{cid}"
                if groups.setdefault(op_id, c.group) != c.group:  # a second group of the party's on the topic
                    op_id = f"{op_id}.{(c.group or '').removeprefix(c.party + '-')}"
                    groups.setdefault(op_id, c.group)
                op = ops.setdefault(op_id, _operation("receive", c.party, cid, topic))
                op["messages"].append(ref)
                if c.group:
                    op["bindings"] = {"kafka": {"groupId": _group_schema(c.group), "bindingVersion": KAFKA_BINDING}}
    return dict(sorted(ops.items()))


def _group_schema(group: str) -> dict[str, Any]:
    """The consumer group (default prefix): a constant, or a pattern when it names the node."""
    full = f"trainyard.{group}"
    if "{" not in full:
        return {"type": "string", "const": full}
    prefix = full.split("{", 1)[0]
    return {"type": "string", "pattern": "^" + prefix.replace(".", "\\.") + ".+$", "description": f"`{full}`"}


def _operation(action: str, party: str, cid: str, topic: str) -> dict[str, Any]:
    verb = "publishes to" if action == "send" else "consumes"
    return {
        "action": action,
        "channel": {"$ref": f"#/channels/{cid}"},
        "title": f"{party} {verb} {topic}",
        "tags": [{"$ref": f"#/components/tags/{party}"}],
        "messages": [],
    }


def asyncapi(
    topic_events: dict[str, tuple[type[ev.Event], ...]] | None = None, *, partitions: int | None = None
) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``topic_events`` (default: every topic of ``events.TOPIC_EVENTS``)."""
    topic_events = ev.TOPIC_EVENTS if topic_events is None else topic_events
    partitions = partitions or ServiceSettings.model_fields["topic_partitions"].default
    classes = [cls for cs in topic_events.values() for cls in cs]
    missing = [c.__name__ for c in classes if c not in FLOWS]
    if missing:
        raise ValueError(f"contract.FLOWS does not say who publishes and consumes {', '.join(missing)}")
    if undescribed := [t for t in topic_events if t not in TOPICS]:
        raise ValueError(f"contract.TOPICS has no line about {', '.join(undescribed)}")
    parties = sorted({*SERVICES, *OUTSIDE})
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "trainyard events",
            "version": "1.0.0",
            "description": DESCRIPTION,
            "tags": [{"name": "public", "description": "supported for clients outside trainyard"},
                     {"name": "internal", "description": "between trainyard's own services"}],
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": {"local": {
            "host": "{bootstrap}",
            "protocol": "kafka",
            "description": "the broker named by TRAINYARD_KAFKA_BOOTSTRAP (the local stack's tansu by default); "
                           "TRAINYARD_KAFKA_SECURITY_PROTOCOL may require SASL or TLS",
            "variables": {"bootstrap": {"default": "127.0.0.1:9092", "description": "host:port"}},
        }},
        "channels": {channel_id(t): _channel(t, cs, partitions) for t, cs in topic_events.items()},
        "operations": _operations(topic_events),
        "components": {
            "schemas": {"Headers": _headers_schema(), **_payload_schemas(classes)},
            "messages": {event_name(c): _message(c, FLOWS[c]) for c in classes},
            "tags": {p: {"name": p, "description": SERVICES.get(p) or OUTSIDE[p]} for p in parties},
        },
    }


HEADER = f"# The trainyard event contract (AsyncAPI {ASYNCAPI_VERSION}). Generated, do not edit: {REGENERATE}\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so the descriptions read as they were written; no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def to_yaml(document: dict[str, Any]) -> str:
    return HEADER + yaml.dump(document, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=110)


@functools.cache
def asyncapi_yaml() -> str:
    """The document of every topic, as YAML (what docs/asyncapi.yaml holds)."""
    return to_yaml(asyncapi())


@functools.cache
def asyncapi_json() -> str:
    return json.dumps(asyncapi(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainyard_contract.asyncapi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="JSON instead of YAML")
    args = parser.parse_args(argv)
    sys.stdout.write(asyncapi_json() if args.json else asyncapi_yaml())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
