"""The leader's queue and node gauges: the pure view of a pass, and publishing it (tenants come and go)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import REGISTRY

from trainyard_contract.records import AttemptRecord, JobRecord, NodeRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_scheduler.metrics import ClusterGauges, cluster_view, waiting_since

T0 = datetime(2025, 1, 1, tzinfo=UTC)
SPEC = TrainingSpec.model_validate({
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "t",
    "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
    "checkpointPolicy": {"everySteps": 10},
    "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 2, "learningRate": 0.001,
                 "maxSteps": 20},
})


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def job(job_id: str, tenant: str, created_s: float, *, failed_at_s: float | None = None) -> JobRecord:
    attempts = [] if failed_at_s is None else [AttemptRecord(
        attempt=1, allocation_id="a1", epoch=1, state="failed", world_size=2, started_at=at(created_s),
        ended_at=at(failed_at_s))]
    return JobRecord(job_id=job_id, tenant=tenant, spec=SPEC, spec_hash=SPEC.spec_hash(), created_at=at(created_s),
                     attempts=attempts)


def node(node_id: str, last_seen_s: float, *, healthy: bool = True) -> NodeRecord:
    return NodeRecord(node_id=node_id, host="h", devices=[], healthy=healthy, last_seen=at(last_seen_s))


def sample(name: str, labels: dict[str, str]) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_a_requeued_job_waits_since_its_attempt_ended() -> None:
    assert waiting_since(job("j1", "t", 10)) == at(10)
    assert waiting_since(job("j1", "t", 10, failed_at_s=500)) == at(500)


def test_the_view_counts_pending_jobs_and_the_longest_wait_per_tenant() -> None:
    pending = [job("a", "research", 0), job("b", "research", 300), job("c", "prod", 0, failed_at_s=900)]
    view = cluster_view(pending, [], now=at(1000), node_timeout_s=30, live=[], placeable=[])
    assert view.pending == {"research": 2, "prod": 1}
    assert view.oldest_wait_s == {"research": 1000.0, "prod": 100.0}


def test_every_node_has_one_state() -> None:
    nodes = [node("n0", 995), node("n1", 995), node("n2", 990, healthy=False), node("n3", 900), node("n4", 999)]
    view = cluster_view([], nodes, now=at(1000), node_timeout_s=30, live=["n0", "n1", "n4"], placeable=["n0", "n4"])
    assert view.nodes == {"placeable": 2, "out_of_service": 1, "unhealthy": 1, "silent": 1}
    assert sum(view.nodes.values()) == len(nodes)


def test_publishing_removes_tenants_with_nothing_pending_and_a_standby_clears_all() -> None:
    gauges = ClusterGauges()
    nodes = [node("n0", 999)]
    gauges.publish(cluster_view([job("a", "t-gone", 0), job("b", "t-stays", 0)], nodes, now=at(60),
                                node_timeout_s=30, live=["n0"], placeable=["n0"]))
    assert sample("trainyard_scheduler_pending_jobs", {"tenant": "t-gone"}) == 1
    assert sample("trainyard_scheduler_oldest_pending_seconds", {"tenant": "t-stays"}) == 60
    gauges.publish(cluster_view([job("b", "t-stays", 0)], nodes, now=at(90), node_timeout_s=30, live=["n0"],
                                placeable=["n0"]))
    assert sample("trainyard_scheduler_pending_jobs", {"tenant": "t-gone"}) is None
    assert sample("trainyard_scheduler_oldest_pending_seconds", {"tenant": "t-stays"}) == 90
    assert sample("trainyard_scheduler_nodes", {"state": "placeable"}) == 1
    assert sample("trainyard_scheduler_nodes", {"state": "silent"}) == 0
    gauges.clear()
    assert sample("trainyard_scheduler_pending_jobs", {"tenant": "t-stays"}) is None
    assert sample("trainyard_scheduler_nodes", {"state": "placeable"}) is None
