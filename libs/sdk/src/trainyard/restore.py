"""Restore a rank's state from the allocation's start checkpoint: verified, with fallback.

The allocation names a start checkpoint (READY: the coordinator verified it and wrote its
manifest). Before anything is loaded, every rank takes part in verifying it (manifest, then
every file's size and sha256, the hashing split over the ranks); a checkpoint that fails is
refused (rank 0 spools a ``CheckpointRefused``, the coordinator marks it FAILED) and the job's
previous READY checkpoints are tried, newest first. None verifying is a
:class:`~trainyard.checkpoint.NoVerifiedCheckpointError` (exit 4). A checkpoint of another
job (``initFrom``) loads the model's weights only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint.stateful import Stateful

from trainyard_contract.errors import CheckpointError
from trainyard_contract.events import CheckpointRefused, GangAllocated
from trainyard_contract.storage import ArtifactLayout
from trainyard_contract.tracing import current_traceparent

from trainyard.checkpoint import (
    Candidate,
    NoVerifiedCheckpointError,
    Refusal,
    RestoreChoice,
    check_restorable,
    checkpoint_dir_of,
    choose_checkpoint,
    find_ready_checkpoints,
    load_checkpoint,
    requested_candidate,
    verify_files_shared,
)
from trainyard.context import Context
from trainyard.runrecord import RUN_RECORD_FILE, RefusedCheckpoint, RestoreRecord, written_cpu_threads
from trainyard.settings import RankSettings
from trainyard.state import Progress

__all__ = ["JobLike", "refused_records", "report_refusals", "restore"]

log = logging.getLogger("trainyard")


class JobLike(Protocol):
    """What restore needs of a job: the rank's settings and its allocation."""

    settings: RankSettings
    allocation: GangAllocated


class _Spool(Protocol):
    def write(self, event: Any, *, traceparent: str | None = None) -> None: ...


def refused_records(refused: list[Refusal]) -> list[RefusedCheckpoint]:
    return [RefusedCheckpoint(manifest_uri=r.manifest_uri, global_step=r.global_step, problems=r.problems)
            for r in refused]


def restore(job: JobLike, state: MutableMapping[str, Stateful], ctx: Context, layout: ArtifactLayout,
            spool: _Spool | None = None, *, node_layout: ArtifactLayout | None = None) -> RestoreRecord:
    """Verify and load the start checkpoint into ``state`` (keys ``progress`` and ``rng`` expected),
    or fall back to the newest earlier READY one; what was loaded and why.

    Rank 0 spools a CheckpointRefused for every READY checkpoint it refused (the coordinator
    marks it FAILED), whether or not an earlier one then verified. Every rank calls this.
    ``node_layout``: where this node keeps attempts' own files (the run record), when not ``layout``."""
    settings = job.settings
    started = time.perf_counter()
    ref = job.allocation.start_checkpoint
    requested = requested_candidate(ref) if ref is not None else None
    available = find_ready_checkpoints(layout.checkpoints_dir(settings.tenant, settings.job_id)) if ref else []

    def verify(candidate: Candidate) -> list[str]:
        assert candidate.manifest is not None
        foreign = candidate.manifest.job_id != settings.job_id  # initFrom: another job's weights
        problems = check_restorable(candidate.manifest, spec_hash=None if foreign else job.allocation.spec_hash)
        try:
            checkpoint_dir_of(candidate.manifest, candidate.manifest_uri)
        except CheckpointError as exc:
            problems.append(str(exc))
        if problems:
            return problems
        return verify_files_shared(candidate.manifest, rank=ctx.rank, world_size=ctx.world_size,
                                   gather=ctx.gather if ctx.world_size > 1 else None)

    try:
        choice: RestoreChoice = choose_checkpoint(requested, available, verify)
    except NoVerifiedCheckpointError as exc:
        if spool is not None and ctx.rank == 0:
            report_refusals(job, spool, exc.refused)
        raise
    if spool is not None and ctx.rank == 0:
        report_refusals(job, spool, choice.refused)
    for refusal in choice.refused:
        log.error("refusing checkpoint step %s (%s): %s", refusal.global_step, refusal.manifest_uri,
                  "; ".join(refusal.problems))
    record = RestoreRecord(manifest_uri=None, reason=choice.reason,
                           requested_manifest_uri=ref.manifest_uri if ref else None,
                           refused=refused_records(choice.refused), rng="fresh")
    if choice.candidate is None:
        return record
    manifest = choice.candidate.manifest
    assert manifest is not None
    directory = checkpoint_dir_of(manifest, choice.candidate.manifest_uri)
    if manifest.job_id != settings.job_id:
        return _init_from(state, manifest, directory, choice.candidate.manifest_uri, record, started)
    _resume(state, manifest, directory, record, world_size=settings.world_size,
            run_record=(node_layout or layout).attempt_dir(manifest.tenant, manifest.job_id, manifest.attempt)
            / RUN_RECORD_FILE)
    record.manifest_uri = choice.candidate.manifest_uri
    record.seconds = time.perf_counter() - started
    progress: Progress = state["progress"]  # type: ignore[assignment]  # the run's Progress entry
    (log.warning if choice.fell_back else log.info)(
        "restore: %s; resumed from %s at step %d (%d tokens consumed)",
        choice.reason, choice.candidate.manifest_uri, progress.global_step, progress.consumed_tokens)
    return record


