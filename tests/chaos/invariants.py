"""The invariants of docs/design.md §6 as pure checks over a recorded history.

Each check takes plain data (records read from Redis, the lease audit stream, per-attempt step
summaries from the rank spools, tensors) and returns its violations as sentences; an empty list
means the invariant held. File access for checkpoint verification is injected. Nothing here
talks to Redis, the broker or the clock, so every check is unit-tested with histories that
violate it (tests/chaos/test_invariants.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.manifest import CheckpointManifest, verify_manifest
from trainyard_contract.records import CheckpointRecord, JobRecord

# ----------------------------------------------------------------------------- 2. every job ends


def check_terminal(jobs: Iterable[JobRecord]) -> list[str]:
    """Every job is SUCCEEDED, FAILED with a reason, or CANCELLED."""
    problems = []
    for job in jobs:
        if job.state not in TERMINAL_STATES:
            problems.append(f"job {job.job_id} is {job.state}, not terminal ({job.queued_reason or job.reason})")
        elif job.state == "failed" and not job.reason:
            problems.append(f"job {job.job_id} failed without a reason")
    return problems


# ----------------------------------------------------------------------------- 1. no double booking


@dataclass(frozen=True)
class LeaseOp:
    """One entry of ``ty:lease-audit``: a grant, release or restore of an allocation's devices."""

    op: str  # grant | release | restore
    job_id: str
    allocation_id: str
    epoch: int
    devices: tuple[str, ...]

    @classmethod
    def from_stream(cls, fields: Mapping[str, str]) -> LeaseOp:
        return cls(fields["op"], fields["job"], fields["allocation"], int(fields["epoch"]),
                   tuple(json.loads(fields["devices"])))


def check_no_double_booking(audit: Sequence[LeaseOp]) -> list[str]:
    """Replay the audit log: no device is granted while another live allocation holds it, and each
    job's epochs only grow from one grant to the next."""
    holder: dict[str, str] = {}
    live: dict[str, LeaseOp] = {}
    last_epoch: dict[str, int] = {}
    problems = []
    for n, op in enumerate(audit):
        if op.op == "grant":
            for device in op.devices:
                other = holder.get(device)
                if other is not None and other != op.allocation_id:
                    problems.append(f"#{n}: device {device} granted to {op.allocation_id} while {other} holds it")
            if op.epoch <= last_epoch.get(op.job_id, 0):
                problems.append(f"#{n}: job {op.job_id} granted epoch {op.epoch} after epoch {last_epoch[op.job_id]}")
            last_epoch[op.job_id] = max(op.epoch, last_epoch.get(op.job_id, 0))
            for device in op.devices:
                holder[device] = op.allocation_id
            live[op.allocation_id] = op
        elif op.op == "release":
            for device in op.devices:
                if holder.get(device) == op.allocation_id:
                    del holder[device]
            live.pop(op.allocation_id, None)
        elif op.op == "restore":  # expired lease keys of a live allocation re-created (never over another's)
            if op.allocation_id not in live:
                problems.append(f"#{n}: {op.allocation_id} restored although it is not a live allocation")
        else:
            problems.append(f"#{n}: unknown lease operation {op.op!r}")
    return problems


def check_leases_released(audit: Sequence[LeaseOp], jobs: Iterable[JobRecord]) -> list[str]:
    """Once every job is terminal, none of their allocations still holds a device."""
    done = {j.job_id for j in jobs if j.state in TERMINAL_STATES}
    held: dict[str, LeaseOp] = {}
    for op in audit:
        if op.op == "grant":
            held[op.allocation_id] = op
        elif op.op == "release":
            held.pop(op.allocation_id, None)
    return [f"allocation {a} of finished job {op.job_id} still holds {', '.join(op.devices)}"
            for a, op in sorted(held.items()) if op.job_id in done]


# ----------------------------------------------------------------------------- fencing


