"""The event contract: envelopes, wire format, decoding per topic."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from trainyard_contract import events as ev
from trainyard_contract.spec import TrainingSpec
from tests.unit.trainyard_contract.test_spec import BASE


def test_every_event_class_belongs_to_its_topic_and_roundtrips() -> None:
    spec = TrainingSpec.model_validate(BASE)
    samples = [
        ev.JobSubmitted(job_id="j", tenant="t", spec=spec, spec_hash=spec.spec_hash()),
        ev.JobStateChanged(job_id="j", tenant="t", state="running", previous_state="queued"),
        ev.NodeHeartbeat(node_id="n", host="h", devices=[ev.DeviceInfo(index=0, type="cpu", memory_bytes=1)]),
        ev.ShardWritten(job_id="j", tenant="t", attempt=1, epoch=1, global_step=10, rank=0, world_size=2,
                        uri="file:///x", size_bytes=3, sha256="a" * 64),
        ev.StepMetrics(job_id="j", attempt=1, rank=0, step=1, loss=2.5, consumed_tokens=100),
    ]
    for event in samples:
        decoded = ev.decode_event(event.topic, event.to_bytes())
        assert decoded == event
        assert type(event) in ev.TOPIC_EVENTS[event.topic]


def test_wire_is_camel_case_with_envelope() -> None:
    raw = json.loads(ev.StepMetrics(job_id="j", attempt=1, rank=0, step=1, loss=1.0, consumed_tokens=5).to_bytes())
    for key in ("eventId", "eventType", "schemaVersion", "occurredAt", "jobId", "consumedTokens"):
        assert key in raw
    assert raw["eventType"] == "StepMetrics"


def test_unknown_fields_are_ignored_for_additive_evolution() -> None:
    raw = json.loads(ev.JobStateChanged(job_id="j", tenant="t", state="failed").to_bytes())
    raw["someFutureField"] = {"x": 1}
    decoded = ev.decode_event(ev.JOBS, json.dumps(raw).encode())
    assert decoded.state == "failed"


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"{}", b'{"eventType":"NoSuchEvent"}', b'{"eventType":"JobStateChanged","jobId":"j"}',
     ev.StepMetrics(job_id="j", attempt=1, rank=0, step=1, loss=1.0, consumed_tokens=5).to_bytes()],
)
def test_invalid_or_foreign_messages_raise(raw: bytes) -> None:
    with pytest.raises((ValidationError, ValueError)):
        ev.decode_event(ev.JOBS, raw)


def test_keys_are_job_or_node_ids() -> None:
    assert ev.AllocationRevoked(job_id="j1", attempt=1, allocation_id="a", epoch=1, reason="x").key() == "j1"
    assert ev.NodeQuarantined(node_id="n7", reason="x").key() == "n7"
