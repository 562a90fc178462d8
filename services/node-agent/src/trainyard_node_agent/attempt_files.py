"""Where an attempt's files for its ranks lie in the node's layout: the exit files the launcher writes, and
the checkpoint request the agent writes for the ranks to read (design.md §6, the pause protocol)."""

from __future__ import annotations

from pathlib import Path

from trainyard_contract.storage import ArtifactLayout

CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"  # in the attempt directory; read by trainyard_trainer


def exit_file_for(layout: ArtifactLayout, tenant: str, job_id: str, attempt: int, rank: int) -> Path:
    """``<attempt dir>/exit/rank-<r>.json``: where the launcher records how the rank ended."""
    return layout.attempt_dir(tenant, job_id, attempt) / "exit" / f"rank-{rank}.json"


def checkpoint_request_file(layout: ArtifactLayout, tenant: str, job_id: str, attempt: int) -> Path:
    """``<attempt dir>/checkpoint-request.json``: the CheckpointRequested the ranks of the attempt read."""
    return layout.attempt_dir(tenant, job_id, attempt) / CHECKPOINT_REQUEST_FILE
