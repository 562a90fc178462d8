"""What the node agent relays from a rank's spool: only what a rank may say, about itself. Pure.

A rank runs code the platform did not write, and everything it appends to its events file is a
claim, not a fact. The agent publishes a spool line only when :func:`check_line` accepts it:

* the event type is one a rank produces (:data:`RANK_EVENTS`: ShardWritten, StepMetrics,
  CheckpointRefused, EvaluationReported), on that type's own topic; anything else (a JobControlRequested, a
  GangAllocated, a NodeHeartbeat, a DatasetVersionPublished, …) is refused;
* the identity is the rank's own: job, tenant, attempt, epoch and rank, where the event has them,
  are *stamped* by the agent from the allocation it launched the rank for; a line that names
  another job, tenant, attempt, epoch or rank is refused, not corrected (it is a forgery, or a bug
  worth seeing);
* the files it points at are the job's own: a ShardWritten's shard and extra files lie under the
  job's checkpoint prefix; a CheckpointRefused names a checkpoint of the job's own, or the start
  checkpoint the allocation handed it (``initFrom``);
* the payload validates as that event (a malformed line is refused, as malformed, not a violation);
* the agent, not the rank, chooses the partition key (the job id), the event id (derived from the
  rank's own id and the allocation, so a rank cannot collide with another producer's events and a
  re-relayed line keeps its id) and the trace: the rank's traceparent is kept only when it is well
  formed and in the job's own trace.

A refusal says why; :attr:`Refusal.violation` tells a forgery (the shell fails the job, publishes
SecurityViolation) from a line that is merely unreadable (dead-lettered, nothing else).
"""

from __future__ import annotations

import os
import posixpath
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from pydantic import ValidationError
from trainyard_contract.events import CheckpointRefused, EvaluationReported, Event, ShardWritten, StepMetrics
from trainyard_contract.storage import ObjectPath, is_object_url

__all__ = ["RANK_EVENTS", "Refusal", "Relay", "RankIdentity", "check_line", "inside"]

RANK_EVENTS: dict[str, type[Event]] = {cls.model_fields["event_type"].default: cls
                                       for cls in (ShardWritten, StepMetrics, CheckpointRefused, EvaluationReported)}
_IDENTITY = ("job_id", "tenant", "attempt", "epoch", "rank")  # stamped where the event has the field
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_EVENT_IDS = uuid.UUID("6b0f2f4e-3c1a-4f7e-9a51-1f0c2d7e8a90")  # the namespace of relayed event ids


@dataclass(frozen=True)
class RankIdentity:
    """Who a rank is, from the allocation the agent launched it for (never from the rank)."""

    job_id: str
    tenant: str
    attempt: int
    allocation_id: str
    epoch: int
    rank: int
    checkpoints: str  # the job's checkpoint prefix: an absolute path, or an object-store URL (s3://…)
    start_manifest_uri: str | None = None  # the allocation's start checkpoint (may be another job's: initFrom)
    traceparent: str | None = None  # the launch's trace context (the job's trace)


@dataclass(frozen=True)
class Relay:
    """A line to publish: the agent's own rendering of the event."""

    topic: str
    key: str
    event: Event
    traceparent: str | None

    @property
    def body(self) -> bytes:
        return self.event.to_bytes()


@dataclass(frozen=True)
class Refusal:
    reason: str
    violation: bool  # a claim the rank may not make (fails the job); False: only unreadable or malformed
    event_type: str | None = None


