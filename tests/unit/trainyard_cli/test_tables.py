"""Every table the CLI prints is legible at 80 columns without a terminal (tables.py decides the layout)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pytest
from rich.console import Console, RenderableType

from trainyard_cli.admin import audit_table, tenants_table, tokens_table
from trainyard_cli.client import Artifact, Dataset, Job, Trigger
from trainyard_cli.devstack import STATUS_COLUMNS
from trainyard_cli.render import (
    artifacts_table,
    checkpoints_table,
    datasets_table,
    job_detail,
    jobs_table,
    nodes_table,
    trigger_detail,
    triggers_table,
)
from trainyard_cli.tables import Col, Fitted, fit, shorten_middle
from trainyard_contract.wire import CheckpointView, JobSummary

MAX_CELL_LINES = 4
ROOT = "file:///home/researcher/trainyard/.trainyard/artifacts/tenants/acme/jobs/job-3f9a1c2b7d4e"
OOM = "rank 3 exited 1: CUDA out of memory [device 3] while allocating 2.0 GiB"
AT = "2024-05-01T12:00:03Z"

JOBS = [JobSummary.model_validate({
    "jobId": "job-3f9a1c2b7d4e", "name": "llama-wiki-sweep-lr3e-4", "state": "failed", "specHash": "sha256:ab",
    "model": "gpt-1b@v1", "dataset": "acme/wikipedia-en@2024-05-01", "gpuCount": 8, "attempts": 3,
    "globalStep": 1200, "maxSteps": 10000, "lastLoss": 2.3456, "createdAt": AT, "updatedAt": AT,
    "queuedReason": None, "reason": OOM})]
CHECKPOINTS = [CheckpointView.model_validate({
    "checkpointId": "step-000000040-a1", "state": "READY", "globalStep": 40, "attempt": 1, "worldSize": 2,
    "manifestUri": f"{ROOT}/checkpoints/step-000000040-a1/manifest.json", "contentHash": "sha256:" + "0a" * 32,
    "consumedTokens": 81920, "reason": None, "createdAt": AT, "readyAt": AT})]
ARTIFACTS = [Artifact.model_validate({
    "artifactId": "job-3f9a1c2b7d4e/checkpoint/step-000000040-a1", "jobId": "job-3f9a1c2b7d4e", "type": "checkpoint",
    "uri": f"{ROOT}/checkpoints/step-000000040-a1/manifest.json", "hash": "sha256:" + "1b" * 32,
    "producerAttempt": 1, "globalStep": 40,
    "lineage": {"dataset": "acme/wikipedia-en@2024-05-01", "specHash": "sha256:" + "2c" * 32,
                "codeArchive": "sha256:" + "3d" * 32}})]
DATASETS = [Dataset.model_validate({
    "name": "wikipedia-en", "version": "2024-05-01", "tenant": "acme", "sharedWith": ["lab-a", "lab-b"],
    "tokenizer": "byte-bpe-32k", "numTokens": 3_400_000_000, "sha256": "4e" * 32,
    "manifestUri": "file:///home/researcher/trainyard/.trainyard/artifacts/tenants/acme/datasets/wikipedia-en/"
                   "2024-05-01/manifest.json"})]
JOB = Job.model_validate({
    "jobId": "job-3f9a1c2b7d4e", "name": "llama-wiki-sweep-lr3e-4", "state": "failed", "specHash": "sha256:ab",
    "spec": {"modelConfig": "gpt-1b@v1", "dataset": "acme/wikipedia-en@2024-05-01", "resources": {"gpuCount": 8},
             "code": {"archive": "sha256:" + "5f" * 32, "entrypoint": ["python", "train.py", "--lr", "[3e-4]"]}},
    "reason": OOM, "createdAt": AT, "updatedAt": AT,
    "attempts": [{"attempt": 1, "state": "failed", "nodes": ["node-a-rack1-h100", "node-b-rack1-h100"],
                  "worldSize": 16, "startedAt": AT, "endedAt": AT, "failureReason": OOM,
                  "allocationId": "alloc-1", "epoch": 1, "startCheckpoint": None, "placementScore": None}],
    "checkpoints": [c.model_dump(mode="json", by_alias=True) for c in CHECKPOINTS]})
TRIGGER = Trigger.model_validate({
    "triggerId": "trg-5c1d9e0a7b2f", "tenant": "acme", "name": "wiki-nightly", "dataset": "wikipedia-*",
    "sources": ["own", "shared"], "template": {"modelConfig": "gpt-1b@v1"}, "enabled": True, "createdAt": AT,
    "jobs": [{"dataset": "acme/wikipedia-en@2024-05-01", "jobId": "job-3f9a1c2b7d4e"}],
    "lastFailure": {"at": AT, "dataset": "acme/wikipedia-de@2024-05-01", "eventId": "e",
                    "message": "the template does not validate with this dataset", "problems": []}})
NODES = [{"nodeId": "node-a-rack1-h100-0001", "host": "gpu-host-17.cluster.internal", "rack": "rack-1",
          "devices": [{}] * 8, "healthy": False, "quarantined": True,
          "quarantine": {"reason": "3 attempts failed here within an hour (xid 79)", "by": "scheduler"},
          "drained": True, "drain": {"reason": "firmware update", "by": "ops"}, "reputationScore": 0.42}]
TENANTS = [{"tenant": "acme-research", "settings": {"quotas": {"h100-80gb": {"guaranteed": 64, "borrowLimit": 32},
                                                              "cpu": {"guaranteed": 8, "borrowLimit": None}},
                                                   "weight": 2, "maxPriority": 100, "cohort": "research"},
            "settingsStored": True, "activeTokens": 4, "createdAt": AT}]
TOKENS = [{"tokenId": "tok_7d3c9a1e5b2f4d6a", "name": "ci-pipeline", "role": "submitter", "state": "active",
           "createdAt": AT, "expiresAt": "2024-06-01T12:00:03Z", "revokedAt": None}]
AUDIT = [{"at": "2024-05-01T12:00:03.123456Z", "actorName": "alice", "actorTenant": "acme-research",
          "actorRole": "tenant-admin", "action": "tokens.revoke", "target": "acme-research/tok_7d3c9a1e5b2f4d6a",
          "outcome": "ok", "detail": "revoked by [alice] before rotation"}]


def status_table() -> Fitted:
    table = Fitted(None, STATUS_COLUMNS)
    table.add_row("checkpoint-coordinator", "48213", "running",
                  "/home/researcher/trainyard/.trainyard/logs/checkpoint-coordinator.log")
    return table


def printed(renderable: RenderableType, width: int = 80) -> str:
    """What ``renderable`` prints on a console of ``width`` columns that is not a terminal (a pipe, a file)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, markup=False, highlight=False).print(renderable)
    return buffer.getvalue()


