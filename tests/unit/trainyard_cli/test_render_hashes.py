"""`jobs checkpoints`, a job's view and `artifacts list` show the tensors hash (the values, for comparing runs)
beside the content hash (the files as written)."""

from __future__ import annotations

from rich.console import Console

from trainyard_cli.client import Artifact
from trainyard_cli.render import artifacts_table, checkpoints_table
from trainyard_contract.wire import CheckpointView

TENSORS, CONTENT = "sha256:" + "7e" * 32, "sha256:" + "c0" * 32


def text(renderable: object, width: int = 250) -> str:
    console = Console(width=width, record=True)
    console.print(renderable)
    return console.export_text()


def checkpoint(tensors_hash: str | None) -> CheckpointView:
    return CheckpointView.model_validate({
        "checkpointId": "step-000000020-a1", "state": "READY", "globalStep": 20, "attempt": 1, "worldSize": 2,
        "manifestUri": "file:///m.json", "contentHash": CONTENT, "tensorsHash": tensors_hash, "consumedTokens": 40960,
        "reason": None, "createdAt": "2024-05-01T12:00:00Z", "readyAt": "2024-05-01T12:00:03Z"})


def test_checkpoints_show_the_tensors_hash_and_the_content_hash() -> None:
    for manifests in (True, False):  # `jobs checkpoints`, and the table inside `jobs get`
        shown = text(checkpoints_table([checkpoint(TENSORS)], manifests=manifests))
        assert "TENSORS HASH" in shown and TENSORS[:19] in shown
        assert "CONTENT HASH" in shown and CONTENT[:19] in shown
        assert ("file:///m.json" in shown) is manifests
    # a checkpoint whose ranks did not report their tensors (written before tensorsHash existed)
    older = text(checkpoints_table([checkpoint(None)]))
    assert CONTENT[:19] in older and TENSORS[:19] not in older


def test_artifacts_show_the_tensors_hash() -> None:
    artifact = Artifact.model_validate({"artifactId": "a", "jobId": "j", "type": "model", "uri": "file:///m.json",
                                        "hash": CONTENT, "tensorsHash": TENSORS, "producerAttempt": 1,
                                        "globalStep": 20, "lineage": {}})
    shown = text(artifacts_table([artifact]))
    assert TENSORS[:19] in shown and CONTENT[:19] in shown
