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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainyard_common.events import TERMINAL_STATES
from trainyard_common.records import JobRecord

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
    first_at: float = 0.0  # when it was first published (monotonic)
    last_at: float = 0.0  # when it was last published
    republished: int = 0


def verdict(a: Announcement, job: JobRecord | None, *, shard_recorded: bool = False,
            checkpoint_state: str | None = None) -> Verdict:
    """Whether ``a`` has been applied, still waits, or no longer matters."""
    if a.kind == "shard":
        if shard_recorded:
            return "confirmed"
        if checkpoint_state in ("READY", "FAILED", "DELETED"):
            return "moot"
        return "moot" if job is not None and job.state in TERMINAL_STATES else "pending"
    if job is None or job.state in TERMINAL_STATES:
        return "moot"
    record = next((x for x in job.attempts if x.attempt == a.attempt), None)
    if record is None:
        return "pending"  # the scheduler's record of the attempt has not landed yet
    if record.allocation_id != a.allocation_id:
        return "moot"
    applied = a.rank in record.started_ranks if a.kind == "started" else str(a.rank) in record.exited_ranks
    if applied:
        return "confirmed"
    return "pending" if record.state in LIVE else "moot"
