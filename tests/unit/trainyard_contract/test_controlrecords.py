"""Control records: which JobControlRequested the API's record authorises, and which records a write prunes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from uuid import uuid4

import pytest

from trainyard_runtime.controlrecords import (
    CONTROL_REQUEST_TTL_S,
    MAX_CONTROL_REQUESTS,
    ControlRequest,
    control_refusal,
    expired_requests,
    parse_control_request,
    room_for_request,
)
from trainyard_contract.events import JobControlRequested

T0 = datetime(2026, 1, 1, tzinfo=UTC)
EVENT = JobControlRequested(event_id=uuid4(), job_id="job-1", tenant="victim", action="pause", reason="r")
RECORD = ControlRequest(job_id="job-1", tenant="victim", action="pause", reason="r", requested_by="alice", at=T0)


@pytest.mark.parametrize(("event_update", "recorded", "now_s", "refused"), [
    ({}, RECORD, 0, None),
    ({}, RECORD, CONTROL_REQUEST_TTL_S, None),  # exactly at the limit it still counts
    ({"reason": "another reason"}, RECORD, 0, None),  # the record's reason is what is applied
    ({}, None, 0, "unrecorded"),  # forged: the API never recorded it
    ({"action": "cancel"}, RECORD, 0, "mismatch"),  # a genuine event replayed with another action
    ({"tenant": "attacker"}, RECORD, 0, "mismatch"),
    ({"job_id": "job-2"}, RECORD, 0, "mismatch"),  # another job's record under this id (never written so)
    ({}, RECORD, CONTROL_REQUEST_TTL_S + 1, "expired"),
])
def test_control_refusal(event_update: dict[str, str], recorded: ControlRequest | None, now_s: int,
                         refused: str | None) -> None:
    event = EVENT.model_copy(update=event_update)
    refusal = control_refusal(event, recorded, now=T0 + timedelta(seconds=now_s))
    assert (refusal.kind if refusal else None) == refused
    if refusal is not None:
        assert str(EVENT.event_id) in refusal.text and "job-" in refusal.text


def test_a_record_round_trips_as_camel_case_json_and_garbage_authorises_nothing() -> None:
    raw = RECORD.dumps()
    assert '"requestedBy":"alice"' in raw and '"jobId":"job-1"' in raw
    assert parse_control_request(raw) == RECORD
    for garbage in (None, "", "{", '{"action": "cancel"}', '{"jobId": "j", "tenant": "t", "action": "delete", '
                                                            '"requestedBy": "x", "at": "2026-01-01T00:00:00Z"}'):
        assert parse_control_request(garbage) is None


def test_a_write_prunes_expired_and_unreadable_records_and_is_refused_at_the_cap() -> None:
    old = RECORD.model_copy(update={"at": T0 - timedelta(seconds=CONTROL_REQUEST_TTL_S + 1)})
    stored = {"fresh": RECORD.dumps(), "old": old.dumps(), "junk": "{"}
    expired = expired_requests(stored, now=T0)
    assert expired == ["junk", "old"]
    assert room_for_request(stored, expired)
    full = {str(i): RECORD.dumps() for i in range(MAX_CONTROL_REQUESTS)}
    assert not room_for_request(full, expired_requests(full, now=T0))
    assert room_for_request(full | {"old": old.dumps()}, ["0", "old"])  # one pruned: room again