def assert_legible(text: str, headers: Sequence[str], whole: Sequence[str], width: int = 80) -> None:
    lines = text.splitlines()
    assert all(len(line.rstrip()) <= width for line in lines), text
    header_lines = [line for line in lines if all(h in line for h in headers[:2])]
    assert header_lines, text
    for header in headers:  # each column's header, whole, on one line
        assert header in header_lines[0], (header, text)
    for value in whole:  # an id, a state, a number: on one line, as it is
        assert any(value in line for line in lines), (value, text)
    body = lines[lines.index(header_lines[0]) + 1:]
    rows = [line for line in body if line.strip() and not line.startswith(("not shown", "long values"))]
    caption = [i for i, line in enumerate(rows) if line.startswith(("not shown", "…"))]
    assert len(rows[:caption[0]] if caption else rows) <= MAX_CELL_LINES, text


def shown(text: str, all_headers: Sequence[str]) -> list[str]:
    """The headers printed (the rest are named in the caption)."""
    head = next(line for line in text.splitlines() if all_headers[0] in line)
    return [h for h in all_headers if f" {h} " in f" {head} "]


TABLES = {
    "jobs list": (lambda: jobs_table(JOBS), ["job-3f9a1c2b7d4e", "failed", "1200/10000"]),
    "jobs checkpoints": (lambda: checkpoints_table(CHECKPOINTS), ["step-000000040-a1", "READY"]),
    "artifacts list": (lambda: artifacts_table(ARTIFACTS), ["checkpoint"]),
    "datasets list": (lambda: datasets_table(DATASETS), ["3.4G"]),
    "admin nodes list": (lambda: nodes_table(NODES), ["no"]),
    "triggers list": (lambda: triggers_table([TRIGGER]), ["trg-5c1d9e0a7b2f", "yes"]),
    "admin tenants list": (lambda: tenants_table(TENANTS), []),
    "admin tokens list": (lambda: tokens_table(TOKENS), ["tok_7d3c9a1e5b2f4d6a", "submitter", "active"]),
    "admin audit": (lambda: audit_table(AUDIT), ["tokens.revoke", "ok"]),
    "dev status": (status_table, ["checkpoint-coordinator", "48213", "running"]),
}


