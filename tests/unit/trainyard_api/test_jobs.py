"""Job ids, control rules, new records, and the spec hash the API answers with."""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime

import pytest

from trainyard_api.jobs import control_refusal, new_job_id, new_job_record
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.records import TenantToken
from trainyard_contract.spec import TrainingSpec


def test_job_ids_are_job_dash_12_hex_and_idempotency_keys_are_per_tenant() -> None:
    assert re.fullmatch(r"job-[0-9a-f]{12}", new_job_id("t"))
    assert new_job_id("t") != new_job_id("t")
    assert new_job_id("t", "key") == new_job_id("t", "key")
    assert new_job_id("t", "key") != new_job_id("u", "key")
    assert re.fullmatch(r"job-[0-9a-f]{12}", new_job_id("t", "key"))


@pytest.mark.parametrize(("state", "action", "allowed"), [
    ("queued", "cancel", True), ("running", "cancel", True), ("paused", "cancel", True),
    ("succeeded", "cancel", False), ("failed", "cancel", False), ("cancelled", "cancel", False),
    ("running", "pause", True), ("paused", "pause", False), ("paused", "resume", True),
    ("running", "resume", False), ("succeeded", "resume", False),
])
def test_control_rules(state: str, action: str, allowed: bool) -> None:
    refusal = control_refusal(state, action)
    assert (refusal is None) == allowed
    if state in ("succeeded", "failed", "cancelled"):
        assert refusal is not None and f"already {state}" in refusal


def test_new_record_is_queued_with_tenant_submitter_and_trace() -> None:
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    now = datetime(2025, 1, 1, tzinfo=UTC)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    job = new_job_record("job-abc", spec, TenantToken(tenant="t", name="alice"), traceparent=tp,
                         max_attempts=5, now=now)
    assert (job.state, job.tenant, job.submitted_by, job.traceparent) == ("queued", "t", "alice", tp)
    assert job.spec_hash == spec.spec_hash() and job.max_attempts == 5 and job.created_at == now


def test_spec_hash_ignores_key_order_and_spelled_out_defaults() -> None:
    base = TrainingSpec.model_validate(EXAMPLE_SPEC).spec_hash()
    reordered = json.loads(json.dumps(dict(reversed(list(EXAMPLE_SPEC.items())))))
    assert TrainingSpec.model_validate(reordered).spec_hash() == base
    explicit = copy.deepcopy(EXAMPLE_SPEC)
    explicit["priority"] = 0
    explicit["training"]["optimizer"] = {"name": "adamw"}
    explicit["parallelism"]["tensor"] = 1
    assert TrainingSpec.model_validate(explicit).spec_hash() == base
    changed = copy.deepcopy(EXAMPLE_SPEC)
    changed["training"]["seed"] = 1235
    assert TrainingSpec.model_validate(changed).spec_hash() != base
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", base)
