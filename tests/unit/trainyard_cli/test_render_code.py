"""`jobs get` and `artifacts list` show the code a job runs (and nothing new for the built-in trainer)."""

from __future__ import annotations

from rich.console import Console

from trainyard_cli.client import Artifact, Job
from trainyard_cli.render import artifacts_table, code_rows, job_detail

ARCHIVE = "sha256:" + "ab" * 32


def text(renderable: object) -> str:
    console = Console(width=250, record=True)
    console.print(renderable)
    return console.export_text()


def test_jobs_get_shows_archive_commit_dirty_and_entrypoint() -> None:
    code = {"archive": ARCHIVE, "commit": "c" * 40, "dirty": True, "entrypoint": ["python", "train.py", "--lr", "3e-4"],
            "repo": "https://g/r.git", "revision": "main", "workingDir": "src"}
    assert code_rows(code) == [("code", ARCHIVE), ("code repo", "https://g/r.git @ main"),
                               ("code commit", "c" * 40 + " (dirty)"), ("entrypoint", "python train.py --lr 3e-4"),
                               ("working dir", "src")]
    shown = text(job_detail(Job(job_id="job-1", state="queued", spec_hash="h", spec={"code": code})))
    assert ARCHIVE in shown and "c" * 40 + " (dirty)" in shown
    assert code_rows(None) == []
    assert "entrypoint" not in text(job_detail(Job(job_id="j", state="queued", spec_hash="h")))


def test_artifacts_list_names_the_code_archive() -> None:
    def artifact(lineage: dict) -> Artifact:
        return Artifact(artifact_id="a", job_id="j", type="checkpoint", uri="file:///x", hash="sha256:1",
                        producer_attempt=1, global_step=2, lineage=lineage)
    shown = text(artifacts_table([artifact({"codeArchive": ARCHIVE}), artifact({})]))
    assert ARCHIVE[:19] in shown and "built-in" in shown
