"""Triggers, the pure parts: which triggers a registered dataset version sets off, the spec a trigger
submits, and how its body (a template: a spec without dataset) is checked and its problems named."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import TypeAdapter

from trainyard_api.bodies import TEMPLATE_DATASET, TriggerCreateBody
from trainyard_api.schemas import EXAMPLE_SPEC, EXAMPLE_TEMPLATE
from trainyard_api.triggers import (
    idempotency_key,
    matching_triggers,
    shadowing_ref,
    trigger_spec,
    trigger_token,
    visible_as,
)
from trainyard_api.validation import FieldProblem, field_errors, strict_body_errors, under
from trainyard_contract.events import ArtifactRegistered
from trainyard_contract.records import TriggerRecord


def trigger(tenant: str = "acme", dataset: str = "wiki-*", sources: list[str] | None = None,
            enabled: bool = True, trigger_id: str = "trg-000000000001") -> TriggerRecord:
    return TriggerRecord(trigger_id=trigger_id, tenant=tenant, name=f"{tenant}-{dataset}", dataset=dataset,
                         sources=sources or ["own"], template=EXAMPLE_TEMPLATE, enabled=enabled)


def registered(ref: str, owner: str | None, shared_with: list[str] | None = None,
               kind: str = "dataset") -> ArtifactRegistered:
    return ArtifactRegistered(artifact_id=ref, kind=kind, tenant=owner, uri="file:///m.json", hash="sha256:" + "0" * 64,
                              dataset=ref if kind == "dataset" else None, shared_with=shared_with or [])


# ----------------------------------------------------------------------------- matching

OWN, PLATFORM, SHARED = ["own"], ["platform"], ["shared"]
EVERY = ["own", "platform", "shared"]


@pytest.mark.parametrize(("case", "t", "event", "matches"), [
    ("own dataset, own source", trigger(), registered("acme/wiki-en@v2", "acme"), True),
    ("the glob is on the name, not the version", trigger(dataset="wiki-en"), registered("acme/wiki-en@v2", "acme"),
     True),
    ("a name the glob does not match", trigger(), registered("acme/books@v1", "acme"), False),
    ("globs are case-sensitive", trigger(), registered("acme/Wiki-en@v1", "acme"), False),
    ("? and [] work", trigger(dataset="wiki-[ef]?"), registered("acme/wiki-en@v1", "acme"), True),
    ("disabled", trigger(enabled=False), registered("acme/wiki-en@v1", "acme"), False),
    ("platform dataset, own source only", trigger(), registered("wiki-en@v1", None), False),
    ("platform dataset, platform source", trigger(sources=PLATFORM), registered("wiki-en@v1", None), True),
    ("own dataset, platform source only", trigger(sources=PLATFORM), registered("acme/wiki-en@v1", "acme"), False),
    ("another tenant's, not shared", trigger(sources=EVERY), registered("globex/wiki-en@v1", "globex"), False),
    ("another tenant's, shared with others", trigger(sources=EVERY),
     registered("globex/wiki-en@v1", "globex", ["initech"]), False),
    ("another tenant's, shared with us, shared source", trigger(sources=SHARED),
     registered("globex/wiki-en@v1", "globex", ["initech", "acme"]), True),
    ("shared with every tenant", trigger(sources=SHARED), registered("globex/wiki-en@v1", "globex", ["*"]), True),
    ("shared with us, own source only", trigger(), registered("globex/wiki-en@v1", "globex", ["acme"]), False),
    ("not a dataset", trigger(), registered("art-1-model", "acme", kind="model"), False),
    ("a ref whose owner is not the event's tenant", trigger(sources=EVERY), registered("acme/wiki-en@v1", "globex",
                                                                                       ["*"]), False),
])
def test_matching_triggers(case: str, t: TriggerRecord, event: ArtifactRegistered, matches: bool) -> None:
    assert matching_triggers([t], event) == ([t] if matches else []), case


def test_matching_keeps_every_trigger_that_matches_and_only_those() -> None:
    mine, platform, theirs = trigger(), trigger(sources=PLATFORM, trigger_id="trg-2"), trigger("globex", "*")
    event = registered("acme/wiki-en@v3", "acme")
    assert matching_triggers([mine, platform, theirs], event) == [mine]
    assert matching_triggers([mine, platform, theirs], registered("wiki-de@v1", None)) == [platform]


def test_visible_as_names_the_source_a_dataset_is_for_the_triggers_tenant() -> None:
    t = trigger(sources=EVERY)
    assert visible_as(t, "acme", []) == "own"
    assert visible_as(t, None, []) == "platform"
    assert visible_as(t, "globex", ["acme"]) == "shared"
    assert visible_as(t, "globex", []) is None


def test_a_platform_version_is_shadowed_by_the_tenants_own_of_the_same_name_and_version() -> None:
    assert shadowing_ref(trigger(), registered("wiki-en@v1", None)) == "acme/wiki-en@v1"
    assert shadowing_ref(trigger(), registered("acme/wiki-en@v1", "acme")) is None
    assert shadowing_ref(trigger(), registered("globex/wiki-en@v1", "globex", ["*"])) is None


# ----------------------------------------------------------------------------- the job a trigger submits


def test_the_spec_is_the_template_with_the_version_and_hashes_as_the_same_spec_submitted_by_hand() -> None:
    spec = trigger_spec(EXAMPLE_TEMPLATE, "acme/wiki-en@v2")
    assert spec.dataset == "acme/wiki-en@v2"
    by_hand = trigger_spec(EXAMPLE_TEMPLATE, EXAMPLE_SPEC["dataset"])
    assert by_hand.spec_hash() == TypeAdapter(type(by_hand)).validate_python(EXAMPLE_SPEC).spec_hash()


def test_one_idempotency_key_per_trigger_and_version() -> None:
    keys = {idempotency_key(t, d) for t in ("trg-1", "trg-2") for d in ("wiki@v1", "acme/wiki@v1", "wiki@v2")}
    assert len(keys) == 6
    assert idempotency_key("trg-1", "wiki@v1") == idempotency_key("trg-1", "wiki@v1")


def test_its_jobs_are_submitted_for_its_tenant_in_its_name() -> None:
    token = trigger_token(trigger())
    assert (token.tenant, token.name, token.effective_role) == ("acme", "trigger:acme-wiki-*", "submitter")


# ----------------------------------------------------------------------------- the body


def body_problems(body: dict[str, Any]) -> dict[str, str]:
    errors = strict_body_errors(TypeAdapter(TriggerCreateBody), json.dumps(body).encode())
    return {p.field: p.message for p in field_errors(errors)}


def test_a_template_is_a_spec_without_dataset() -> None:
    body = TriggerCreateBody.model_validate({"name": "wiki", "dataset": "wiki-*", "template": EXAMPLE_TEMPLATE})
    assert body.sources == ["own"] and body.enabled
    stored = body.template.wire_template()
    assert "dataset" not in stored
    assert body.template.dataset == TEMPLATE_DATASET  # what the checks see, and ignore
    assert body_problems({"name": "wiki", "dataset": "wiki-*", "template": EXAMPLE_TEMPLATE}) == {}


@pytest.mark.parametrize(("change", "field", "says"), [
    ({"resources": {"gpuType": "cpu", "gpus": 2}}, "template.resources.gpus", "unknown field"),
    ({"resources": {"gpuType": "cpu", "gpuCount": 0}}, "template.resources.gpuCount", "greater than 0"),
    ({"resources": {"gpuType": "cpu", "gpuCount": 3}}, "template.parallelism", "must equal resources.gpuCount"),
    ({"dataset": "tinycorpus@v1"}, "template.dataset", "names no dataset"),
    ({"training": {**EXAMPLE_TEMPLATE["training"], "learningRate": "fast"}}, "template.training.learningRate",
     "number"),
])
def test_a_bad_template_is_named_field_by_field_under_template(change: dict[str, Any], field: str, says: str) -> None:
    found = body_problems({"name": "wiki", "dataset": "wiki-*", "template": {**EXAMPLE_TEMPLATE, **change}})
    assert field in found and says in found[field], found


def test_the_triggers_own_fields_are_checked() -> None:
    found = body_problems({"name": "-no", "dataset": "wiki/*", "sources": ["everyone"], "template": EXAMPLE_TEMPLATE})
    assert {"name", "dataset", "sources[0]"} <= set(found), found
    assert "template" in body_problems({"name": "wiki", "dataset": "wiki-*"})


def test_reference_problems_of_a_template_are_named_under_template() -> None:
    problems = [FieldProblem("modelConfig", "unknown model"), FieldProblem("spec", "invalid")]
    assert under("template", problems) == [FieldProblem("template.modelConfig", "unknown model"),
                                           FieldProblem("template", "invalid")]
