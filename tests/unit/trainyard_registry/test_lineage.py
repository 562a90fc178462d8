"""Registry record building: artifact ids, lineage, datasets."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_contract.events import CheckpointReady, CheckpointRef, DatasetVersionPublished
from trainyard_contract.records import AttemptRecord, CheckpointRecord, DatasetRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_registry.lineage import (
    artifact_id,
    artifact_lineage,
    build_lineage,
    checkpoint_artifact,
    dataset_conflict,
    dataset_from_manifest,
    dataset_record,
    model_artifact,
    model_config_ref,
    ready_mismatch,
    registered,
    tokenizer_ref,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
PARENT = "file:///art/tenants/t/jobs/j/checkpoints/step-000000020-a1/manifest.json"
MANIFEST = "file:///art/tenants/t/jobs/j/checkpoints/step-000000040-a2/manifest.json"

SPEC = {
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "abc123",
    "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
    "checkpointPolicy": {"everySteps": 20, "keepLast": 3},
    "training": {"sequenceLength": 64, "microBatchSize": 8, "globalBatchSize": 32, "learningRate": 0.003,
                 "maxSteps": 40},
}


def job(**spec_overrides: object) -> JobRecord:
    spec = TrainingSpec.model_validate(SPEC | spec_overrides)
    return JobRecord(
        job_id="j", tenant="t", spec=spec, spec_hash=spec.spec_hash(), state="running",
        attempts=[
            AttemptRecord(attempt=1, allocation_id="a1", epoch=1, world_size=2),
            AttemptRecord(attempt=2, allocation_id="a2", epoch=2, world_size=2,
                          start_checkpoint=CheckpointRef(manifest_uri=PARENT, global_step=20, attempt=1)),
        ],
    )


DATASET = DatasetRecord(name="tinycorpus", version="v1",
                        manifest_uri="file:///art/datasets/tinycorpus/v1/manifest.json",
                        sha256="d" * 64, tokenizer="byte-bpe@v1")


def ready(attempt: int = 2, step: int = 40) -> CheckpointReady:
    return CheckpointReady(job_id="j", tenant="t", attempt=attempt, epoch=2, global_step=step, world_size=2,
                           manifest_uri=MANIFEST, content_hash="sha256:" + "c" * 64, consumed_tokens=81920)


def test_artifact_ids_are_deterministic() -> None:
    assert artifact_id("j", "checkpoint", 40, 1) == "j/checkpoint/step-000000040-a1"
    assert artifact_id("j", "model", 40, 2) == "j/model/step-000000040-a2"


def test_checkpoint_artifact_carries_the_whole_lineage() -> None:
    record = checkpoint_artifact(job(), ready(), DATASET, now=NOW)
    assert record.artifact_id == "j/checkpoint/step-000000040-a2"
    assert (record.type, record.uri, record.hash) == ("checkpoint", MANIFEST, "sha256:" + "c" * 64)
    assert (record.producer_attempt, record.global_step, record.consumed_tokens) == (2, 40, 81920)
    lin = record.lineage
    assert lin.spec_hash == job().spec_hash and lin.code_revision == "abc123"
    assert (lin.dataset, lin.dataset_manifest_uri, lin.dataset_sha256) == (
        "tinycorpus@v1", DATASET.manifest_uri, "d" * 64)
    assert lin.tokenizer == "byte-bpe@v1" and lin.model_config_ref == "gpt-tiny@v1"
    assert lin.parent_checkpoint == PARENT  # attempt 2 resumed from step 20


def test_a_fresh_attempt_has_no_parent_and_a_missing_dataset_leaves_its_hash_empty() -> None:
    lin = build_lineage(job(), 1, None)
    assert lin.parent_checkpoint is None
    assert lin.dataset == "tinycorpus@v1" and lin.dataset_sha256 is None and lin.tokenizer is None


def test_lineage_records_the_code_a_job_ran_and_nothing_new_without_code() -> None:
    code = {"archive": "sha256:" + "e" * 64, "commit": "f" * 40, "dirty": True, "entrypoint": ["python", "t.py"]}
    lin = checkpoint_artifact(job(code=code), ready(), DATASET, now=NOW).lineage
    assert (lin.code_archive, lin.code_commit) == ("sha256:" + "e" * 64, "f" * 40)
    uploaded = build_lineage(job(code={"archive": "sha256:" + "e" * 64, "entrypoint": ["python"]}), 1, None)
    assert (uploaded.code_archive, uploaded.code_commit) == ("sha256:" + "e" * 64, None)
    plain = build_lineage(job(), 1, DATASET)
    assert plain.code_archive is None and plain.code_commit is None
    assert not {"codeArchive", "codeCommit"} & set(plain.model_dump(by_alias=True))  # the stored JSON is as before


def test_inline_model_config_is_named_by_its_hash() -> None:
    inline = MODEL_CATALOG["gpt-tiny@v1"].model_dump(by_alias=True)
    ref = model_config_ref(job(modelConfig=inline).spec)
    assert ref.startswith("inline:sha256:") and len(ref) == len("inline:sha256:") + 64
    assert ref == model_config_ref(job(modelConfig=dict(inline)).spec)


def test_model_artifact_points_at_the_latest_ready_checkpoint() -> None:
    ckpt = CheckpointRecord(job_id="j", tenant="t", attempt=2, epoch=2, global_step=40, world_size=2,
                            state="READY", manifest_uri=MANIFEST, content_hash="sha256:" + "c" * 64,
                            consumed_tokens=81920)
    model = model_artifact(job(), ckpt, DATASET, now=NOW)
    assert model.artifact_id == "j/model/step-000000040-a2" and model.type == "model"
    assert (model.uri, model.hash, model.producer_attempt) == (MANIFEST, ckpt.content_hash, 2)
    assert model.lineage == checkpoint_artifact(job(), ready(), DATASET, now=NOW).lineage
    with pytest.raises(ValueError):
        model_artifact(job(), ckpt.model_copy(update={"state": "PENDING"}), DATASET, now=NOW)


@pytest.mark.parametrize(
    ("record_update", "problem"),
    [(None, None),
     ({"state": "PENDING"}, "PENDING"),
     ({"content_hash": "sha256:other"}, "differs"),
     ({"tenant": "other"}, "tenant")],
)
def test_ready_mismatch(record_update: dict | None, problem: str | None) -> None:
    record = CheckpointRecord(job_id="j", tenant="t", attempt=2, epoch=2, global_step=40, world_size=2,
                              state="READY", manifest_uri=MANIFEST, content_hash="sha256:" + "c" * 64)
    if record_update:
        record = record.model_copy(update=record_update)
    found = ready_mismatch(ready(), record)
    assert found is None if problem is None else problem in (found or "")
    assert "no checkpoint record" in (ready_mismatch(ready(), None) or "")


def test_dataset_republish() -> None:
    event = DatasetVersionPublished(name="tinycorpus", version="v1", manifest_uri=DATASET.manifest_uri,
                                    sha256="d" * 64, tokenizer="byte-bpe@v1", num_tokens=1000)
    first = dataset_record(event, now=NOW)
    assert first.ref == "tinycorpus@v1" and first.num_tokens == 1000
    same = dataset_record(event.model_copy(update={"tokenizer": None}), now=NOW)
    assert dataset_conflict(first, same) is None
    other = dataset_record(event.model_copy(update={"sha256": "e" * 64}), now=NOW)
    assert "refused" in (dataset_conflict(first, other) or "")


def test_a_verified_manifest_says_what_a_dataset_is_whatever_the_event_claims() -> None:
    event = DatasetVersionPublished(name="corpus", version="v1", tenant="acme", manifest_uri=DATASET.manifest_uri,
                                    sha256="d" * 64, tokenizer="what-i-say@v1", num_tokens=1)
    manifest = {"numTokens": 123_456, "dtype": "uint32",
                "tokenizer": {"file": "tokenizer.json", "vocabSize": 70_000, "version": "bpe70000-0123456789ab"}}
    record = dataset_record(event, now=NOW, manifest=manifest)
    assert (record.num_tokens, record.tokenizer, record.vocab_size, record.dtype) == (
        123_456, "bpe70000-0123456789ab", 70_000, "uint32")
    bare = dataset_record(event, now=NOW, manifest={"tokenizer": {"vocabSize": True}})  # nothing usable in it
    assert (bare.num_tokens, bare.tokenizer, bare.vocab_size, bare.dtype) == (1, "what-i-say@v1", None, None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("byte-bpe@v1", "byte-bpe@v1"), ({"name": "bpe", "version": "v2"}, "bpe@v2"), ({"name": "bpe"}, "bpe"),
     ({"id": "tok-1"}, "tok-1"), (None, None), (3, None), ({}, None)],
)
def test_tokenizer_ref(value: object, expected: str | None) -> None:
    assert tokenizer_ref(value) == expected


def test_dataset_from_manifest() -> None:
    record = dataset_from_manifest("tinycorpus@v1", DATASET.manifest_uri, "f" * 64,
                                   {"tokenizer": {"name": "byte-bpe", "version": "v1"}, "numTokens": 99}, now=NOW)
    assert (record.name, record.version, record.sha256, record.tokenizer, record.num_tokens) == (
        "tinycorpus", "v1", "f" * 64, "byte-bpe@v1", 99)


def test_a_job_started_from_a_hugging_face_directory_names_it_in_every_artifact_and_others_do_not() -> None:
    from trainyard_contract.records import HuggingFaceStart

    started = job(initFrom={"huggingFace": "models/tiny"}).model_copy(update={"hugging_face_start": HuggingFaceStart(
        directory="models/tiny", uri="file:///art/tenants/t/models/tiny", config_sha256="a" * 64,
        weight_files={"model.safetensors": 1024})})
    for attempt in (1, 2):  # the fresh start and the attempt that resumed from the job's own checkpoint
        assert build_lineage(started, attempt, DATASET).parent_hugging_face == "file:///art/tenants/t/models/tiny"
    assert artifact_lineage(build_lineage(started, 1, DATASET)).parent_hugging_face == (
        "file:///art/tenants/t/models/tiny")
    plain = build_lineage(job(), 1, DATASET)
    assert plain.parent_hugging_face is None and "parentHuggingFace" not in plain.model_dump(by_alias=True)


def test_checkpoint_and_model_artifacts_and_their_announcement_carry_the_tensors_hash() -> None:
    tensors = "sha256:" + "7" * 64
    with_values = ready().model_copy(update={"tensors_hash": tensors})
    checkpoint = checkpoint_artifact(job(), with_values, DATASET, now=NOW)
    assert (checkpoint.hash, checkpoint.tensors_hash) == ("sha256:" + "c" * 64, tensors)
    ckpt = CheckpointRecord(job_id="j", tenant="t", attempt=2, epoch=2, global_step=40, world_size=2, state="READY",
                            manifest_uri=MANIFEST, content_hash="sha256:" + "c" * 64, tensors_hash=tensors)
    model = model_artifact(job(), ckpt, DATASET, now=NOW)
    assert model.tensors_hash == tensors
    announced = registered(model, now=NOW)
    assert (announced.hash, announced.tensors_hash) == (model.hash, tensors)
    # a checkpoint whose ranks reported no entries: no tensors hash anywhere, the content hash as before
    older = checkpoint_artifact(job(), ready(), DATASET, now=NOW)
    assert older.tensors_hash is None and registered(older, now=NOW).tensors_hash is None