@pytest.mark.parametrize("command", TABLES)
def test_every_table_is_legible_at_80_columns(command: str) -> None:
    build, whole = TABLES[command]
    table = build()
    headers = [c.header for c in table.cols]
    text = printed(table)
    visible = shown(text, headers)
    assert len(visible) >= 3, text
    assert_legible(text, visible, whole)
    hidden = [h for h in headers if h not in visible]
    if hidden:  # what is left out is said, never silently squeezed away
        assert "not shown: " + ", ".join(hidden) in " ".join(text.split()), text


@pytest.mark.parametrize("command", TABLES)
def test_every_table_shows_everything_when_there_is_room(command: str) -> None:
    table = TABLES[command][0]()
    text = printed(table, width=400)
    assert shown(text, [c.header for c in table.cols]) == [c.header for c in table.cols]
    assert "not shown" not in text and "…" not in text


def test_jobs_list_at_80_columns_keeps_the_failure_note_whole_and_says_what_it_left_out() -> None:
    text = printed(jobs_table(JOBS))
    assert shown(text, [c.header for c in jobs_table([]).cols]) == ["JOB", "NAME", "STATE", "STEP", "NOTE"]
    assert OOM in " ".join(text.split())  # wrapped at words, brackets and all
    assert "not shown: LOSS, MODEL, DATASET, GPUS, ATTEMPTS, CREATED" in " ".join(text.split())


def test_a_path_is_cut_in_the_middle_on_one_line_not_folded() -> None:
    text = printed(checkpoints_table(CHECKPOINTS))
    (row,) = [line for line in text.splitlines() if "step-000000040-a1  READY" in line]
    assert "file:///" in row and row.rstrip().endswith("/manifest.json") and "…" in row
    assert "… marks a value cut short" in " ".join(text.split())


def test_job_detail_and_trigger_detail_are_legible_at_80_columns() -> None:
    text = printed(job_detail(JOB))
    assert all(len(line.rstrip()) <= 80 for line in text.splitlines()), text
    assert "ATTEMPT" in text and "FAILURE" in text and "python train.py --lr '[3e-4]'" in text
    assert OOM in " ".join(text.split())
    text = printed(trigger_detail(TRIGGER))
    assert all(len(line.rstrip()) <= 80 for line in text.splitlines()), text
    assert "acme/wikipedia-en@2024-05-01" in text and "job-3f9a1c2b7d4e" in text


def test_a_cell_is_text_not_markup() -> None:
    table = Fitted("t", [Col("A"), Col("NOTE", "wrap", min_width=30)])
    table.add_row("[bold]x[/bold]", "rank [1, 2] failed [/]")
    text = printed(table)
    assert "[bold]x[/bold]" in text and "rank [1, 2] failed [/]" in text


COLS = [Col("ID", keep=100), Col("STATE", keep=90), Col("NOTE", "wrap", keep=80, min_width=20),
        Col("PATH", "middle", keep=60, min_width=16), Col("COUNT", keep=10)]


@pytest.mark.parametrize(("width", "widths"), [
    (200, [16, 9, 40, 60, 5]),      # everything at its natural width
    (120, [16, 9, 40, 42, 5]),      # the note whole; the path cut in the middle, in what is left
    (80, [16, 9, 21, 21, 5]),       # both shortened alike (spare width goes to the narrowest first)
    (70, [16, 9, 20, 19, None]),    # COUNT (least kept) left out, the note at its least
    (60, [16, 9, 31, None, None]),  # PATH no longer fits at its least: left out
    (40, [16, 9, None, None, None]),  # a wrap column at its least (20) does not fit: left out
    (10, [10, None, None, None, None]),  # the first column is never left out; it gives way itself
])
def test_fit_leaves_out_the_least_kept_columns_and_shares_what_is_left(width: int, widths: list[int | None]) -> None:
    assert fit(COLS, [16, 9, 40, 60, 5], width) == widths


@pytest.mark.parametrize(("text", "width", "short"), [
    ("file:///a/b/c/manifest.json", 40, "file:///a/b/c/manifest.json"),
    ("file:///a/b/c/manifest.json", 16, "file:…ifest.json"),
    ("abcdef", 1, "…"),
])
def test_shorten_middle_keeps_the_start_and_more_of_the_end(text: str, width: int, short: str) -> None:
    assert shorten_middle(text, width) == short
    assert len(shorten_middle(text, width)) <= max(width, 1)