def check_line(record: Mapping[str, Any], who: RankIdentity, *, offset: int) -> Relay | Refusal:
    """Whether to publish one spool line (see the module docstring), and as what. ``offset``: where
    the line ends in the spool (names a line that carries no event id of its own)."""
    if "corrupt" in record:
        return Refusal("unreadable spool line (not one JSON object)", violation=False)
    payload = record.get("payload")
    if not isinstance(payload, dict):
        return Refusal("spool line without a JSON object as its payload", violation=False)
    event_type = payload.get("eventType")
    cls = RANK_EVENTS.get(event_type) if isinstance(event_type, str) else None
    if cls is None:
        return Refusal(f"a rank may not publish {event_type!r} events (only {', '.join(sorted(RANK_EVENTS))})",
                       violation=True, event_type=str(event_type))
    topic = record.get("topic")
    if topic is not None and topic != cls.topic:
        return Refusal(f"{event_type} belongs on {cls.topic}, the rank sent it to {topic!r}", violation=True,
                       event_type=event_type)
    ours = {"job_id": who.job_id, "tenant": who.tenant, "attempt": who.attempt, "epoch": who.epoch,
            "rank": who.rank}
    stamped: dict[str, Any] = {}
    for name in _IDENTITY:
        field = cls.model_fields.get(name)
        if field is None:
            continue
        alias = field.alias or name
        claimed = payload.get(alias, payload.get(name))
        if claimed is not None and claimed != ours[name]:
            return Refusal(f"{event_type} names {alias} {claimed!r}; this rank's is {ours[name]!r}", violation=True,
                           event_type=event_type)
        stamped[alias] = ours[name]
    stamped["eventId"] = str(_event_id(payload.get("eventId") or f"offset:{offset}", who))
    try:
        event = cls.model_validate({**payload, **stamped})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "payload"
        return Refusal(f"malformed {event_type}: {where}: {first.get('msg')}", violation=False, event_type=event_type)
    if (why := _points_elsewhere(event, who)) is not None:
        return Refusal(why, violation=True, event_type=event_type)
    return Relay(topic=cls.topic, key=who.job_id, event=event, traceparent=_trace(record.get("traceparent"), who))


def inside(uri: str, prefix: str) -> bool:
    """Whether ``uri`` (a path or file:// URI) names something under the directory ``prefix``,
    after ``..`` and repeated slashes are resolved (lexically: symlinks are the shell's to check).
    An object-store ``prefix`` (``s3://bucket/key``) takes URLs of the same scheme and bucket only."""
    if is_object_url(prefix):
        return _inside_object_prefix(uri, prefix)
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file") or (parsed.scheme == "file" and parsed.netloc not in ("", "localhost")):
        return False
    path = unquote(parsed.path) if parsed.scheme else uri
    if not path.startswith("/"):
        return False
    base = os.path.normpath(prefix)
    return os.path.normpath(path).startswith(base.rstrip("/") + "/")


def _inside_object_prefix(uri: str, prefix: str) -> bool:
    scheme, sep, rest = uri.partition("://")
    base = ObjectPath.parse(prefix)
    if not sep or scheme != base.scheme or not rest.startswith(base.path.split("/", 1)[0] + "/"):
        return False
    key = posixpath.normpath("/" + rest).lstrip("/")  # ".." cannot climb out of the bucket
    return key.startswith(base.path + "/")


def _points_elsewhere(event: Event, who: RankIdentity) -> str | None:
    if isinstance(event, ShardWritten):
        for uri in (event.uri, *(f.uri for f in event.extra_files)):
            if not inside(uri, who.checkpoints):
                return f"ShardWritten names {uri!r}, outside the job's checkpoint prefix {who.checkpoints}"
    if isinstance(event, CheckpointRefused):
        own = inside(event.manifest_uri, who.checkpoints)
        if not own and event.manifest_uri != who.start_manifest_uri:
            return (f"CheckpointRefused names {event.manifest_uri!r}: neither a checkpoint of this job nor the "
                    "start checkpoint its allocation handed it")
    return None


def _event_id(claimed: Any, who: RankIdentity) -> uuid.UUID:
    """The relayed id: stable for the same line (the rank's own id) and this rank, unique to it."""
    return uuid.uuid5(_EVENT_IDS, f"{who.allocation_id}/{who.epoch}/{who.rank}/{claimed}")


def _trace(claimed: Any, who: RankIdentity) -> str | None:
    """The rank's traceparent when it is well formed and continues the job's trace; else the launch's."""
    if not isinstance(claimed, str) or (match := _TRACEPARENT.match(claimed)) is None:
        return who.traceparent
    launch = _TRACEPARENT.match(who.traceparent or "")
    if launch is not None and match.group(1) != launch.group(1):
        return who.traceparent
    return claimed
