"""The contract's own check excuses a 422 to schema-valid input only for the rules it names."""

from __future__ import annotations

import pytest

from tests.contract.checks import unexplained_problems

pytestmark = pytest.mark.contract


def test_a_rule_beyond_the_schema_is_excused_and_anything_else_is_not() -> None:
    unknown = {"field": "dataset", "message": "unknown dataset 'x@1': it is not in the dataset registry"}
    bound = {"field": "training.maxSteps", "message": "Input should be less than or equal to 10000000"}
    assert unexplained_problems("POST /v1/training-jobs", [unknown]) == []
    assert unexplained_problems("POST /v1/training-jobs", [unknown, bound]) == [bound]
    # a rule is the field's: the same words on another field are not excused
    assert unexplained_problems("POST /v1/plan", [unknown]) == [unknown]
    assert unexplained_problems("GET /v1/training-jobs", "not a list") == [{"field": "", "message": "not a list"}]


def test_a_triggers_template_is_excused_the_rules_of_a_submission_under_template_but_not_its_dataset() -> None:
    unknown = {"field": "template.modelConfig", "message": "unknown model 'gpt-huge@v9': the model catalog has …"}
    bare = {"field": "modelConfig", "message": unknown["message"]}
    dataset = {"field": "template.dataset", "message": "unknown dataset 'x@1': it is not in the dataset registry"}
    assert unexplained_problems("POST /v1/triggers", [unknown, bare, dataset]) == [bare, dataset]


def test_a_series_the_job_never_reported_is_excused_and_nothing_else_of_the_metrics_query() -> None:
    from trainyard_telemetry.metrics_history import parse_series
    from trainyard_contract.errors import SpecError

    with pytest.raises(SpecError) as refused:  # the words the route really answers with
        parse_series("loss,0000", ["gradNorm"], by_rank=False)
    unknown = {"field": refused.value.field, "message": refused.value.detail}
    bound = {"field": "query.maxPoints", "message": "Input should be greater than or equal to 2"}
    assert unexplained_problems("GET /v1/training-jobs/{job_id}/metrics", [unknown, bound]) == [bound]
    assert unexplained_problems("GET /v1/training-jobs/{job_id}/ranks", [unknown]) == [unknown]
