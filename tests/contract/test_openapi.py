"""The OpenAPI document tells the truth: schemathesis builds requests from it (valid ones, and invalid
ones from every constraint it states), sends them to the real API process (uvicorn and its
ServiceRuntime) over the suite's broker and Redis, and holds each answer to the document with every
check it has: status codes, bodies, headers and content types as documented, no 5xx, invalid input
refused and valid input accepted, authentication not ignored, ``Allow`` listing the path's methods.

``schemathesis.toml`` beside this file configures the run (tokens, which 422s valid input may get, the
seeded job with a metric history that half the drawn job ids name),
``checks.py`` adds this API's own check; ``st --config-file tests/contract/schemathesis.toml run …``
runs the same at any size by hand. The budget here is small (derandomized, so every run sends the same
requests); the by-hand runs are the large ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis.errors import FlakyStrategyDefinition
from hypothesis.stateful import run_state_machine_as_test

import tests.contract.checks  # noqa: F401 - registers this API's own check
from tests.support.api import HISTORY_JOB, api_in_thread

CONFIG = Path(__file__).with_name("schemathesis.toml")
BUDGET = settings(max_examples=10, stateful_step_count=4, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))

pytestmark = [
    pytest.mark.contract, pytest.mark.integration, pytest.mark.slow,
    # schemathesis's own strategies draw from `random`; derandomized runs still send the same requests
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]


@pytest.fixture
def api_schema(env: dict[str, object]) -> Iterator[schemathesis.BaseSchema]:
    """The document the running API serves, configured by schemathesis.toml, over a job with a metric history
    (half the job ids drawn are its id: the metrics routes answer with data, down-sampled to any maxPoints)."""
    with api_in_thread(env, admin=True, history=True) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json", config=schemathesis.Config.from_path(CONFIG))


schema = schemathesis.pytest.from_fixture("api_schema")


def credentials(case: schemathesis.Case) -> dict[str, str]:
    """The configured token, passed as this call's own: the checks then know it for a real credential
    (and that a 2xx without it would be authentication ignored)."""
    return case.operation.schema.config.headers_for(operation=case.operation)


@schema.parametrize()
@BUDGET
def test_every_operation_answers_as_the_document_says(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=credentials(case))


def test_sequences_of_calls_answer_as_the_document_says(api_schema: schemathesis.BaseSchema) -> None:
    """Submit a job, then read, list, pause or cancel it by the ids the answers give (the document's links)."""

    failures: list[BaseException] = []

    class Scenarios(api_schema.as_state_machine()):  # type: ignore[misc]  # schemathesis's dynamic base class
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"headers": credentials(case)}

        def validate_response(self, response: schemathesis.Response, case: schemathesis.Case,
                              additional_checks: Any = None, **kwargs: Any) -> None:
            try:
                case.validate_response(response, additional_checks=additional_checks, headers=kwargs.get("headers"),
                                       transport_kwargs=kwargs, recorder=getattr(self, "recorder", None))
            except BaseException as exc:
                failures.append(exc)
                raise

    try:
        run_state_machine_as_test(Scenarios, settings=BUDGET)
    except FlakyStrategyDefinition:
        # The API's state outlives each scenario (a tenant created by one makes the next one's create a
        # 409, so its links give other calls), and Hypothesis, replaying a prefix of choices, then sees
        # other rules to draw from. Schemathesis's own runner treats this the same way: a replay that
        # differs is not a failure, a check that failed on the way is.
        if failures:
            raise failures[0] from None


def test_the_metrics_of_a_job_with_history_answer_as_documented_at_any_max_points(
    api_schema: schemathesis.BaseSchema,
) -> None:
    """The request schemathesis 4 found a 500 with (``method=minmax&maxPoints=2`` over a job with a history),
    held to every check, with each method and the least maxPoints; by rank too, and over a window past the
    history (``fromStep``/``toStep`` are there all the same)."""
    operation = api_schema.find_operation_by_label("GET /v1/training-jobs/{job_id}/metrics")
    assert operation is not None
    for method in ("lttb", "minmax"):
        for max_points in (2, 3, 4, 5):
            asked = {"method": method, "maxPoints": max_points}
            for query in (asked, {**asked, "byRank": "true", "fromStep": 10, "toStep": 250},
                          {**asked, "fromStep": 100_000, "byRank": "true"}):
                case = operation.Case(path_parameters={"job_id": HISTORY_JOB}, query=query)
                response = case.call_and_validate(headers=credentials(case))
                body = response.json()
                assert response.status_code == 200 and {"fromStep", "toStep"} <= set(body), (query, body)
                if query.get("fromStep") != 100_000:
                    assert 0 < len(body["series"]["loss"]["steps"]) <= max_points, (query, body)
