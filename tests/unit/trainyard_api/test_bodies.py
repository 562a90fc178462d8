"""The request bodies are the shared models with narrower fields: the same JSON, the same spec hash."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainyard_api.bodies import PlanDevice, PlanLayout, SubmittedSpec
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.spec import TrainingSpec
from trainyard_planner import DeviceSpec, Layout

INLINE = {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 64, "maxSeqLen": 128}


@pytest.mark.parametrize("spec", [EXAMPLE_SPEC, {**EXAMPLE_SPEC, "modelConfig": INLINE}])
def test_a_submitted_spec_is_the_training_spec_with_its_hash(spec: dict) -> None:
    submitted = SubmittedSpec.model_validate(spec)
    assert isinstance(submitted, TrainingSpec)
    assert submitted.wire() == TrainingSpec.model_validate(spec).wire()
    assert submitted.spec_hash() == TrainingSpec.model_validate(spec).spec_hash()


@pytest.mark.parametrize("changes", [
    {"modelConfig": ""},  # the shared spec says so only in its model validator
    {"modelConfig": {**INLINE, "dFf": 10**400}},  # the shared spec takes it; the memory check overflowed
    {"training": {**EXAMPLE_SPEC["training"], "seed": 2**53}},  # type: ignore[dict-item]  # past I-JSON
])
def test_what_the_shared_spec_checks_late_or_not_at_all_is_a_field_constraint(changes: dict) -> None:
    with pytest.raises(ValidationError):
        SubmittedSpec.model_validate({**EXAMPLE_SPEC, **changes})


def test_planner_models_keep_their_defaults_and_descriptions_under_the_bounds() -> None:
    assert PlanLayout().model_dump() == Layout().model_dump()
    assert PlanLayout.model_fields["dp"].description == Layout.model_fields["dp"].description
    assert PlanDevice.model_fields["nvlink_domain"].default == DeviceSpec.model_fields["nvlink_domain"].default
    with pytest.raises(ValidationError):
        PlanLayout(dp=65_537)
