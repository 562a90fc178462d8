"""Retention and garbage collection of checkpoint files, as pure decisions.

:func:`plan_gc` looks at one job's checkpoint records, the directories on disk and which
attempts are live, and returns what to remove:

* :class:`Retire`  a READY checkpoint older than the newest ``keepLast`` READY ones. Never the
  one a live attempt started from (it may still fall back to it). Removal order, each step
  idempotent so a crash anywhere is finished by the next pass: 1. delete ``manifest.json``
  (the checkpoint stops being loadable at once: a directory without a manifest is never
  loaded) 2. mark the record DELETED 3. remove the shards 4. stamp ``deletedAt``.
* :class:`Collect` the files of a FAILED checkpoint, or of a DELETED one whose removal was
  interrupted; the record stays (with ``deletedAt``), so the reason it failed is kept.
* :class:`Sweep`   a directory with no record at all (a save interrupted before any rank
  reported, or whose reports were lost) or a leftover ``<dir>.tmp``, once it is older than the
  shard timeout and its attempt is no longer live (a live attempt may still be writing it).

PENDING checkpoints are never touched: the coordinator's timeout settles them first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from trainyard_contract.records import AttemptRecord, CheckpointRecord, checkpoint_id

#: ``step-000000020-a1`` or ``step-000000020-a1.tmp`` (see ``ArtifactLayout.checkpoint_dir``).
_DIR_NAME = re.compile(r"^step-(?P<step>\d+)-a(?P<attempt>\d+)(?P<tmp>\.tmp)?$")
LIVE_ATTEMPT_STATES = frozenset({"starting", "running"})


@dataclass(frozen=True)
class DirectoryInfo:
    """One entry of a job's checkpoints directory: its name and how long since it last changed."""

    name: str
    age_s: float


@dataclass(frozen=True)
class Retire:
    record: CheckpointRecord
    reason: str


@dataclass(frozen=True)
class Collect:
    record: CheckpointRecord
    reason: str


@dataclass(frozen=True)
class Sweep:
    name: str
    reason: str


GcAction = Retire | Collect | Sweep


def parse_directory(name: str) -> tuple[int, int, bool] | None:
    """(global step, attempt, is temporary) of a checkpoint directory name; None for anything else."""
    m = _DIR_NAME.match(name)
    if m is None:
        return None
    return int(m["step"]), int(m["attempt"]), m["tmp"] is not None


def live_attempts(attempts: Iterable[AttemptRecord]) -> frozenset[int]:
    """Attempt numbers that may still have running ranks."""
    return frozenset(a.attempt for a in attempts if a.state in LIVE_ATTEMPT_STATES)


def protected_checkpoints(attempts: Iterable[AttemptRecord]) -> frozenset[str]:
    """Ids of the checkpoints live attempts started from."""
    return frozenset(
        checkpoint_id(a.start_checkpoint.global_step, a.start_checkpoint.attempt)
        for a in attempts
        if a.state in LIVE_ATTEMPT_STATES and a.start_checkpoint is not None
    )


def retention_candidates(
    checkpoints: Sequence[CheckpointRecord], keep_last: int, protected: frozenset[str] = frozenset()
) -> list[CheckpointRecord]:
    """READY checkpoints older than the newest ``keep_last`` READY ones, oldest first, minus ``protected``."""
    ready = sorted((c for c in checkpoints if c.state == "READY"), key=lambda c: (c.global_step, c.attempt))
    old = ready[: max(len(ready) - keep_last, 0)]
    return [c for c in old if c.checkpoint_id not in protected]


def plan_gc(
    records: Sequence[CheckpointRecord],
    directories: Sequence[DirectoryInfo],
    *,
    keep_last: int,
    attempts: Sequence[AttemptRecord],
    stale_after_s: float,
) -> list[GcAction]:
    """Everything to remove for one job (see the module docstring). Pure."""
    protected = protected_checkpoints(attempts)
    live = live_attempts(attempts)
    actions: list[GcAction] = [
        Retire(c, f"retention: keepLast={keep_last}") for c in retention_candidates(records, keep_last, protected)
    ]
    for c in records:
        if c.deleted_at is None and c.state == "FAILED":
            actions.append(Collect(c, f"failed checkpoint: {c.reason or 'no reason recorded'}"))
        elif c.deleted_at is None and c.state == "DELETED":
            actions.append(Collect(c, "finishing an interrupted deletion"))
    known = {c.checkpoint_id for c in records}
    for d in directories:
        parsed = parse_directory(d.name)
        if parsed is None:
            continue
        step, attempt, tmp = parsed
        if not tmp and checkpoint_id(step, attempt) in known:
            continue  # its record decides
        if attempt in live or d.age_s <= stale_after_s:
            continue
        what = "an interrupted save's temporary directory" if tmp else "a checkpoint directory no rank reported"
        actions.append(Sweep(d.name, f"{what}, untouched for {d.age_s:.0f}s"))
    return actions
