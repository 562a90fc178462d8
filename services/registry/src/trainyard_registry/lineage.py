"""Pure registry decisions: artifact ids, lineage, artifact and dataset records.

No Redis, Kafka, clock or filesystem here; the shell (``registry.py``) loads the job,
the dataset and the checkpoint record and passes them in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal
from uuid import UUID, uuid4

from trainyard_contract.events import ArtifactRegistered, CheckpointReady, DatasetRejected, DatasetVersionPublished
from trainyard_contract.records import (
    ArtifactRecord,
    CheckpointRecord,
    DatasetRecord,
    DatasetRejection,
    JobRecord,
    Lineage,
    checkpoint_id,
)
from trainyard_contract.records import dataset_conflict as _version_conflict
from trainyard_contract.events import ArtifactLineage, ArtifactRetired
from trainyard_contract.spec import DatasetRef, TrainingSpec, canonical_json

from trainyard_registry.verification import MAX_PROBLEMS, rejection_reason

ArtifactType = Literal["checkpoint", "model"]


def artifact_id(job_id: str, kind: ArtifactType, global_step: int, attempt: int) -> str:
    """Deterministic, so a re-delivered event records nothing new: ``<job>/checkpoint/step-000000040-a1``."""
    return f"{job_id}/{kind}/{checkpoint_id(global_step, attempt)}"


def model_config_ref(spec: TrainingSpec) -> str:
    """The catalog reference, or ``inline:sha256:…`` of an inline model configuration."""
    ref = spec.model_config_ref
    if isinstance(ref, str):
        return ref
    digest = hashlib.sha256(canonical_json(ref.model_dump(mode="json", by_alias=True))).hexdigest()
    return f"inline:sha256:{digest}"


def build_lineage(job: JobRecord, producer_attempt: int, dataset: DatasetRecord | None) -> Lineage:
    """Where an artifact of ``job`` made by ``producer_attempt`` came from.

    The parent checkpoint is the manifest that attempt started from (None for a fresh start); the
    code archive and commit are the job's own code (None when it ran the built-in trainer).
    """
    attempt = next((a for a in job.attempts if a.attempt == producer_attempt), None)
    start = attempt.start_checkpoint if attempt else None
    code = job.spec.code
    return Lineage(
        spec_hash=job.spec_hash,
        code_revision=job.spec.code_revision,
        dataset=job.spec.dataset,
        dataset_manifest_uri=dataset.manifest_uri if dataset else None,
        dataset_sha256=dataset.sha256 if dataset else None,
        tokenizer=dataset.tokenizer if dataset else None,
        model_config_ref=model_config_ref(job.spec),
        parent_checkpoint=start.manifest_uri if start else None,
        code_archive=code.archive if code else None,
        code_commit=code.commit if code else None,
        parent_hugging_face=job.hugging_face_start.uri if job.hugging_face_start else None,
        environment=code.environment.sha256 if code and code.environment else None,
    )


def checkpoint_artifact(
    job: JobRecord, ready: CheckpointReady, dataset: DatasetRecord | None, *, now: datetime
) -> ArtifactRecord:
    """The artifact of one READY checkpoint."""
    return ArtifactRecord(
        artifact_id=artifact_id(job.job_id, "checkpoint", ready.global_step, ready.attempt),
        job_id=job.job_id,
        tenant=job.tenant,
        type="checkpoint",
        uri=ready.manifest_uri,
        hash=ready.content_hash,
        tensors_hash=ready.tensors_hash,
        producer_attempt=ready.attempt,
        global_step=ready.global_step,
        consumed_tokens=ready.consumed_tokens,
        lineage=build_lineage(job, ready.attempt, dataset),
        created_at=now,
    )


def model_artifact(
    job: JobRecord, checkpoint: CheckpointRecord, dataset: DatasetRecord | None, *, now: datetime
) -> ArtifactRecord:
    """The final model of a succeeded job: its latest READY checkpoint."""
    if checkpoint.state != "READY" or not checkpoint.manifest_uri or not checkpoint.content_hash:
        raise ValueError(f"checkpoint {checkpoint.checkpoint_id} of {job.job_id} is not READY")
    return ArtifactRecord(
        artifact_id=artifact_id(job.job_id, "model", checkpoint.global_step, checkpoint.attempt),
        job_id=job.job_id,
        tenant=job.tenant,
        type="model",
        uri=checkpoint.manifest_uri,
        hash=checkpoint.content_hash,
        tensors_hash=checkpoint.tensors_hash,
        producer_attempt=checkpoint.attempt,
        global_step=checkpoint.global_step,
        consumed_tokens=checkpoint.consumed_tokens,
        lineage=build_lineage(job, checkpoint.attempt, dataset),
        created_at=now,
    )


def ready_mismatch(ready: CheckpointReady, record: CheckpointRecord | None) -> str | None:
    """Why a CheckpointReady does not match the coordinator's record (None when it does).

    The coordinator writes the READY record and stages the event in one MULTI, so a
    CheckpointReady without a matching READY record did not come from it.
    """
    if record is None:
        return "no checkpoint record exists for it"
    if record.state != "READY":
        return f"the checkpoint record is {record.state}"
    if record.content_hash != ready.content_hash or record.manifest_uri != ready.manifest_uri:
        return "its manifest or content hash differs from the READY checkpoint record"
    if record.tenant != ready.tenant:
        return "its tenant differs from the checkpoint record"
    return None


# --------------------------------------------------------------------------- retirement


def retired_since_ready(ready: CheckpointReady, record: CheckpointRecord | None) -> str | None:
    """Why a CheckpointReady names a checkpoint that was READY and is retired since (None otherwise).

    Retention DELETEs READY checkpoints and a restoring attempt may refuse one (FAILED); both keep
    the manifest and content hash of the READY record, so a late CheckpointReady that matches them
    is genuine but describes a checkpoint no longer loadable. A FAILED record that never was READY
    has no content hash and does not match: that event stays a mismatch.
    """
    if record is None or record.state not in ("DELETED", "FAILED"):
        return None
    if record.content_hash != ready.content_hash or record.manifest_uri != ready.manifest_uri:
        return None
    if record.tenant != ready.tenant:
        return None
    return retirement_reason(record)


def retirement_reason(record: CheckpointRecord) -> str:
    """``checkpoint step-000001500-a1 deleted by retention: keepLast=3`` (the record's reason, said once)."""
    what = "deleted by retention" if record.state == "DELETED" else "failed"
    detail = (record.reason or "").removeprefix("retention: ")
    return f"checkpoint {record.checkpoint_id} {what}: {detail}" if detail else \
        f"checkpoint {record.checkpoint_id} {what}"


def retire(artifact: ArtifactRecord, reason: str, *, now: datetime) -> ArtifactRecord | None:
    """The artifact marked retired; None when it is retired already (idempotent)."""
    if artifact.retired_at is not None:
        return None
    return artifact.model_copy(update={"retired_at": now, "retired_reason": reason})


def retirements(
    artifacts: Sequence[ArtifactRecord], records: Sequence[CheckpointRecord], *, now: datetime
) -> list[ArtifactRecord]:
    """Artifacts (checkpoint or model) whose checkpoint record is DELETED or FAILED, marked retired."""
    by_id = {r.checkpoint_id: r for r in records}
    retired = []
    for artifact in artifacts:
        record = by_id.get(checkpoint_id(artifact.global_step, artifact.producer_attempt))
        if record is None or record.state not in ("DELETED", "FAILED") or record.manifest_uri != artifact.uri:
            continue
        if (changed := retire(artifact, retirement_reason(record), now=now)) is not None:
            retired.append(changed)
    return retired


# --------------------------------------------------------------------------- the feed (trainyard.registry)


def artifact_lineage(lineage: Lineage) -> ArtifactLineage:
    """The record's lineage as it travels on the feed (same fields, the wire's camelCase)."""
    return ArtifactLineage.model_validate(lineage.model_dump(mode="json", by_alias=True))


def registered(artifact: ArtifactRecord, *, now: datetime, event_id: UUID | None = None) -> ArtifactRegistered:
    """What the feed announces when ``artifact`` is recorded (as recorded live: a retirement follows
    as its own ArtifactRetired, so a follower that applies the events in order ends where the record is)."""
    return ArtifactRegistered(
        event_id=event_id or uuid4(),
        occurred_at=now,
        artifact_id=artifact.artifact_id,
        kind=artifact.type,
        tenant=artifact.tenant,
        uri=artifact.uri,
        hash=artifact.hash,
        tensors_hash=artifact.tensors_hash,
        job_id=artifact.job_id,
        global_step=artifact.global_step,
        consumed_tokens=artifact.consumed_tokens,
        lineage=artifact_lineage(artifact.lineage),
        tokenizer=artifact.lineage.tokenizer,
    )


def retired_notice(artifact: ArtifactRecord, *, now: datetime, event_id: UUID | None = None) -> ArtifactRetired:
    """What the feed announces when ``artifact`` (marked retired) stops being loadable."""
    if artifact.retired_at is None:
        raise ValueError(f"artifact {artifact.artifact_id} is not retired")
    return ArtifactRetired(
        event_id=event_id or uuid4(),
        occurred_at=now,
        artifact_id=artifact.artifact_id,
        kind=artifact.type,
        tenant=artifact.tenant,
        uri=artifact.uri,
        hash=artifact.hash,
        job_id=artifact.job_id,
        reason=artifact.retired_reason or "retired",
    )


# --------------------------------------------------------------------------- datasets


def dataset_record(
    event: DatasetVersionPublished, *, now: datetime, manifest: Mapping[str, Any] | None = None
) -> DatasetRecord:
    """The record of a verified version, owned by the event's tenant (None: the platform's). What the
    verified ``manifest`` says (tokens, tokenizer, vocabulary, dtype) wins over what the event claims."""
    manifest = manifest if isinstance(manifest, Mapping) else {}
    declared = manifest.get("tokenizer")
    tokenizer: Mapping[str, Any] = declared if isinstance(declared, Mapping) else {}
    num_tokens, vocab = manifest.get("numTokens"), tokenizer.get("vocabSize")
    return DatasetRecord(
        name=event.name,
        version=event.version,
        tenant=event.tenant,
        shared_with=sorted(set(event.shared_with)),
        manifest_uri=event.manifest_uri,
        sha256=event.sha256,
        tokenizer=tokenizer_ref(tokenizer.get("version")) or event.tokenizer,
        num_tokens=num_tokens if _count(num_tokens) else event.num_tokens,
        vocab_size=vocab if _count(vocab) else None,
        dtype=manifest.get("dtype") if isinstance(manifest.get("dtype"), str) else None,
        published_at=now,
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def dataset_conflict(existing: DatasetRecord, new: DatasetVersionPublished | DatasetRecord) -> str | None:
    """Why ``new`` may not replace ``existing`` (None for an idempotent re-publish): the API's rule too
    (:func:`trainyard_contract.records.dataset_conflict`)."""
    return _version_conflict(existing, new.sha256)


def dataset_registered(record: DatasetRecord, *, now: datetime) -> ArtifactRegistered:
    """The public announcement of a verified version (staged with its record)."""
    return ArtifactRegistered(
        occurred_at=now, artifact_id=record.ref, kind="dataset", tenant=record.tenant, uri=record.manifest_uri,
        hash=record.sha256, dataset=record.ref, shared_with=record.shared_with, tokenizer=record.tokenizer,
        num_tokens=record.num_tokens,
    )


def dataset_rejection(
    event: DatasetVersionPublished, problems: Sequence[str], *, now: datetime
) -> tuple[DatasetRejection, DatasetRejected]:
    """The refusal of a published version: the record the API shows its owner, and the event."""
    reason = rejection_reason(problems)
    record = DatasetRejection(
        name=event.name, version=event.version, tenant=event.tenant, manifest_uri=event.manifest_uri,
        sha256=event.sha256, reason=reason, problems=list(problems[:MAX_PROBLEMS]),
        published_event_id=str(event.event_id), rejected_at=now,
    )
    rejected = DatasetRejected(
        occurred_at=now, name=event.name, version=event.version, tenant=event.tenant,
        manifest_uri=event.manifest_uri, sha256=event.sha256, reason=reason, problems=record.problems,
        published_event_id=event.event_id,
    )
    return record, rejected


def tokenizer_ref(value: Any) -> str | None:
    """The tokenizer named by a dataset manifest: a string, or an object with name/version/id."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, Mapping):
        name, version = value.get("name"), value.get("version")
        if isinstance(name, str) and name:
            return f"{name}@{version}" if isinstance(version, (str, int)) and version != "" else name
        if isinstance(value.get("id"), str):
            return value["id"]
    return None


def dataset_from_manifest(
    ref: str, manifest_uri: str, sha256: str, manifest: Mapping[str, Any], *, now: datetime
) -> DatasetRecord:
    """A dataset record read from the dataset's manifest on disk (no DatasetVersionPublished seen)."""
    tenant, name, version = DatasetRef.parse(ref)
    num_tokens = manifest.get("numTokens", manifest.get("num_tokens"))
    declared = manifest.get("tokenizer")
    tokenizer: Mapping[str, Any] = declared if isinstance(declared, Mapping) else {}
    vocab = tokenizer.get("vocabSize")
    return DatasetRecord(
        name=name,
        version=version,
        tenant=tenant,
        manifest_uri=manifest_uri,
        sha256=sha256,
        tokenizer=tokenizer_ref(manifest.get("tokenizer")),
        num_tokens=num_tokens if isinstance(num_tokens, int) else None,
        vocab_size=vocab if _count(vocab) else None,
        published_at=now,
    )
