"""Which initFrom.huggingFace directory the agent shows a job's ranks: only one inside the job's tenant."""

from __future__ import annotations

from pathlib import Path

from trainyard_contract.events import GangAllocated, NodeAssignment, RankAssignment
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_node_agent.confinement import start_weights


def allocation(init: dict | None, tenant: str = "acme") -> GangAllocated:
    spec = TrainingSpec.model_validate({
        "specVersion": "v1", "codeRevision": "abc", "modelConfig": "llama-tiny@v1", "dataset": "tinycorpus@v1",
        "resources": {"gpuType": "cpu", "gpuCount": 1}, "parallelism": {"data": 1},
        "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 1, "learningRate": 0.001,
                     "maxSteps": 2},
        **({"initFrom": init} if init else {}),
    })
    share = NodeAssignment(node_id="n", host="127.0.0.1", ranks=[RankAssignment(rank=0, local_rank=0, device_index=0)])
    return GangAllocated(job_id="j", tenant=tenant, attempt=1, allocation_id="j-a1", epoch=1, world_size=1,
                         nodes=[share], master_addr="127.0.0.1", master_port=29500, spec=spec,
                         spec_hash=spec.spec_hash())


def test_the_directory_is_resolved_under_the_jobs_tenant(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)
    target = layout.model_dir("acme", "real")
    target.mkdir(parents=True)
    (target.parent / "alias").symlink_to(target)
    assert start_weights(layout, allocation({"huggingFace": "models/alias"})) == target  # the symlink resolved
    assert start_weights(layout, allocation({"jobId": "base"})) is None
    assert start_weights(layout, allocation(None)) is None


def test_a_symlink_out_of_the_tenant_is_not_shown(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path)
    theirs = layout.model_dir("other", "secret")
    theirs.mkdir(parents=True)
    mine = layout.tenant_dir("acme") / "models"
    mine.mkdir(parents=True)
    (mine / "borrowed").symlink_to(theirs)
    assert start_weights(layout, allocation({"huggingFace": "models/borrowed"})) is None
