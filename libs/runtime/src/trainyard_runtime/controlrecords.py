"""Control requests the API recorded: the authority behind a ``JobControlRequested``.

An event on the bus is a wake-up, not a fact: whoever reaches the broker can publish a JobControlRequested.
The API records every control request it accepts in :meth:`Keys.control_requests` (a hash per job: field = the
event's ``eventId``, value = a :class:`ControlRequest` as JSON) in the same MULTI that stages the event in its
outbox (:func:`stage_control_request`), so the event is never published without its record. The scheduler acts
on an event only when :func:`control_refusal` finds its record and it matches (job, tenant, action) and is
younger than :data:`CONTROL_REQUEST_TTL_S`; what it acts on is the record (its reason), never the event's copy.

Bounds (a job's hash stays small whatever a caller does):

* a record counts for :data:`CONTROL_REQUEST_TTL_S` (3 days) after the API wrote it: long enough for its event
  to be relayed and consumed through a long broker or scheduler outage, and shorter than the scheduler's memory
  of the event ids it handled (``bus.SEEN_TTL_S``, 7 days), so that a genuine event replayed later meets either
  that memory (a duplicate, dropped) or a record too old to count (refused) — never a second effect;
* every write prunes the job's records older than that and re-arms the key's expiry (a job nobody controls for
  three days has no hash);
* at most :data:`MAX_CONTROL_REQUESTS` live records per job (256 in three days: far beyond any person's or
  pipeline's pause/resume rhythm); the API refuses the request past that (409) instead of dropping a record
  whose event may not have been consumed yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from trainyard_contract.errors import AuthError
from trainyard_contract.events import JobControlRequested
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import Keys
from trainyard_contract.wirebase import FrozenWire

__all__ = ["CONTROL_REQUEST_TTL_S", "MAX_CONTROL_REQUESTS", "ControlRequest", "Refusal", "UnauthorisedEventError",
           "control_refusal", "expired_requests", "parse_control_request", "record_control_request", "room_for_request",
           "stage_control_record", "stage_control_request"]

CONTROL_REQUEST_TTL_S = 3 * 24 * 3600
"""How long a recorded control request authorises its event (see the module docstring)."""

MAX_CONTROL_REQUESTS = 256
"""Live (unexpired) control records one job may have; the API refuses the next one."""

Action = Literal["cancel", "pause", "resume"]


class ControlRequest(FrozenWire):
    """What the API recorded of one accepted control request (camelCase JSON in the job's hash)."""

    job_id: str
    tenant: str
    action: Action
    reason: str | None = None
    requested_by: str
    at: datetime

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True)


@dataclass(frozen=True)
class Refusal:
    """Why an event is not acted on: ``kind`` is a metric label (bounded), ``text`` says it to a person."""

    kind: Literal["unrecorded", "mismatch", "expired"]
    text: str


class UnauthorisedEventError(AuthError):
    """A job event its owner's record does not back (an AuthError: never retried). Raised by a handler, it is
    dead-lettered ``security: …`` and its event id is not marked handled, so a forged copy reusing a genuine
    event's id, consumed first, cannot make the genuine one a duplicate."""

    def __init__(self, event_type: str, refusal: Refusal) -> None:
        super().__init__(f"security: {event_type} refused ({refusal.kind}): {refusal.text}", retryable=False)
        self.refusal = refusal


def parse_control_request(raw: str | bytes | None) -> ControlRequest | None:
    """The stored record, or None when there is none or it cannot be read (an unreadable record authorises nothing)."""
    if not raw:
        return None
    try:
        return ControlRequest.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


# ----------------------------------------------------------------------------- pure decisions


def control_refusal(event: JobControlRequested, recorded: ControlRequest | None, *, now: datetime,
                    ttl_s: float = CONTROL_REQUEST_TTL_S) -> Refusal | None:
    """Why ``event`` must be ignored (None: the API recorded exactly this request, recently enough)."""
    what = f"{event.action} of job {event.job_id} (tenant {event.tenant!r}, event {event.event_id})"
    if recorded is None:
        return Refusal("unrecorded", f"{what}: no control request recorded by the API")
    differs = [f"{name} {got!r} (recorded {want!r})" for name, got, want in (
        ("job", event.job_id, recorded.job_id), ("tenant", event.tenant, recorded.tenant),
        ("action", event.action, recorded.action)) if got != want]
    if differs:
        return Refusal("mismatch", f"{what}: not what the API recorded: {', '.join(differs)}")
    if now - recorded.at > timedelta(seconds=ttl_s):
        return Refusal("expired", f"{what}: recorded at {recorded.at.isoformat()}, over {ttl_s:.0f} s ago")
    return None


def expired_requests(stored: Mapping[str, str], *, now: datetime, ttl_s: float = CONTROL_REQUEST_TTL_S) -> list[str]:
    """Fields of a job's hash that no longer count (older than ``ttl_s``, or unreadable): pruned at the next write."""
    horizon = now - timedelta(seconds=ttl_s)
    return sorted(field for field, raw in stored.items()
                  if (record := parse_control_request(raw)) is None or record.at < horizon)


def room_for_request(stored: Mapping[str, str], expired: Iterable[str], *,
                     limit: int = MAX_CONTROL_REQUESTS) -> bool:
    """Whether one more record fits once ``expired`` are pruned."""
    return len(set(stored) - set(expired)) < limit


# ----------------------------------------------------------------------------- writing (the API's; tests play it)


def stage_control_record(pipe: Pipeline, event: JobControlRequested, *, requested_by: str, at: datetime,
                         expired: Iterable[str] = ()) -> None:
    """Inside the caller's MULTI: the record of ``event`` (the same job, tenant, action and reason), the job's
    expired records pruned, the key's expiry re-armed."""
    key = Keys.control_requests(event.job_id)
    record = ControlRequest(job_id=event.job_id, tenant=event.tenant, action=event.action, reason=event.reason,
                            requested_by=requested_by, at=at)
    if stale := list(expired):
        pipe.hdel(key, *stale)
    pipe.hset(key, str(event.event_id), record.dumps())
    pipe.expire(key, CONTROL_REQUEST_TTL_S)


def stage_control_request(pipe: Pipeline, outbox: Outbox, event: JobControlRequested, *, requested_by: str,
                          at: datetime, expired: Iterable[str] = (), traceparent: str | None = None) -> None:
    """The record and the event in one MULTI (the API's :meth:`JobService.control`): the outbox relays the event
    only after the MULTI, with its replication confirmation, ran — the record is there before anyone can read the
    event."""
    stage_control_record(pipe, event, requested_by=requested_by, at=at, expired=expired)
    outbox.stage(pipe, event, traceparent=traceparent)


async def record_control_request(redis: Redis, event: JobControlRequested, *, requested_by: str,
                                 at: datetime) -> None:
    """The record alone, in a MULTI of its own: for tests and tools that publish the event themselves, as the
    API's outbox would."""
    async with redis.pipeline(transaction=True) as pipe:
        stage_control_record(pipe, event, requested_by=requested_by, at=at)
        await pipe.execute()

