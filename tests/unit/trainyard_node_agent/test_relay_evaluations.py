"""EvaluationReported from a rank's spool: relayed as the rank's own (identity stamped), bounded, else refused."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard_contract.events import CHECKPOINTS, EVALUATION_MAX_METRICS, EvaluationReported
from trainyard_node_agent.relay import RANK_EVENTS

from tests.unit.trainyard_node_agent.test_relay_checks import WHO, line, refused, relayed


def payload(**changes: Any) -> dict[str, Any]:
    return {"eventType": "EvaluationReported", "jobId": "job-a", "tenant": "t1", "attempt": 2, "rank": 1,
            "metrics": {"loss": 2.5, "perplexity": 12.2}, **changes}


def test_a_ranks_evaluation_is_relayed_on_the_checkpoints_topic_with_its_identity_stamped() -> None:
    assert "EvaluationReported" in RANK_EVENTS
    out = relayed(line({k: v for k, v in payload().items() if k not in ("jobId", "tenant", "attempt", "rank")},
                       topic=CHECKPOINTS))
    assert isinstance(out.event, EvaluationReported) and out.topic == CHECKPOINTS and out.key == WHO.job_id
    assert (out.event.job_id, out.event.tenant, out.event.attempt, out.event.rank) == ("job-a", "t1", 2, 1)
    assert out.event.metrics == {"loss": 2.5, "perplexity": 12.2}


@pytest.mark.parametrize(("case", "changes"), [
    ("another job", {"jobId": "job-b"}),
    ("another tenant", {"tenant": "t2"}),
    ("another attempt", {"attempt": 1}),
    ("another rank", {"rank": 0}),
])
def test_an_evaluation_claiming_another_identity_is_a_violation(case: str, changes: dict[str, Any]) -> None:
    refusal = refused(line(payload(**changes), topic=CHECKPOINTS))
    assert refusal.violation and refusal.event_type == "EvaluationReported", case


@pytest.mark.parametrize(("case", "metrics"), [
    ("not a finite number", {"loss": float("nan")}),
    ("infinite", {"loss": float("inf")}),
    ("too many", {f"m{i}": 1.0 for i in range(EVALUATION_MAX_METRICS + 1)}),
    ("none at all", {}),
    ("a name too long", {"m" * 65: 1.0}),
    ("a name with odd characters", {"loss\n{evil}": 1.0}),
    ("a name that starts with no letter", {"_loss": 1.0}),
    ("not a number", {"loss": "low"}),
])
def test_an_oversized_or_non_finite_evaluation_is_refused_as_malformed(case: str, metrics: dict[str, Any]) -> None:
    refusal = refused(line(payload(metrics=metrics), topic=CHECKPOINTS))
    assert not refusal.violation and "malformed EvaluationReported" in refusal.reason, case


def test_an_evaluation_on_another_topic_is_a_violation() -> None:
    assert refused(line(payload(), topic="trainyard.metrics")).violation
