"""checkpointReady triggers, the pure parts: which READY checkpoints set a trigger off (its tenant only, its job or
experiment, everySteps), the evaluation it submits, and what its body must say."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard_api.bodies import TriggerCreateBody
from trainyard_api.schemas import EXAMPLE_SPEC, EXAMPLE_TEMPLATE
from trainyard_api.triggers import (
    checkpoint_matches,
    checkpoint_spec,
    creation_problems,
    experiment_of,
    idempotency_key,
    matching_checkpoint_triggers,
    matching_triggers,
)
from trainyard_api.validation import check_evaluation
from trainyard_contract.events import ArtifactRegistered
from trainyard_contract.records import ExperimentOrigin, JobRecord, TriggerRecord
from trainyard_contract.spec import TrainingSpec

EVAL_TEMPLATE = {**EXAMPLE_TEMPLATE, "evaluation": {"batches": 4}}


def trigger(*, tenant: str = "acme", job: str | None = "job-aaaaaaaaaaaa", experiment: str | None = None,
            every: int | None = None, enabled: bool = True) -> TriggerRecord:
    return TriggerRecord(trigger_id="trg-000000000001", tenant=tenant, name="evals", on="checkpointReady", job=job,
                         experiment=experiment, every_steps=every, template=EVAL_TEMPLATE, enabled=enabled)


def checkpoint(step: int | None = 20, *, tenant: str | None = "acme", job: str = "job-aaaaaaaaaaaa",
               kind: str = "checkpoint") -> ArtifactRegistered:
    return ArtifactRegistered(artifact_id=f"{job}/{kind}/step-{step or 0:09d}-a1", kind=kind, tenant=tenant,
                              uri="file:///m.json", hash="sha256:" + "0" * 64, job_id=job, global_step=step)


@pytest.mark.parametrize(("case", "t", "event", "experiment", "matches"), [
    ("the watched job's checkpoint", trigger(), checkpoint(), None, True),
    ("another job's", trigger(), checkpoint(job="job-bbbbbbbbbbbb"), None, False),
    ("another tenant's checkpoint of a job of that id", trigger(), checkpoint(tenant="globex"), None, False),
    ("a checkpoint without tenant", trigger(), checkpoint(tenant=None), None, False),
    ("a model artifact is no checkpoint", trigger(), checkpoint(kind="model"), None, False),
    ("disabled", trigger(enabled=False), checkpoint(), None, False),
    ("everySteps divides the step", trigger(every=10), checkpoint(20), None, True),
    ("everySteps does not", trigger(every=15), checkpoint(20), None, False),
    ("step 0 is a multiple of anything", trigger(every=15), checkpoint(0), None, True),
    ("no step", trigger(), checkpoint(None), None, False),
    ("a job of the watched experiment", trigger(job=None, experiment="exp-1"), checkpoint(), "exp-1", True),
    ("a job of another experiment", trigger(job=None, experiment="exp-1"), checkpoint(), "exp-2", False),
    ("a job of no experiment", trigger(job=None, experiment="exp-1"), checkpoint(), None, False),
    ("experiment watched, another tenant's job in it", trigger(job=None, experiment="exp-1"),
     checkpoint(tenant="globex"), "exp-1", False),
])
def test_which_checkpoints_set_a_checkpoint_trigger_off(case: str, t: TriggerRecord, event: ArtifactRegistered,
                                                        experiment: str | None, matches: bool) -> None:
    assert checkpoint_matches(t, event, experiment=experiment) is matches, case
    assert (matching_checkpoint_triggers([t], event, experiment=experiment) == [t]) is matches, case


def test_dataset_and_checkpoint_triggers_never_answer_each_others_events() -> None:
    dataset_trigger = TriggerRecord(trigger_id="trg-000000000002", tenant="acme", name="wiki", dataset="*",
                                    template=EXAMPLE_TEMPLATE)
    assert not checkpoint_matches(dataset_trigger, checkpoint(), experiment=None)
    version = ArtifactRegistered(artifact_id="acme/wiki@v1", kind="dataset", tenant="acme", uri="file:///m.json",
                                 hash="sha256:" + "0" * 64, dataset="acme/wiki@v1")
    assert matching_triggers([trigger(), dataset_trigger], version) == [dataset_trigger]
    assert TriggerRecord.model_validate_json(dataset_trigger.dumps()).on == "datasetVersion"  # the default


def test_a_jobs_experiment_is_read_from_its_record_when_it_has_one() -> None:
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    job = JobRecord(job_id="job-aaaaaaaaaaaa", tenant="acme", spec=spec, spec_hash=spec.spec_hash())
    assert experiment_of(job) is None and experiment_of(None) is None
    trial = job.model_copy(update={"experiment": ExperimentOrigin(experiment_id="exp-1", experiment_name="lr",
                                                                  trial=0, params={})})
    assert experiment_of(trial) == "exp-1"


def test_the_evaluation_is_the_template_with_the_checkpoint_and_the_trained_jobs_dataset() -> None:
    spec = checkpoint_spec(EVAL_TEMPLATE, dataset="acme/wiki@v1", job_id="job-aaaaaaaaaaaa", global_step=20)
    assert spec.dataset == "acme/wiki@v1" and spec.evaluation is not None and spec.evaluation.batches == 4
    assert spec.init_from is not None and (spec.init_from.job_id, spec.init_from.global_step) == (
        "job-aaaaaaaaaaaa", 20)
    assert check_evaluation(spec) == []
    ref = "job-a/checkpoint/step-000000020-a1"
    assert idempotency_key("trg-1", ref) == f"trigger:trg-1:{ref}"


def body(**fields: Any) -> TriggerCreateBody:
    return TriggerCreateBody.model_validate({"name": "evals", "template": EVAL_TEMPLATE, **fields})


@pytest.mark.parametrize(("case", "fields", "problems"), [
    ("a job trigger", {"on": "checkpointReady", "job": "job-a", "everySteps": 10}, set()),
    ("an experiment trigger", {"on": "checkpointReady", "experiment": "exp-1"}, set()),
    ("neither job nor experiment", {"on": "checkpointReady"}, {"job"}),
    ("both", {"on": "checkpointReady", "job": "job-a", "experiment": "exp-1"}, {"job"}),
    ("a dataset glob too", {"on": "checkpointReady", "job": "job-a", "dataset": "wiki-*"}, {"dataset"}),
    ("a template that is no evaluation", {"on": "checkpointReady", "job": "job-a", "template": EXAMPLE_TEMPLATE},
     {"template.evaluation"}),
    ("a template with initFrom", {"on": "checkpointReady", "job": "job-a",
                                  "template": {**EVAL_TEMPLATE, "initFrom": {"jobId": "job-b", "globalStep": 1}}},
     {"template.initFrom"}),
    ("a dataset trigger, as before", {"dataset": "wiki-*"}, set()),
    ("a dataset trigger without its glob", {}, {"dataset"}),
    ("a dataset trigger with checkpoint fields", {"dataset": "wiki-*", "job": "job-a", "everySteps": 5},
     {"job", "everySteps"}),
])
def test_what_on_asks_of_a_triggers_body(case: str, fields: dict[str, Any], problems: set[str]) -> None:
    assert {p.field for p in creation_problems(body(**fields))} == problems, case


@pytest.mark.parametrize(("case", "changes", "fields"), [
    ("a checkpoint at a step", {"initFrom": {"jobId": "job-a", "globalStep": 20}}, set()),
    ("no initFrom", {}, {"initFrom.jobId"}),
    ("a Hugging Face directory is no checkpoint", {"initFrom": {"huggingFace": "models/gpt2"}}, {"initFrom.jobId"}),
    ("the latest READY one is not one checkpoint", {"initFrom": {"jobId": "job-a"}}, {"initFrom.globalStep"}),
    ("nothing trained to export", {"initFrom": {"jobId": "job-a", "globalStep": 20}, "export": {"format": "hf"}},
     {"export"}),
])
def test_an_evaluation_spec_names_one_checkpoint_and_trains_nothing(case: str, changes: dict[str, Any],
                                                                    fields: set[str]) -> None:
    spec = TrainingSpec.model_validate({**EXAMPLE_SPEC, "evaluation": {}, **changes})
    assert {p.field for p in check_evaluation(spec)} == fields, case


def test_a_spec_without_evaluation_keeps_its_hash() -> None:
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    assert "evaluation" not in spec.wire()
    assert TrainingSpec.model_validate({**EXAMPLE_SPEC, "evaluation": None}).spec_hash() == spec.spec_hash()
    assert TrainingSpec.model_validate({**EXAMPLE_SPEC, "evaluation": {}}).wire()["evaluation"] == {"batches": 8}
