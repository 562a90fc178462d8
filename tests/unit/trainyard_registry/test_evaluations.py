"""The registry's attach decision (evaluations.decide): a rank's EvaluationReported is attached to the checkpoint
its job's spec names, for an evaluation job of the trained job's tenant only, never to one the event claims."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.events import EvaluationReported
from trainyard_contract.records import ArtifactRecord, JobRecord, Lineage
from trainyard_contract.spec import TrainingSpec
from trainyard_registry.evaluations import Attach, Ignore, Missing, decide, evaluated_checkpoint

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
TRAINED = "job-aaaaaaaaaaaa"
EVAL = "job-eeeeeeeeeeee"


def job(job_id: str, tenant: str = "acme", **spec: Any) -> JobRecord:
    s = TrainingSpec.model_validate({**EXAMPLE_SPEC, **spec})
    return JobRecord(job_id=job_id, tenant=tenant, spec=s, spec_hash=s.spec_hash())


def evaluation(tenant: str = "acme", step: int | None = 20, **spec: Any) -> JobRecord:
    init = {"jobId": TRAINED, **({"globalStep": step} if step is not None else {})}
    return job(EVAL, tenant, **{"evaluation": {}, "initFrom": init, **spec})


def artifact(step: int, attempt: int = 1, *, tenant: str = "acme", retired: bool = False,
             type_: str = "checkpoint") -> ArtifactRecord:
    return ArtifactRecord(
        artifact_id=f"{TRAINED}/{type_}/step-{step:09d}-a{attempt}", job_id=TRAINED, tenant=tenant, type=type_,
        uri="file:///m.json", hash="sha256:" + "0" * 64, producer_attempt=attempt, global_step=step,
        lineage=Lineage.model_validate({"specHash": "sha256:x", "codeRevision": "r", "dataset": "d@v1",
                                        "modelConfig": "gpt-tiny@v1"}),
        retired_at=NOW if retired else None)


def reported(tenant: str = "acme", rank: int = 0, job_id: str = EVAL) -> EvaluationReported:
    return EvaluationReported(job_id=job_id, tenant=tenant, attempt=1, rank=rank, metrics={"loss": 2.5})


ARTS = [artifact(10), artifact(20)]


def test_the_result_is_attached_to_the_checkpoint_the_evaluation_jobs_spec_names() -> None:
    decision = decide(reported(), evaluation(), job(TRAINED), ARTS, now=NOW)
    assert isinstance(decision, Attach) and decision.job_id == TRAINED
    r = decision.result
    assert (r.evaluation_job_id, r.checkpoint_id, r.global_step, r.metrics, r.finished_at) == (
        EVAL, f"{TRAINED}/checkpoint/step-000000020-a1", 20, {"loss": 2.5}, NOW)


@pytest.mark.parametrize(("case", "event", "evaluated", "trained", "reason", "violation"), [
    ("a job that is no evaluation", reported(), job(EVAL), job(TRAINED), "not-evaluation", True),
    ("an evaluation without its step", reported(), evaluation(step=None), job(TRAINED), "not-evaluation", True),
    ("the event's tenant is not the job's", reported(tenant="globex"), evaluation(), job(TRAINED), "tenant", True),
    ("a rank other than 0", reported(rank=1), evaluation(), job(TRAINED), "rank", False),
    ("tenant A's evaluation names tenant B's job", reported(), evaluation(), job(TRAINED, "globex"),
     "other-tenant", True),
    ("the trained job does not exist", reported(), evaluation(), None, "other-tenant", True),
])
def test_what_attaches_nothing(case: str, event: EvaluationReported, evaluated: JobRecord,
                               trained: JobRecord | None, reason: str, violation: bool) -> None:
    decision = decide(event, evaluated, trained, ARTS, now=NOW)
    assert isinstance(decision, Ignore), case
    assert (decision.reason, decision.violation) == (reason, violation), case


def test_a_missing_record_is_retried() -> None:
    assert isinstance(decide(reported(), None, None, [], now=NOW), Missing)
    assert isinstance(decide(reported(), evaluation(step=30), job(TRAINED), ARTS, now=NOW), Missing)


def test_the_evaluated_checkpoint_prefers_a_live_one_then_the_latest_attempt() -> None:
    arts = [artifact(20, 1), artifact(20, 2, retired=True), artifact(20, 3, tenant="globex"),
            artifact(20, 4, type_="model")]
    assert evaluated_checkpoint(arts, tenant="acme", global_step=20).producer_attempt == 1
    assert evaluated_checkpoint([*arts, artifact(20, 5)], tenant="acme", global_step=20).producer_attempt == 5
    assert evaluated_checkpoint(arts, tenant="acme", global_step=10) is None
