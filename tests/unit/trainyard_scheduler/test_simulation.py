"""The simulator drives the real queue and placement; its invariant checks run on every admission."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_scheduler.simulation import ClusterShape, Simulator, TraceShape, first_fit

LONG = os.environ.get("TRAINYARD_LONG_TESTS") == "1"


def small(seed: int, nodes: int = 64, backlog: int = 150, hours: float = 8.0) -> tuple[ClusterShape, TraceShape]:
    cluster = ClusterShape(nodes=nodes, nodes_per_rack=8, racks_per_tier=4)
    trace = TraceShape(backlog=backlog, arrivals_per_hour=4.0, horizon_s=hours * 3600, seed=seed,
                       node_mtbf_s=5 * 86_400.0, repair_s=3600.0)
    return cluster, trace


def test_a_run_keeps_the_invariants_and_tp_groups_whole() -> None:
    cluster, trace = small(seed=3)
    sim = Simulator(cluster, trace, check=True, tick_s=120.0)
    report = sim.run()
    sim.check_no_job_lost()
    assert report.started > 20 and report.finished > 5 and report.failures > 0
    assert report.tp_groups and report.tp_in_domain == report.tp_groups
    assert 0.5 < report.utilisation <= 1.0 and 0 < report.goodput <= report.utilisation
    assert report.decisions == len(report.latencies) > 0
    assert set(report.waits) <= {"low", "normal", "high", "critical"}


def test_first_fit_runs_through_the_same_queue_and_splits_tp_groups() -> None:
    cluster, trace = small(seed=3)
    sim = Simulator(cluster, trace, placer=first_fit, name="first fit", check=True, tick_s=120.0)
    report = sim.run()
    sim.check_no_job_lost()
    assert report.started > 20
    assert report.tp_in_domain < report.tp_groups  # the baseline ignores NVLink domains


@settings(max_examples=25 if LONG else 4, deadline=None)
@given(seed=st.integers(0, 10_000), nodes=st.sampled_from([16, 40, 64]), tick=st.sampled_from([60.0, 300.0]))
def test_random_traces_keep_the_invariants(seed: int, nodes: int, tick: float) -> None:
    cluster, trace = small(seed, nodes=nodes, backlog=nodes * 2, hours=4.0)
    sim = Simulator(cluster, trace, check=True, tick_s=tick)
    sim.run()
    sim.check_no_job_lost()


@pytest.mark.long
@pytest.mark.skipif(not LONG, reason="long simulation; set TRAINYARD_LONG_TESTS=1 (make test-long)")
def test_a_long_run_on_a_bigger_cluster() -> None:
    cluster = ClusterShape(nodes=512)
    trace = TraceShape(backlog=1500, arrivals_per_hour=15, horizon_s=12 * 3600, seed=11)
    sim = Simulator(cluster, trace, check=True)
    report = sim.run()
    sim.check_no_job_lost()
    assert report.tp_in_domain == report.tp_groups


@pytest.mark.parametrize("seed", [3, 5])
def test_against_first_fit_on_the_same_trace_useful_utilisation_is_higher(seed: int) -> None:
    """Deterministic (fixed seed, simulated time): the comparison the benchmark prints, on a small cluster."""
    cluster, trace = small(seed=seed)
    ours = Simulator(cluster, trace, tick_s=300.0).run()
    theirs = Simulator(cluster, trace, tick_s=300.0, placer=first_fit, name="first fit").run()
    assert ours.goodput > theirs.goodput
    assert ours.tp_in_domain == ours.tp_groups and theirs.tp_in_domain < theirs.tp_groups


@pytest.mark.parametrize("seed", [3, 5])
def test_devices_freed_between_ticks_are_offered_at_once(seed: int) -> None:
    """The shell passes every second; the simulator passes soon after a completion, not at the next tick."""
    cluster, trace = small(seed=seed)
    coarse = Simulator(cluster, trace, tick_s=300.0, react=False).run()
    prompt = Simulator(cluster, trace, tick_s=300.0).run()
    assert prompt.passes > coarse.passes
    assert prompt.utilisation > coarse.utilisation
