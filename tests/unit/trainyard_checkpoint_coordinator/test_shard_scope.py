"""shard_refusal: a shard report is recorded only when it is the job's own (issue 30, item 2)."""

from __future__ import annotations

import pytest

from trainyard_checkpoint_coordinator.assembly import CheckpointKey, ShardReport, shard_refusal
from trainyard_contract.events import FileDigest

ROOT = "file:///srv/artifacts"
DIR = f"{ROOT}/tenants/acme/jobs/job-1/checkpoints/step-000000040-a1"
KEY = CheckpointKey("job-1", 1, 40)


def report(uri: str = f"{DIR}/__0_0.distcp", *, tenant: str = "acme", extra: tuple[str, ...] = ()) -> ShardReport:
    return ShardReport(tenant=tenant, epoch=1, rank=0, world_size=1, uri=uri, size_bytes=1, sha256="0" * 64,
                       extra_files=tuple(FileDigest(uri=u, size_bytes=1, sha256="0" * 64) for u in extra))


def test_the_jobs_own_shard_and_metadata_are_accepted() -> None:
    assert shard_refusal(report(extra=(f"{DIR}/.metadata",)), KEY, job_tenant="acme", checkpoint_dir_uri=DIR) is None


def test_an_object_store_shard_in_the_jobs_prefix_is_accepted() -> None:
    directory = "s3://bucket/p/tenants/acme/jobs/job-1/checkpoints/step-000000040-a1"
    assert shard_refusal(report(f"{directory}/__0_0.distcp"), KEY, job_tenant="acme",
                         checkpoint_dir_uri=directory) is None


@pytest.mark.parametrize(("uri", "says"), [
    (f"{ROOT}/tenants/victim/jobs/job-v/checkpoints/step-000000040-a1/__0_0.distcp", "not in the job's checkpoint"),
    (f"{ROOT}/tenants/acme/jobs/job-2/checkpoints/step-000000040-a1/__0_0.distcp", "not in the job's checkpoint"),
    (f"{ROOT}/tenants/acme/jobs/job-1/checkpoints/step-000000020-a1/__0_0.distcp", "not in the job's checkpoint"),
    (f"{ROOT}/datasets/tinycorpus/v1/shard-00000.bin", "not in the job's checkpoint"),
    (f"{DIR}/../../../../job-v/checkpoints/step-000000040-a1/__0_0.distcp", "not a normalised path"),
    (f"{DIR}/./__0_0.distcp", "not a normalised path"),
    (f"{DIR}//__0_0.distcp", "not a normalised path"),
    (f"{DIR}/sub/__0_0.distcp", "not in the job's checkpoint"),
    (f"{DIR}/%2e%2e/step-000000020-a1/__0_0.distcp", "not a normalised path"),
    (f"{DIR}/%252e%252e/x", "not a plain file URI"),
    (f"{DIR}/__0_0.distcp?x=1", "not a plain file URI"),
    (f"{DIR}/a\x00b", "not a plain file URI"),
    (f"{DIR}/manifest.json", "manifest"),
    (f"{DIR}/", "not a normalised path"),
    ("file://otherhost/srv/artifacts/tenants/acme/jobs/job-1/checkpoints/step-000000040-a1/__0_0.distcp",
     "not in the job's checkpoint"),
    ("s3://bucket/tenants/acme/jobs/job-1/checkpoints/step-000000040-a1/__0_0.distcp", "not in the job's checkpoint"),
    ("/srv/artifacts/tenants/acme/jobs/job-1/checkpoints/step-000000040-a1/__0_0.distcp",
     "not in the job's checkpoint"),
])
def test_a_shard_outside_the_jobs_checkpoint_directory_is_refused(uri: str, says: str) -> None:
    reason = shard_refusal(report(uri), KEY, job_tenant="acme", checkpoint_dir_uri=DIR)
    assert reason is not None and says in reason and "rank 0's shard" in reason


def test_an_extra_file_outside_the_directory_is_refused() -> None:
    victim = f"{ROOT}/tenants/victim/jobs/job-v/checkpoints/step-000000040-a1/.metadata"
    reason = shard_refusal(report(extra=(victim,)), KEY, job_tenant="acme", checkpoint_dir_uri=DIR)
    assert reason is not None and "extra file" in reason


def test_a_replayed_report_of_another_tenant_is_refused_for_its_tenant() -> None:
    """A victim's ShardWritten re-published as the attacker's job: the event's tenant is not the record's."""
    reason = shard_refusal(report(tenant="victim"), KEY, job_tenant="acme", checkpoint_dir_uri=DIR)
    assert reason is not None and "tenant 'victim' is not the tenant of job 'job-1'" in reason


def test_a_replayed_report_with_the_tenant_rewritten_is_refused_for_its_files() -> None:
    victim = f"{ROOT}/tenants/victim/jobs/job-v/checkpoints/step-000000040-a1/__0_0.distcp"
    reason = shard_refusal(report(victim, tenant="acme"), KEY, job_tenant="acme", checkpoint_dir_uri=DIR)
    assert reason is not None and "not in the job's checkpoint directory" in reason


def test_a_report_for_a_job_without_a_record_is_refused() -> None:
    reason = shard_refusal(report(), KEY, job_tenant=None, checkpoint_dir_uri=None)
    assert reason == "job 'job-1' has no job record"
