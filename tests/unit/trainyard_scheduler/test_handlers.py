"""The scheduler's own pure checks: a JobSubmitted is a wake-up, the job is the record the API stored."""

from __future__ import annotations

import pytest

from trainyard_contract.events import JobSubmitted
from trainyard_contract.records import JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_scheduler.handlers import submission_refusal

SPEC = TrainingSpec.model_validate({
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "t",
    "resources": {"gpuType": "cpu", "gpuCount": 1}, "parallelism": {"data": 1},
    "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 1, "learningRate": 0.001,
                 "maxSteps": 2},
})
OTHER = SPEC.model_copy(update={"code_revision": "attacker"})
STORED = JobRecord(job_id="job-1", tenant="victim", spec=SPEC, spec_hash=SPEC.spec_hash())


@pytest.mark.parametrize(("tenant", "spec", "stored", "refused"), [
    ("victim", SPEC, STORED, None),
    ("victim", SPEC, None, "unrecorded"),  # forged straight onto the bus: no job is created
    ("attacker", SPEC, STORED, "mismatch"),  # the record wins
    ("victim", OTHER, STORED, "mismatch"),
])
def test_submission_refusal(tenant: str, spec: TrainingSpec, stored: JobRecord | None, refused: str | None) -> None:
    event = JobSubmitted(job_id="job-1", tenant=tenant, spec=spec, spec_hash=spec.spec_hash())
    refusal = submission_refusal(event, stored)
    assert (refusal.kind if refusal else None) == refused
