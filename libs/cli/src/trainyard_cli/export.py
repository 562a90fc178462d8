"""``trainyard export``: a job's READY checkpoint as a Hugging Face model directory.

1. pick the checkpoint (:func:`pick_checkpoint`: the latest READY one, or the one at ``--step``);
2. ask for its export (``POST /v1/registry/artifacts/{id}/export``) and follow it until it is ready or
   failed (a spinner; the failure's reason is the error);
3. with ``--out``: download every file its listing names (a progress bar) into a temporary sibling of
   the directory, check the listing's sha256 against the export's hash and each file's against the listing,
   and only then rename it into place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from trainyard_contract.errors import ConfigError, ConflictError, TrainyardError
from trainyard_contract.storage import EXPORT_LISTING, export_listing
from trainyard_contract.wire import ExportFile

from trainyard_cli.client import ApiClient, Artifact, ArtifactView

POLL_S = 1.0


class ExportFailedError(TrainyardError):
    """The registry could not make the export (the message is its reason)."""


class DownloadError(TrainyardError):
    """A downloaded file is not what the export's listing says."""


# ----------------------------------------------------------------------------- pure decisions


def ready_checkpoints(artifacts: Sequence[Artifact]) -> list[Artifact]:
    """The job's checkpoints that can still be exported (not retired), oldest first."""
    ready = [a for a in artifacts if a.type == "checkpoint" and a.retired_at is None]
    return sorted(ready, key=lambda a: (a.global_step, a.producer_attempt))


def pick_checkpoint(job_id: str, artifacts: Sequence[Artifact], step: int | None) -> Artifact:
    """The latest READY checkpoint, or the one at ``step``; ConflictError listing the READY steps otherwise."""
    ready = ready_checkpoints(artifacts)
    steps = ", ".join(str(a.global_step) for a in ready) or "none"
    if step is None:
        if not ready:
            raise ConflictError(f"{job_id} has no READY checkpoint to export (READY steps: none); "
                                f"`trainyard jobs checkpoints {job_id}` shows what it wrote")
        return ready[-1]
    at = [a for a in ready if a.global_step == step]
    if not at:
        retired = next((a for a in artifacts if a.type == "checkpoint" and a.global_step == step), None)
        why = f"its checkpoint at step {step} is retired ({retired.retired_reason})" if retired else \
            f"it has no checkpoint at step {step}"
        raise ConflictError(f"{job_id}: {why}; READY steps: {steps} (--step N)")
    return at[-1]


def export_outcome(view: ArtifactView) -> str | None:
    """None while the export is requested; "ready"; ExportFailedError when it failed."""
    if view.state == "requested":
        return None
    if view.state == "failed":
        export = view.export
        reason = export.reason if export is not None and export.reason else "no reason recorded"
        problems = export.problems if export is not None else []
        extra = "".join(f"\n  - {p}" for p in problems if p != reason)
        raise ExportFailedError(f"export {view.artifact_id} failed: {reason}{extra}")
    return view.state


def listing_problem(listing: bytes, expected_hash: str | None) -> str | None:
    """Why the downloaded listing is not the export's (None when its sha256 is the export's hash)."""
    digest = hashlib.sha256(listing).hexdigest()
    want = (expected_hash or "").removeprefix("sha256:")
    return None if digest == want else f"{EXPORT_LISTING} has sha256 {digest}, the export's hash is {expected_hash}"


def next_steps(view: ArtifactView, out: Path | None) -> str:
    """What to do with the export."""
    where = str(out) if out is not None else (view.export.uri if view.export and view.export.uri else "?")
    if out is None:
        return (f"export {view.artifact_id} is ready at {where}\n"
                f"download it: trainyard export {view.artifact_id.split('/', 1)[0]} --out DIR")
    return (f"export {view.artifact_id} downloaded to {out} (every file checked against its sha256)\n"
            f'load it: AutoModelForCausalLM.from_pretrained("{out}"), AutoTokenizer.from_pretrained("{out}")')


# ----------------------------------------------------------------------------- the shell


@dataclass
class Exporting:
    client: ApiClient
    console: Console

    def request(self, checkpoint: Artifact, fmt: str) -> ArtifactView:
        return self.client.request_export(checkpoint.artifact_id, fmt)

    def follow(self, view: ArtifactView, *, timeout_s: float | None, sleep: Callable[[float], None] = time.sleep
               ) -> ArtifactView:
        """Poll the export until it is ready (or failed: ExportFailedError)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                      console=self.console, transient=True) as bar:
            bar.add_task(f"exporting {view.artifact_id} (verifying the checkpoint, converting)", total=None)
            while export_outcome(view) is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise ExportFailedError(f"export {view.artifact_id} is still {view.state} after {timeout_s:g}s; "
                                            f"run the command again to keep following it")
                sleep(POLL_S)
                view = self.client.get_artifact(view.artifact_id)
        return view

    def download(self, view: ArtifactView, out: Path) -> list[ExportFile]:
        """Every file of the ready export into ``out`` (which must not exist), each checked."""
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {out} exists and is not empty; choose another directory or remove it")
        partial = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            listing = self._fetch_listing(view, partial)
            files = [ExportFile(name=f.name, size=f.size, sha256=f.sha256) for f in export_listing(listing)]
            self._fetch(view.artifact_id, files, partial)
            if out.exists():
                out.rmdir()
            os.rename(partial, out)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return files

    def _fetch_listing(self, view: ArtifactView, into: Path) -> bytes:
        chunks: list[bytes] = []
        self.client.download_export_file(view.artifact_id, EXPORT_LISTING, chunks.append)
        listing = b"".join(chunks)
        expected = view.export.hash if view.export else None
        if problem := listing_problem(listing, expected):
            raise DownloadError(problem)
        (into / EXPORT_LISTING).write_bytes(listing)
        return listing

    def _fetch(self, export_id: str, files: Sequence[ExportFile], into: Path) -> None:
        total = sum(f.size for f in files)
        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=self.console, transient=True) as bar:
            task = bar.add_task("downloading", total=total)
            for f in files:
                bar.update(task, description=f"downloading {f.name}")
                digest = hashlib.sha256()
                size = 0
                with open(into / f.name, "wb") as fh:
                    def sink(chunk: bytes, fh=fh, digest=digest) -> None:  # noqa: ANN001 - defaults bind the loop's file
                        nonlocal size
                        fh.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        bar.advance(task, len(chunk))

                    self.client.download_export_file(export_id, f.name, sink)
                if size != f.size or digest.hexdigest() != f.sha256:
                    raise DownloadError(f"{f.name}: got {size} bytes with sha256 {digest.hexdigest()}, the listing "
                                        f"says {f.size} bytes with sha256 {f.sha256}")
