"""A gang rendezvous at the advertised address of rank 0's node, never at an assumed loopback."""

from __future__ import annotations

from datetime import UTC, datetime

from trainyard_contract.events import NodeAssignment, RankAssignment
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_scheduler import transitions as tr

T0 = datetime(2025, 1, 1, tzinfo=UTC)
SPEC = TrainingSpec.model_validate({
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "t",
    "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
    "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 2, "learningRate": 0.001,
                 "maxSteps": 20},
})


def attempt(master_addr: str | None, assignments: list[NodeAssignment]) -> AttemptRecord:
    return AttemptRecord(attempt=1, allocation_id="a1", epoch=3, world_size=2, master_addr=master_addr,
                         master_port=29401, assignments=assignments, nodes=[a.node_id for a in assignments])


def share(node: str, host: str, rank: int) -> NodeAssignment:
    return NodeAssignment(node_id=node, host=host, ranks=[RankAssignment(rank=rank, local_rank=0, device_index=0)])


def test_rank0_host_is_the_host_of_the_node_running_rank_0() -> None:
    a = attempt(None, [share("n2", "10.0.0.2", 1), share("n1", "10.0.0.1", 0)])
    assert tr.rank0_host(a) == "10.0.0.1"
    assert tr.rank0_host(attempt(None, [])) == "127.0.0.1"  # nothing recorded: a single-host attempt


def test_gang_allocated_again_for_an_attempt_without_master_addr_uses_rank0s_host() -> None:
    job = JobRecord(job_id="j1", tenant="t1", spec=SPEC, spec_hash=SPEC.spec_hash(), created_at=T0)
    old = attempt(None, [share("n2", "10.0.0.2", 1), share("n1", "10.0.0.1", 0)])
    assert tr.gang_allocated(job, old, T0).master_addr == "10.0.0.1"
    kept = attempt("10.0.0.9", old.assignments)
    assert tr.gang_allocated(job, kept, T0).master_addr == "10.0.0.9"
