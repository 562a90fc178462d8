"""Export decisions: what an ExportRequested leads to for each state of its record and checkpoint, the
conversion's command line, how a refusal reads, and the export artifact's lineage."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from trainyard_contract.events import ExportRequested, decode_event, export_id, REGISTRY, EXPORTS
from trainyard_contract.records import ArtifactRecord, ExportRecord, Lineage
from trainyard_contract.spec import TrainingSpec
from trainyard_registry.exports import (
    Convert,
    Refuse,
    Skip,
    Tokenizer,
    auto_export,
    checkpoint_name,
    content_hash,
    dataset_tokenizer,
    export_artifact,
    export_command,
    failed,
    parse_output,
    plan_export,
    ready_record,
    refusal,
    requested_record,
)
from tests.unit.trainyard_registry.test_lineage import SPEC, job

NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)
CKPT = "j/checkpoint/step-000000040-a2"
MANIFEST = "file:///art/tenants/t/jobs/j/checkpoints/step-000000040-a2/manifest.json"
LINEAGE = Lineage(spec_hash="sha256:s", code_revision="abc123", dataset="tinycorpus@v1", dataset_sha256="d" * 64,
                  model_config_ref="gpt-tiny@v1", parent_checkpoint="file:///art/…/step-000000020-a1/manifest.json")


def checkpoint(**changes: object) -> ArtifactRecord:
    record = ArtifactRecord(artifact_id=CKPT, job_id="j", tenant="t", type="checkpoint", uri=MANIFEST,
                            hash="sha256:" + "c" * 64, producer_attempt=2, global_step=40, consumed_tokens=81920,
                            lineage=LINEAGE, created_at=NOW)
    return record.model_copy(update=changes)


def request(**changes: object) -> ExportRequested:
    event = ExportRequested(export_id=export_id(CKPT, "hf"), checkpoint_artifact_id=CKPT, job_id="j", tenant="t",
                            format="hf", requested_by="tok_1")
    return event.model_copy(update=changes)


def test_export_ids_are_one_per_checkpoint_and_format_whatever_artifact_names_the_checkpoint() -> None:
    assert export_id(CKPT, "hf") == "j/export/step-000000040-a2/hf"
    assert export_id("j/model/step-000000040-a2", "hf") == export_id(CKPT, "hf")
    assert checkpoint_name(CKPT) == "step-000000040-a2"


@pytest.mark.parametrize(("state", "expected"), [("ready", Skip), ("failed", Skip), ("requested", Convert)])
def test_a_ready_or_failed_export_is_a_no_op_and_a_requested_one_is_converted(state: str, expected: type) -> None:
    record = requested_record(request(), now=NOW).model_copy(update={"state": state, "reason": "x"})
    assert isinstance(plan_export(request(), record, checkpoint(), job()), expected)


def test_an_export_without_a_record_is_converted_and_its_record_comes_from_the_request() -> None:
    decision = plan_export(request(), None, checkpoint(), job())
    assert isinstance(decision, Convert) and decision.checkpoint == checkpoint()
    record = requested_record(request(), now=NOW)
    assert (record.state, record.checkpoint_artifact_id, record.requested_by) == ("requested", CKPT, "tok_1")


@pytest.mark.parametrize(("event", "ckpt", "why"), [
    (request(), checkpoint(retired_at=NOW, retired_reason="checkpoint step-000000040-a2 deleted by retention: "
                                                          "keepLast=1"),
     "retired: checkpoint step-000000040-a2 deleted"),
    (request(), None, "no checkpoint artifact"),
    (request(tenant="other"), checkpoint(), "no checkpoint artifact"),
    (request(), checkpoint(type="export"), "only checkpoints and models"),
    (request(export_id="j/export/step-000000020-a1/hf"), checkpoint(), "does not name the export"),
])
def test_what_cannot_be_exported_is_refused_with_the_reason(event: ExportRequested, ckpt: ArtifactRecord | None,
                                                           why: str) -> None:
    decision = plan_export(event, None, ckpt, job())
    assert isinstance(decision, Refuse) and why in decision.reason, decision


def test_a_spec_with_export_requests_it_for_the_final_model_only() -> None:
    model = checkpoint(artifact_id="j/model/step-000000040-a2", type="model")
    spec = TrainingSpec.model_validate(SPEC | {"export": {"format": "hf"}})
    event = auto_export(model, spec, now=NOW)
    assert event is not None
    assert (event.export_id, event.checkpoint_artifact_id, event.requested_by) == (
        "j/export/step-000000040-a2/hf", "j/model/step-000000040-a2", "spec")
    assert decode_event(EXPORTS, event.to_bytes()) == event
    assert auto_export(checkpoint(), spec, now=NOW) is None  # not a model
    assert auto_export(model, TrainingSpec.model_validate(SPEC), now=NOW) is None  # no export in the spec
    assert "export" not in TrainingSpec.model_validate(SPEC).model_dump(mode="json", by_alias=True)


def test_the_command_names_the_checkpoint_the_directory_the_model_and_the_tokenizer(tmp_path: Path) -> None:
    spec = TrainingSpec.model_validate(SPEC)
    tok = Tokenizer(tmp_path / "tokenizer.json", "<|endoftext|>")
    cmd = export_command(["trainyard-export"], checkpoint=Path("/c/manifest.json"), out=Path("/o/hf"), spec=spec,
                         tokenizer=tok)
    assert cmd == ["trainyard-export", "--checkpoint", "/c/manifest.json", "--out", "/o/hf", "--model-config",
                   "gpt-tiny@v1", "--tokenizer", str(tmp_path / "tokenizer.json"), "--eos-token", "<|endoftext|>",
                   "--json"]
    inline = TrainingSpec.model_validate(SPEC | {"modelConfig": {"vocabSize": 1024, "nLayers": 2, "nHeads": 2,
                                                                  "dModel": 64, "maxSeqLen": 64}})
    cmd = export_command([sys.executable, "-m", "x"], checkpoint=Path("/c"), out=Path("/o"), spec=inline,
                         tokenizer=Tokenizer(None, None))
    config = json.loads(cmd[cmd.index("--model-config") + 1])
    assert config["dModel"] == 64 and "--tokenizer" not in cmd and cmd[-1] == "--json"


def test_the_tokenizer_and_eos_come_from_the_dataset_manifest(tmp_path: Path) -> None:
    manifest = {"tokenizer": {"file": "tokenizer.json", "sha256": "ab"}, "separator": "</s>"}
    assert dataset_tokenizer(manifest, tmp_path) == Tokenizer(tmp_path / "tokenizer.json", "</s>")
    assert dataset_tokenizer({"tokenizer": {"file": "../../etc/passwd"}}, tmp_path).path is None
    assert dataset_tokenizer(None, tmp_path) == Tokenizer(None, None)


def test_the_commands_json_line_is_its_result_and_its_stderr_the_refusal() -> None:
    stdout = 'loading…\n{"uri": "file:///o/hf", "sha256": "' + "e" * 64 + '", "files": [{"path": "config.json"}]}\n'
    converted = parse_output(stdout)
    assert converted is not None and (converted.uri, converted.sha256, converted.files) == (
        "file:///o/hf", "e" * 64, ["config.json"])
    assert parse_output("no json here") is None
    refused = refusal(4, "trainyard-export: verifying checkpoint /c\ntrainyard-export: refused: "
                         "__1_0.distcp: sha256 differs from the manifest\n", timeout_s=300,
                      command=["trainyard-export"])
    assert refused.reason == "refused: __1_0.distcp: sha256 differs from the manifest"
    assert refused.problems == [refused.reason]  # the progress lines are not problems
    crashed = refusal(1, "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n", timeout_s=300,
                      command=["trainyard-export"])
    assert crashed.reason == "the conversion failed (exit 1): RuntimeError: boom" and len(crashed.problems) == 3
    assert "did not finish within 300s" in refusal(None, "", timeout_s=300, command=["x"]).reason
    assert "killed by signal 9" in refusal(-9, "", timeout_s=300, command=["x"]).reason
    assert "exited with 1 and said nothing" in refusal(1, "", timeout_s=300, command=["x"]).reason


def test_the_export_artifact_keeps_the_checkpoints_lineage_with_the_checkpoint_as_parent() -> None:
    artifact = export_artifact(checkpoint(), request(), "file:///o/hf", "e" * 64, now=NOW)
    assert (artifact.artifact_id, artifact.type, artifact.uri, artifact.hash) == (
        "j/export/step-000000040-a2/hf", "export", "file:///o/hf", "sha256:" + "e" * 64)
    assert (artifact.global_step, artifact.producer_attempt, artifact.consumed_tokens) == (40, 2, 81920)
    assert artifact.lineage.parent_checkpoint == MANIFEST
    assert artifact.lineage.model_dump(exclude={"parent_checkpoint"}) == LINEAGE.model_dump(
        exclude={"parent_checkpoint"})
    assert content_hash("sha256:ab") == "sha256:ab"
    record = ready_record(requested_record(request(), now=NOW), artifact, now=NOW)
    assert (record.state, record.uri, record.hash, record.finished_at) == ("ready", artifact.uri, artifact.hash, NOW)


def test_a_failure_is_recorded_and_announced_with_the_same_reason() -> None:
    record = requested_record(request(), now=NOW)
    changed, event = failed(record, Refuse("retired: gone", ["a"] * 100), now=NOW)
    assert (changed.state, changed.reason, changed.finished_at) == ("failed", "retired: gone", NOW)
    assert len(changed.problems) == 64 and event.problems == changed.problems
    assert (event.export_id, event.checkpoint_artifact_id, event.reason) == (record.export_id, CKPT, "retired: gone")
    assert event.key() == "j" and decode_event(REGISTRY, event.to_bytes()) == event
    assert isinstance(ExportRecord.model_validate_json(changed.dumps()), ExportRecord)
