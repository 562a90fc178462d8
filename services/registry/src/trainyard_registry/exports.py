"""Pure export decisions: whether an ExportRequested is converted, refused or already done, the
conversion's command line, and the records and events of its outcome.

No Redis, Kafka, clock, filesystem or subprocess here; the shell (``exporter.py``) loads the export's
record, the checkpoint artifact and the job, reads the dataset's manifest, runs the command and
passes what it found in.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from trainyard_contract.events import ExportFailed, ExportRequested, export_id
from trainyard_contract.exitcodes import CHECKPOINT, CONFIG
from trainyard_contract.records import ArtifactRecord, ExportRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import Location

MAX_PROBLEMS = 64  # ExportFailed.problems holds at most this many
MAX_LINE = 500  # characters of one stderr line kept in a reason or problem
EXPORTABLE = frozenset({"checkpoint", "model"})


# ----------------------------------------------------------------------------- what to do


@dataclass(frozen=True)
class Skip:
    """Nothing to do: the export is ready, or failed and waits for a new request."""

    why: str


@dataclass(frozen=True)
class Refuse:
    """Answer ExportFailed without converting."""

    reason: str
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Convert:
    """Run the conversion of this checkpoint artifact for this job."""

    checkpoint: ArtifactRecord
    job: JobRecord


Decision = Skip | Refuse | Convert


def plan_export(
    event: ExportRequested, record: ExportRecord | None, checkpoint: ArtifactRecord | None, job: JobRecord | None
) -> Decision:
    """What to do for ``event`` given the export's record (None: none written), the checkpoint artifact
    it names and its job. Idempotent: a ready export is a no-op, and so is a failed one (a new
    request through the API sets it back to requested, with a new event)."""
    if record is not None and record.state == "ready":
        return Skip(f"export {event.export_id} is ready already")
    if record is not None and record.state == "failed":
        return Skip(f"export {event.export_id} failed already ({record.reason}); a new request retries it")
    if event.export_id != export_id(event.checkpoint_artifact_id, event.format):
        return Refuse(f"export id {event.export_id} does not name the export of {event.checkpoint_artifact_id} "
                      f"as {event.format}")
    if checkpoint is None or checkpoint.job_id != event.job_id or checkpoint.tenant != event.tenant:
        return Refuse(f"no checkpoint artifact {event.checkpoint_artifact_id} of job {event.job_id} "
                      f"for tenant {event.tenant}")
    if checkpoint.type not in EXPORTABLE:
        return Refuse(f"{checkpoint.artifact_id} is a {checkpoint.type} artifact; only checkpoints and models "
                      "are exported")
    if checkpoint.retired_at is not None:
        return Refuse(f"retired: {checkpoint.retired_reason or 'its checkpoint is gone'}")
    if job is None or job.tenant != event.tenant:
        return Refuse(f"job {event.job_id} has no record for tenant {event.tenant}")
    return Convert(checkpoint, job)


def checkpoint_name(checkpoint_artifact_id: str) -> str:
    """The checkpoint's directory name in its artifact id: ``<job>/checkpoint/step-000000040-a1`` → ``step-…``."""
    return checkpoint_artifact_id.split("/", 2)[2]


def auto_export(artifact: ArtifactRecord, spec: TrainingSpec, *, now: datetime) -> ExportRequested | None:
    """The ExportRequested a job's spec asks for once its final model is recorded (None: it asks for none)."""
    if spec.export is None or artifact.type != "model":
        return None
    return ExportRequested(
        occurred_at=now, export_id=export_id(artifact.artifact_id, spec.export.format),
        checkpoint_artifact_id=artifact.artifact_id, job_id=artifact.job_id, tenant=artifact.tenant,
        format=spec.export.format, requested_by="spec",
    )


def requested_record(event: ExportRequested, *, now: datetime) -> ExportRecord:
    """The export's record as its request leaves it."""
    return ExportRecord(
        export_id=event.export_id, checkpoint_artifact_id=event.checkpoint_artifact_id, job_id=event.job_id,
        tenant=event.tenant, format=event.format, state="requested", requested_by=event.requested_by,
        requested_at=now,
    )


# ----------------------------------------------------------------------------- the conversion


@dataclass(frozen=True)
class Tokenizer:
    """The dataset's tokenizer, as its manifest names it (``path`` None: the manifest names none)."""

    path: Location | None
    eos_token: str | None


def dataset_tokenizer(manifest: Any, directory: Location) -> Tokenizer:
    """The tokenizer file and end-of-document token a dataset's ``manifest.json`` names."""
    if not isinstance(manifest, Mapping):
        return Tokenizer(None, None)
    tok = manifest.get("tokenizer")
    name = tok.get("file") if isinstance(tok, Mapping) else None
    plain = isinstance(name, str) and name and "/" not in name and name not in (".", "..")
    separator = manifest.get("separator")
    return Tokenizer(directory / name if plain and name else None, separator if isinstance(separator, str) else None)