def check_fencing(jobs: Iterable[JobRecord], checkpoints: Mapping[str, Sequence[CheckpointRecord]]) -> list[str]:
    """A READY checkpoint carries the epoch of the attempt that wrote it, and attempts' epochs grow:
    no zombie attempt produced a READY checkpoint."""
    problems = []
    for job in jobs:
        epochs = {a.attempt: a.epoch for a in job.attempts}
        ordered = [a.epoch for a in job.attempts]
        if any(b <= a for a, b in zip(ordered, ordered[1:], strict=False)):
            problems.append(f"job {job.job_id}: attempt epochs do not grow: {ordered}")
        for c in checkpoints.get(job.job_id, []):
            if c.state == "READY" and epochs.get(c.attempt) != c.epoch:
                problems.append(f"job {job.job_id}: READY {c.checkpoint_id} has epoch {c.epoch}, "
                                f"its attempt has {epochs.get(c.attempt)}")
    return problems


# ----------------------------------------------------------------------------- 3. READY is complete


def check_ready_checkpoints(
    checkpoints: Iterable[CheckpointRecord],
    *,
    read_manifest: Callable[[str], bytes | None],
    stat_size: Callable[[str], int | None],
    file_sha256: Callable[[str], str],
) -> list[str]:
    """Every READY checkpoint has its manifest, which matches the record and verifies file by file."""
    problems = []
    for c in checkpoints:
        if c.state != "READY":
            continue
        where = f"{c.job_id}/{c.checkpoint_id}"
        raw = read_manifest(c.manifest_uri) if c.manifest_uri else None
        if raw is None:
            problems.append(f"{where} is READY but its manifest is missing ({c.manifest_uri})")
            continue
        try:
            manifest = CheckpointManifest.model_validate_json(raw)
        except ValueError as exc:
            problems.append(f"{where}: unreadable manifest: {exc}")
            continue
        recorded = (c.global_step, c.attempt, c.content_hash)
        if (manifest.global_step, manifest.attempt, manifest.content_hash) != recorded:
            problems.append(f"{where}: manifest says step {manifest.global_step} attempt {manifest.attempt} "
                            f"{manifest.content_hash}, the record {c.global_step} {c.attempt} {c.content_hash}")
        problems += [f"{where}: {p}" for p in verify_manifest(manifest, stat_size=stat_size, file_sha256=file_sha256)]
    return problems


# ----------------------------------------------------------------------------- 4. resume point, lost work


@dataclass(frozen=True)
class AttemptSteps:
    """What one attempt did, from its ranks' spools and its record."""

    attempt: int
    state: str  # the attempt record's state
    start_step: int  # the step it resumed from (0: from scratch)
    last_step: int | None  # the highest step any of its ranks completed (None: none)
    #: steps since its last save started, when that save was still in flight at the end (not durable
    #: on every rank); 0 when the last save it started was durable
    in_flight: int = 0


def check_lost_work(job_id: str, attempts: Sequence[AttemptSteps], interval: int, *, slack: int = 0) -> list[str]:
    """After each failed attempt, the next resumes no more than one interval behind the furthest
    step the failed one completed, plus the steps of the one save that was still in flight at the
    failure (``in_flight``) — exactly one save's allowance, nothing more. ``slack`` widens the
    bound by that many steps (only for a caller that states why; the chaos runs pass 0)."""
    problems = []
    ordered = sorted(attempts, key=lambda a: a.attempt)
    for failed, nxt in zip(ordered, ordered[1:], strict=False):
        if failed.state != "failed" or failed.last_step is None:
            continue
        lost = failed.last_step - nxt.start_step
        allowed = interval + failed.in_flight + slack
        if lost > allowed:
            extra = (f" + {failed.in_flight} (the save of step {failed.last_step - failed.in_flight} in flight)"
                     if failed.in_flight else "") + (f" + slack {slack}" if slack else "")
            problems.append(f"job {job_id}: attempt {failed.attempt} reached step {failed.last_step}, attempt "
                            f"{nxt.attempt} resumed at {nxt.start_step}: {lost} steps lost > interval {interval}"
                            + extra)
        if nxt.start_step > failed.last_step:
            problems.append(f"job {job_id}: attempt {nxt.attempt} resumed at {nxt.start_step}, beyond the "
                            f"{failed.last_step} steps attempt {failed.attempt} completed")
    return problems


def check_settled_after_heal(fault: str, unsettled: Mapping[str, Sequence[str]], waited_s: float,
                             bound_s: float) -> list[str]:
    """Every checkpoint a live attempt's ranks had written when a fault healed became READY or
    FAILED within ``bound_s`` of the heal (``unsettled``: job → what was still pending then)."""
    return [f"job {job}: {', '.join(refs)} neither READY nor FAILED {waited_s:.0f}s after the {fault} fault "
            f"healed (bound {bound_s:.0f}s)" for job, refs in sorted(unsettled.items())]


