"""A rank that would buy itself time or claim a ready environment: the node's EnvironmentPreparing is the node
agent's word, never a rank's. Spooled by a rank (its own attempt, its own identity, on the workers topic), it is
refused as a claim a rank may not make — it could otherwise restart its attempt's start time-out forever, or make
the attempt read "ready" for an environment no node built. And even on the bus, the scheduler notes one only for
the attempt's current allocation and epoch (tests/unit/trainyard_scheduler/test_transitions.py)."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from trainyard_contract.events import WORKERS, EnvironmentPreparing
from trainyard_node_agent.relay import RankIdentity, Refusal, check_line

WHO = RankIdentity(job_id="job-a", tenant="t1", attempt=2, allocation_id="alloc-2", epoch=5, rank=1,
                   checkpoints="/art/tenants/t1/jobs/job-a/checkpoints", start_manifest_uri=None, traceparent=None)

pytestmark = [pytest.mark.security]


@pytest.mark.parametrize("state", ["building", "ready", "failed"])
def test_a_rank_cannot_speak_for_its_nodes_environment(state: Literal["building", "ready", "failed"]) -> None:
    forged = EnvironmentPreparing(job_id="job-a", attempt=2, allocation_id="alloc-2", epoch=5, node_id="node-0",
                                  environment="sha256:" + "e" * 64, state=state, cached=True)
    record = {"topic": WORKERS, "key": "job-a", "traceparent": None, "payload": json.loads(forged.to_bytes())}
    checked = check_line(record, WHO, offset=0)
    assert isinstance(checked, Refusal) and checked.violation
    assert "may not publish 'EnvironmentPreparing'" in checked.reason