def model_config_arg(spec: TrainingSpec) -> str:
    """``--model-config``: the catalog reference, or the inline model as JSON."""
    ref = spec.model_config_ref
    return ref if isinstance(ref, str) else json.dumps(ref.model_dump(mode="json", by_alias=True))


def export_command(
    base: Sequence[str], *, checkpoint: Path, out: Path, spec: TrainingSpec, tokenizer: Tokenizer
) -> list[str]:
    """``trainyard-export --checkpoint … --out … --model-config … [--tokenizer … --eos-token …] --json``."""
    cmd = [*base, "--checkpoint", str(checkpoint), "--out", str(out), "--model-config", model_config_arg(spec)]
    if tokenizer.path is not None:
        cmd += ["--tokenizer", str(tokenizer.path)]
        if tokenizer.eos_token:
            cmd += ["--eos-token", tokenizer.eos_token]
    return [*cmd, "--json"]


@dataclass(frozen=True)
class Converted:
    """What a successful run printed: the directory, the sha256 of its listing, its files."""

    uri: str
    sha256: str
    files: list[str]


def parse_output(stdout: str) -> Converted | None:
    """The command's ``--json`` line (the last JSON object on stdout); None when there is none."""
    for line in reversed(stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("sha256"), str) and isinstance(doc.get("uri"), str):
            files = doc.get("files")
            names = [f if isinstance(f, str) else f.get("path") or f.get("name") for f in files
                     if isinstance(f, str | dict)] if isinstance(files, list) else []
            return Converted(doc["uri"], doc["sha256"], [n for n in names if isinstance(n, str)])
    return None


def content_hash(sha256: str) -> str:
    """An artifact's hash as the registry writes them: ``sha256:<hex>``."""
    return sha256 if sha256.startswith("sha256:") else f"sha256:{sha256}"


PROGRESS_PREFIX = "trainyard-export: "  # how the command starts each line it writes to stderr
REFUSED = (CONFIG, CHECKPOINT)  # the command's exit codes for a refusal it explains in its last line


def refusal(returncode: int | None, stderr: str, *, timeout_s: float, command: Sequence[str]) -> Refuse:
    """Why a run that did not succeed failed. A refusal (exit 2: the model config or tokenizer cannot
    work, 4: the checkpoint is not READY or fails verification) says why on its last stderr line, and
    that is the reason and the problem; anything else (a crash) keeps its stderr's last lines as the
    problems. A run past the timeout (``returncode`` None) or killed by a signal says so."""
    if returncode is None:
        return Refuse(f"the conversion did not finish within {timeout_s:g}s (TRAINYARD_EXPORT_TIMEOUT_S)")
    lines = [line.strip()[:MAX_LINE] for line in stderr.splitlines() if line.strip()]
    if returncode < 0:
        return Refuse(f"the conversion was killed by signal {-returncode}", lines[-MAX_PROBLEMS:])
    if not lines:
        return Refuse(f"{shlex.join(command[:3])} exited with {returncode} and said nothing")
    why = lines[-1].removeprefix(PROGRESS_PREFIX)
    if returncode in REFUSED:
        return Refuse(why, [why])
    return Refuse(f"the conversion failed (exit {returncode}): {why}",
                  [line.removeprefix(PROGRESS_PREFIX) for line in lines[-MAX_PROBLEMS:]])


# ----------------------------------------------------------------------------- the outcome


def export_artifact(checkpoint: ArtifactRecord, event: ExportRequested, uri: str, sha256: str, *,
                    now: datetime) -> ArtifactRecord:
    """The export as an artifact: the checkpoint's lineage, its parent the checkpoint's manifest."""
    return ArtifactRecord(
        artifact_id=event.export_id, job_id=checkpoint.job_id, tenant=checkpoint.tenant, type="export", uri=uri,
        hash=content_hash(sha256), producer_attempt=checkpoint.producer_attempt, global_step=checkpoint.global_step,
        consumed_tokens=checkpoint.consumed_tokens,
        lineage=checkpoint.lineage.model_copy(update={"parent_checkpoint": checkpoint.uri}), created_at=now,
    )


def ready_record(record: ExportRecord, artifact: ArtifactRecord, *, now: datetime) -> ExportRecord:
    return record.model_copy(update={"state": "ready", "finished_at": now, "uri": artifact.uri,
                                     "hash": artifact.hash, "reason": None, "problems": []})


def failed(record: ExportRecord, refused: Refuse, *, now: datetime) -> tuple[ExportRecord, ExportFailed]:
    """The export's record failed, and the event that says why."""
    problems = refused.problems[:MAX_PROBLEMS]
    changed = record.model_copy(update={"state": "failed", "finished_at": now, "reason": refused.reason,
                                        "problems": problems, "uri": None, "hash": None})
    event = ExportFailed(
        occurred_at=now, export_id=record.export_id, checkpoint_artifact_id=record.checkpoint_artifact_id,
        job_id=record.job_id, tenant=record.tenant, format=record.format,
        reason=refused.reason, problems=problems,
    )
    return changed, event