def check_resumed_from_latest_ready(job: JobRecord, checkpoints: Sequence[CheckpointRecord], *,
                                    margin_s: float = 1.0) -> list[str]:
    """Each attempt started from the newest checkpoint that was READY when it was placed (``margin_s``
    earlier: the coordinator stamps ``readyAt`` a moment before its write lands)."""
    problems = []
    ever_ready = [c for c in checkpoints if c.ready_at is not None]
    for a in job.attempts:
        before = [c for c in ever_ready
                  if c.ready_at is not None and (a.started_at - c.ready_at).total_seconds() > margin_s]
        newest = max((c.global_step for c in before), default=0)
        start = a.start_checkpoint.global_step if a.start_checkpoint else 0
        if start < newest:
            problems.append(f"job {job.job_id}: attempt {a.attempt} started from step {start}, but step {newest} "
                            f"was READY before it was placed")
    return problems


# ----------------------------------------------------------------------------- 5. bitwise identical


def compare_states(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two loaded checkpoint states differ (tensors bit for bit); empty when identical."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: a tensor on one side only"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        raw_a, raw_b = (t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        return [] if torch.equal(raw_a, raw_b) else [f"{path}: tensors differ"]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        problems = [f"{path}.{k}: present on one side only" for k in sorted(set(a) ^ set(b), key=str)]
        for k in sorted(set(a) & set(b), key=str):
            problems += compare_states(a[k], b[k], f"{path}.{k}")
        return problems
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in compare_states(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def check_bitwise_identical(reference: Mapping[str, Any], resumed: Mapping[str, Any],
                            keys: Sequence[str] = ("model", "optimizer")) -> list[str]:
    """The model and optimizer of the resumed run equal the uninterrupted run's, bit for bit."""
    problems = [f"{k}: missing from the {'reference' if k not in reference else 'resumed'} checkpoint"
                for k in keys if k not in reference or k not in resumed]
    for k in keys:
        if k in reference and k in resumed:
            problems += compare_states(reference[k], resumed[k], k)
    return problems


# ----------------------------------------------------------------------------- 9. one quorum per step (faultTolerance)

_COMMIT = r"committed step (\d+) in quorum (\S+) with (\d+) of (\d+) replicas"
_HEALED = r"healed from a peer at step (\d+)"


@dataclass(frozen=True)
class ReplicaLog:
    """What one replica process of a fault-tolerant attempt said: the steps it committed (with the quorum of
    each) and the steps it healed to from a peer, in order."""

    name: str
    commits: tuple[tuple[int, str], ...]
    heals: tuple[int, ...]

    @classmethod
    def parse(cls, name: str, text: str) -> ReplicaLog:
        import re

        commits = tuple((int(m.group(1)), m.group(2)) for m in re.finditer(_COMMIT, text))
        return cls(name, commits, tuple(int(m.group(1)) for m in re.finditer(_HEALED, text)))


def check_one_quorum_per_step(replicas: Sequence[ReplicaLog]) -> list[str]:
    """No step is applied by two quorums: every replica that committed a step did so in the same quorum (the
    others reach that step by healing from one of them); no replica applies a step twice or goes back; a step
    a replica skipped it healed past."""
    problems: list[str] = []
    quorums: dict[int, dict[str, list[str]]] = {}
    for replica in replicas:
        steps = [step for step, _ in replica.commits]
        for before, after in zip(steps, steps[1:], strict=False):
            if after <= before:
                problems.append(f"{replica.name} applied step {after} after step {before}")
            elif after > before + 1 and not any(before < healed < after for healed in replica.heals):
                problems.append(f"{replica.name} went from step {before} to {after} without healing")
        for step, quorum in replica.commits:
            quorums.setdefault(step, {}).setdefault(quorum, []).append(replica.name)
    for step, by_quorum in sorted(quorums.items()):
        if len(by_quorum) > 1:
            problems.append(f"step {step} was applied by {len(by_quorum)} quorums: "
                            + "; ".join(f"quorum {q} ({', '.join(names)})" for q, names in sorted(by_quorum.items())))
    return problems