def _resume(state: MutableMapping[str, Stateful], manifest: Any, directory: Any, record: RestoreRecord, *,
            world_size: int, run_record: Path) -> None:
    """Load this job's own checkpoint into ``state``; the RNG only when it was written by as many ranks as this
    attempt has (else each rank's generators are reseeded from the step), noted in ``record``."""
    same_world = manifest.world_size == world_size
    to_load = dict(state) if same_world else {k: v for k, v in state.items() if k != "rng"}
    load_checkpoint(to_load, directory)
    progress: Progress = state["progress"]  # type: ignore[assignment]  # the run's Progress entry
    if not same_world:
        state["rng"].reseed(progress.global_step)  # type: ignore[attr-defined]  # the run's RngState entry
    record.global_step = progress.global_step
    record.world_size = manifest.world_size
    record.cpu_threads = written_cpu_threads(run_record)
    record.rng = "restored" if same_world else (
        f"reseeded: written by {manifest.world_size} ranks, this attempt has {world_size}")


def _init_from(state: MutableMapping[str, Stateful], manifest: Any, directory: Any, manifest_uri: str,
               record: RestoreRecord, started: float) -> RestoreRecord:
    """``initFrom``: load only ``state["model"]`` from another job's checkpoint; the optimizer,
    schedule, data position, RNG and counters start fresh under this job's spec. A model of
    another shape fails the load (CheckpointError: exit 4, the job fails with the reason)."""
    if "model" not in state:
        raise CheckpointError(f"initFrom: the state to restore has no 'model' entry to load the weights of job "
                              f"{manifest.job_id} into (keys: {sorted(state)})")
    try:
        load_checkpoint({"model": state["model"]}, directory)
    except CheckpointError as exc:
        raise CheckpointError(
            f"initFrom: cannot load the weights of job {manifest.job_id} step {manifest.global_step} "
            f"({manifest_uri}) into this model: {exc}") from exc
    record.manifest_uri = manifest_uri
    record.global_step = 0
    record.world_size = manifest.world_size
    record.reason = (f"initialised from job {manifest.job_id} step {manifest.global_step} (weights only; "
                     "optimizer, schedule, data position and step counter start fresh)")
    record.seconds = time.perf_counter() - started
    log.info("restore: %s", record.reason)
    return record


def report_refusals(job: Any, spool: _Spool, refused: list[Refusal]) -> int:
    """Spool one CheckpointRefused per refused checkpoint whose step is known; returns how many."""
    settings, sent = job.settings, 0
    for r in refused:
        if r.global_step is None:  # a manifest that does not parse names no step; the coordinator cannot match it
            log.warning("not reporting refused checkpoint %s: its step is unknown", r.manifest_uri)
            continue
        spool.write(CheckpointRefused(
            job_id=settings.job_id, tenant=settings.tenant, attempt=settings.attempt, manifest_uri=r.manifest_uri,
            global_step=r.global_step, checkpoint_attempt=r.attempt, problems=list(r.problems),
        ), traceparent=current_traceparent())
        sent += 1
    return sent
