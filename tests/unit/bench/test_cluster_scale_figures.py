"""bench/cluster_scale's pure parts: the quantiles it reads off the scheduler's Prometheus histogram between two
scrapes, and what a simulated job's ranks do by its name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def load(name: str, path: Path):  # noqa: ANN201 - a module
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


run = load("cluster_scale_bench", REPO / "bench" / "cluster_scale" / "run.py")
simnodes = load("cluster_scale_simnodes", REPO / "bench" / "cluster_scale" / "simnodes.py")

BEFORE = """
# TYPE trainyard_scheduler_pass_seconds histogram
trainyard_scheduler_pass_seconds_bucket{le="0.01",phase="total"} 10.0
trainyard_scheduler_pass_seconds_bucket{le="0.1",phase="total"} 10.0
trainyard_scheduler_pass_seconds_bucket{le="1.0",phase="total"} 10.0
trainyard_scheduler_pass_seconds_bucket{le="+Inf",phase="total"} 10.0
trainyard_scheduler_pass_seconds_count{phase="total"} 10.0
trainyard_scheduler_pass_seconds_sum{phase="total"} 0.05
trainyard_scheduler_pass_seconds_bucket{le="+Inf",phase="plan"} 99.0
"""
AFTER = """
trainyard_scheduler_pass_seconds_bucket{le="0.01",phase="total"} 10.0
trainyard_scheduler_pass_seconds_bucket{le="0.1",phase="total"} 108.0
trainyard_scheduler_pass_seconds_bucket{le="1.0",phase="total"} 110.0
trainyard_scheduler_pass_seconds_bucket{le="+Inf",phase="total"} 110.0
trainyard_scheduler_pass_seconds_count{phase="total"} 110.0
trainyard_scheduler_pass_seconds_sum{phase="total"} 5.05
trainyard_scheduler_pass_seconds_bucket{le="+Inf",phase="plan"} 150.0
"""


def test_quantiles_are_read_from_what_was_observed_between_the_two_scrapes() -> None:
    got = run.histogram_delta(run.parse_metrics(BEFORE), run.parse_metrics(AFTER), "trainyard_scheduler_pass_seconds",
                              {"phase": "total"})
    assert got["count"] == 100  # the ten before the first scrape are not counted
    assert got["mean_ms"] == pytest.approx(50.0)
    # 98 of the 100 in (10 ms, 100 ms], 2 in (100 ms, 1 s]: the median inside the first, p99 inside the second
    assert 10.0 < got["p50_ms"] < 100.0
    assert 100.0 < got["p99_ms"] <= 1000.0


def test_an_empty_histogram_has_no_quantile() -> None:
    assert run.histogram_quantile([], 0.99) is None
    assert run.histogram_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    got = run.histogram_delta(run.parse_metrics(AFTER), run.parse_metrics(AFTER), "trainyard_scheduler_pass_seconds",
                              {"phase": "total"})
    assert got["count"] == 0 and got["p99_ms"] is None and got["mean_ms"] is None


def test_a_simulated_jobs_ranks_do_what_its_name_says() -> None:
    assert simnodes.behaviour_of("scale-12") == "run"
    assert simnodes.behaviour_of("nightly-fail-7") == "fail"
    assert simnodes.behaviour_of("hang") == "hang"
    assert simnodes.behaviour_of("unfailing") == "run"  # a word, not a part of one


def test_a_simulated_gangs_shards_are_a_checkpoint_the_coordinator_accepts(tmp_path: Path) -> None:
    """The shards simnodes writes pass the coordinator's own decisions: each report is the job's own (in its
    checkpoint directory), the reports of the world assemble, and the draft manifest verifies on disk."""
    from datetime import UTC, datetime

    from trainyard_checkpoint_coordinator.assembly import Complete, ShardReport, assess, checkpoint_key, \
        shard_refusal
    from trainyard_contract.events import ShardWritten
    from trainyard_contract.manifest import local_sha256, local_stat_size, verify_manifest
    from trainyard_contract.storage import ArtifactLayout, location_uri

    cluster = simnodes.SimCluster("127.0.0.1:1", "redis://127.0.0.1:1", simnodes.ClusterShape(nodes=1),
                                  artifacts=str(tmp_path))
    sent: list[dict] = []

    async def send(logical: str, key: str, body: dict) -> None:
        sent.append(body)

    cluster._send = send  # type: ignore[method-assign]
    ranks = [simnodes.SimRank("job-1", "team-a", 2, "alloc-1", 5, "node-0000", r, "run", 0.0, 4, step=40)
             for r in range(4)]

    import asyncio
    for r in ranks:
        asyncio.run(cluster._shard(r))
    events = [ShardWritten.model_validate(b) for b in sent]
    key = checkpoint_key(events[0])
    directory = location_uri(ArtifactLayout(tmp_path).checkpoint_dir("team-a", "job-1", 2, 40))
    assert all(shard_refusal(ShardReport.from_event(e), key, job_tenant="team-a", checkpoint_dir_uri=directory)
               is None for e in events)
    outcome = assess(key, {e.rank: ShardReport.from_event(e) for e in events}, world_size=4, current_epoch=5,
                     created_at=datetime.now(UTC))
    assert isinstance(outcome, Complete), outcome
    assert verify_manifest(outcome.manifest, stat_size=local_stat_size, file_sha256=local_sha256) == []
    assert [r.saved_step for r in ranks] == [40] * 4 and cluster.counters.shards == 4
