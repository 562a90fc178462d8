"""The one door's check (trainyard_scheduler.intake.intake_refusals): a job is taken in only when its tenant may read
its dataset, decided over the records read in one round trip."""

from __future__ import annotations

from trainyard_contract.records import DatasetRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_scheduler.intake import intake_refusals

from tests.support.api import spec_with


def stored(job_id: str, tenant: str, dataset: str) -> JobRecord:
    spec = TrainingSpec.model_validate(spec_with(dataset=dataset))
    return JobRecord(job_id=job_id, tenant=tenant, spec=spec, spec_hash=spec.spec_hash())


def record(tenant: str | None, shared_with: list[str] | None = None) -> str:
    return DatasetRecord(name="wiki", version="v1", tenant=tenant, shared_with=shared_with or [],
                         manifest_uri="file:///x/manifest.json", sha256="a" * 64).model_dump_json(by_alias=True)


def test_only_jobs_whose_tenant_may_read_the_dataset_are_taken_in() -> None:
    jobs = {j.job_id: j for j in (stored("own", "a", "a/wiki@v1"), stored("theirs", "b", "a/wiki@v1"),
                                  stored("platform", "b", "wiki@v1"), stored("unverified", "b", "b/wiki@v1"))}
    datasets = {"a/wiki@v1": record("a"), "wiki@v1": record(None), "b/wiki@v1": None}
    refused = intake_refusals(jobs, datasets)
    assert set(refused) == {"theirs", "unverified"}
    assert "'a/wiki@v1'" in refused["theirs"] and "'b/wiki@v1'" in refused["unverified"]
    assert intake_refusals(jobs, {**datasets, "a/wiki@v1": record("a", ["b"]), "b/wiki@v1": record("b")}) == {}
