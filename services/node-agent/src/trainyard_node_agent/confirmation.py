"""End-to-end confirmation of what the agent announces. Pure.

The broker is not the system of record: the local one keeps messages in memory, so a message it
acknowledged can still be lost with it. The agent therefore keeps each WorkerStarted,
WorkerExited and relayed ShardWritten until the durable state in Redis shows that its consumer
applied it, and publishes it again (same event id: consumers de-duplicate) while it does not:

* WorkerStarted  → the rank is in its attempt's ``startedRanks`` (JobRecord, by the scheduler);
* WorkerExited   → the rank is in its attempt's ``exitedRanks``;
* ShardWritten   → the coordinator recorded the rank's shard (``Keys.shards(job, attempt, step)``).

An announcement becomes moot when waiting for it makes no sense any more: the job is unknown or
finished, the attempt is no longer the live one it was for, the checkpoint is already settled.
A shard is moot too once its attempt ended (failed or revoked: no later checkpoint can use it) or its
epoch is older than the job's current one — the coordinator ignores a fenced epoch's shard, so it
would never be applied however often it is sent. :func:`explain` says why, for the log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.records import JobRecord

Verdict = Literal["confirmed", "pending", "moot"]
LIVE = frozenset({"starting", "running"})


@dataclass
class Announcement:
    """One event the agent published and waits to see applied."""

    event_id: str
    kind: Literal["started", "exited", "shard"]
    topic: str
    key: str
    payload: str
    traceparent: str | None
    job_id: str
    attempt: int
    allocation_id: str
    rank: int
    step: int | None = None
    epoch: int | None = None  # the shard's fencing epoch (shards only)
    first_at: float = 0.0  # when it was first published (monotonic)
    last_at: float = 0.0  # when it was last published
    republished: int = 0
    generation: int = 0  # faultTolerance: the rank's generation when it said it


def verdict(a: Announcement, job: JobRecord | None, *, shard_recorded: bool = False,
            checkpoint_state: str | None = None) -> Verdict:
    """Whether ``a`` has been applied, still waits, or no longer matters."""
    return explain(a, job, shard_recorded=shard_recorded, checkpoint_state=checkpoint_state)[0]


def explain(a: Announcement, job: JobRecord | None, *, shard_recorded: bool = False,
            checkpoint_state: str | None = None) -> tuple[Verdict, str]:
    """:func:`verdict`, and why (for the log line of a dropped announcement)."""
    if a.kind == "shard":
        return _shard(a, job, shard_recorded=shard_recorded, checkpoint_state=checkpoint_state)
    if job is None or job.state in TERMINAL_STATES:
        return "moot", "the job is " + ("unknown" if job is None else job.state)
    record = next((x for x in job.attempts if x.attempt == a.attempt), None)
    if record is None:
        return "pending", "the scheduler's record of the attempt has not landed yet"
    if record.allocation_id != a.allocation_id:
        return "moot", f"attempt {a.attempt} is allocation {record.allocation_id}, not {a.allocation_id}"
    if a.generation < record.generations.get(str(a.rank), 0):
        return "moot", f"rank {a.rank}'s generation {a.generation} was replaced"
    applied = a.rank in record.started_ranks if a.kind == "started" else str(a.rank) in record.exited_ranks
    if a.kind == "started" and a.generation and any(
            r.rank == a.rank and r.generation == a.generation and r.started_at is None for r in record.replacements):
        applied = False  # its rank started before, as an earlier generation
    if applied:
        return "confirmed", "applied"
    if record.state in LIVE:
        return "pending", "not applied yet"
    return "moot", f"attempt {a.attempt} ended ({record.state})"


def _shard(a: Announcement, job: JobRecord | None, *, shard_recorded: bool,
           checkpoint_state: str | None) -> tuple[Verdict, str]:
    if shard_recorded:
        return "confirmed", "applied"
    if checkpoint_state in ("READY", "FAILED", "DELETED"):
        return "moot", f"the checkpoint is {checkpoint_state} already"
    if job is None:
        return "pending", "the job is not in the store yet"
    if job.state in TERMINAL_STATES:
        return "moot", f"the job is {job.state}"
    current = job.current
    if a.epoch is not None and current is not None and current.epoch > a.epoch:
        return "moot", (f"its epoch {a.epoch} is stale (the job is at epoch {current.epoch}): the coordinator "
                        "ignores it as a fenced attempt's")
    record = next((x for x in job.attempts if x.attempt == a.attempt), None)
    if record is not None and record.state in ("failed", "revoked"):
        return "moot", f"attempt {a.attempt} ended ({record.state})"
    return "pending", "not recorded by the coordinator yet"
