"""The registry's public feed (trainyard.registry): what an artifact record announces (pure)."""

from __future__ import annotations

import json
from uuid import UUID

import pytest

from trainyard_contract import events as ev
from trainyard_contract.records import JobRecord, Lineage
from trainyard_contract.spec import Code
from trainyard_registry.lineage import (
    artifact_lineage,
    build_lineage,
    checkpoint_artifact,
    model_artifact,
    registered,
    retire,
    retired_notice,
    retirements,
)
from tests.unit.trainyard_registry.test_lineage import DATASET, MANIFEST, NOW, PARENT, job, ready
from tests.unit.trainyard_registry.test_retirement import LATER, record

EVENT_ID = UUID("00000000-0000-4000-8000-000000000001")


def code_job() -> JobRecord:
    return job(code=Code(archive="sha256:" + "a" * 64, commit="0123abc" + "0" * 33, entrypoint=["python", "train.py"])
               .model_dump(mode="json", by_alias=True))


@pytest.mark.parametrize("lineage", [
    build_lineage(job(), 2, DATASET),       # resumed, registered dataset, built-in trainer
    build_lineage(job(), 1, None),          # fresh start, dataset unknown: its hash stays empty
    build_lineage(code_job(), 2, DATASET),  # user code: archive and commit
], ids=["resumed", "fresh-no-dataset", "user-code"])
def test_the_lineage_travels_whole_and_reads_like_the_records_json(lineage: Lineage) -> None:
    wire = artifact_lineage(lineage)
    assert set(ev.ArtifactLineage.model_fields) == set(Lineage.model_fields)  # nothing dropped on the way
    for name in Lineage.model_fields:
        assert getattr(wire, name) == getattr(lineage, name), name
    # what a follower reads on the feed is what GET /v1/registry/artifacts shows (absent fields are null)
    record_json = json.loads(lineage.model_dump_json(by_alias=True))
    wire_json = json.loads(wire.model_dump_json(by_alias=True))
    assert {k: v for k, v in wire_json.items() if v is not None} == {k: v for k, v in record_json.items()
                                                                      if v is not None}


def test_a_checkpoint_artifact_announces_its_identity_uri_hash_and_lineage() -> None:
    artifact = checkpoint_artifact(job(), ready(), DATASET, now=NOW)
    event = registered(artifact, now=LATER, event_id=EVENT_ID)
    assert (event.event_id, event.occurred_at, event.kind) == (EVENT_ID, LATER, "checkpoint")
    assert (event.artifact_id, event.tenant, event.job_id) == ("j/checkpoint/step-000000040-a2", "t", "j")
    assert (event.uri, event.hash) == (MANIFEST, "sha256:" + "c" * 64)
    assert (event.global_step, event.consumed_tokens) == (40, 81920)
    assert event.lineage is not None and event.lineage.parent_checkpoint == PARENT
    assert event.lineage.dataset_sha256 == "d" * 64 and event.tokenizer == "byte-bpe@v1"
    assert event.dataset is None and event.shared_with == []  # those describe datasets
    assert event.key() == "j"  # per-job order on the feed
    assert ev.decode_event(ev.REGISTRY, event.to_bytes()) == event


def test_a_model_artifact_is_announced_as_a_model() -> None:
    checkpoint = record("READY")
    event = registered(model_artifact(job(), checkpoint, DATASET, now=NOW), now=NOW)
    assert (event.kind, event.artifact_id) == ("model", "j/model/step-000000040-a2")
    assert (event.uri, event.hash) == (checkpoint.manifest_uri, checkpoint.content_hash)
    assert isinstance(event.event_id, UUID)


def test_a_retirement_announces_the_artifact_and_why() -> None:
    artifact = checkpoint_artifact(job(), ready(), DATASET, now=NOW)
    retired = retire(artifact, "checkpoint step-000000040-a2 deleted by retention: keepLast 3", now=LATER)
    assert retired is not None
    event = retired_notice(retired, now=LATER, event_id=EVENT_ID)
    assert (event.event_id, event.occurred_at, event.kind) == (EVENT_ID, LATER, "checkpoint")
    assert (event.artifact_id, event.tenant, event.job_id) == (artifact.artifact_id, "t", "j")
    assert (event.uri, event.hash) == (artifact.uri, artifact.hash)
    assert event.reason == "checkpoint step-000000040-a2 deleted by retention: keepLast 3"
    assert ev.decode_event(ev.REGISTRY, event.to_bytes()) == event


def test_a_retirement_by_retention_says_the_policy_once() -> None:
    (changed,) = retirements([checkpoint_artifact(job(), ready(), DATASET, now=NOW)],
                             [record("DELETED", reason="retention: keepLast=3")], now=LATER)
    assert changed.retired_reason == "checkpoint step-000000040-a2 deleted by retention: keepLast=3"


def test_a_live_artifact_has_no_retirement_to_announce() -> None:
    with pytest.raises(ValueError, match="not retired"):
        retired_notice(checkpoint_artifact(job(), ready(), DATASET, now=NOW), now=NOW)
