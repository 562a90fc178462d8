"""The Lab's sweeps: each curve is the planner's own arithmetic, and each marked point is where the
curve says it is."""

from __future__ import annotations

import math

import pytest

from trainyard_planner import (
    MIXED_PRECISION_ADAM,
    Layout,
    Sharding,
    Transformer,
    ZeroStage,
    checkpoint_lab,
    daly_optimal_interval,
    device_spec,
    estimate_memory,
    estimate_step,
    lab_topology,
    memory_lab,
    node_counts,
    scaling_lab,
    young_interval,
)

H100 = device_spec("h100-80gb")
SEVEN_B = Transformer.from_parameters(7e9)


# ----------------------------------------------------------------------------- memory


def test_memory_per_device_is_the_planners_estimate_with_its_16_bytes_per_parameter() -> None:
    lab = memory_lab(SEVEN_B, H100, devices=8, sharding="zero1", micro_batch=2)
    expected = estimate_memory(SEVEN_B, Layout(dp=8, zero_stage=ZeroStage.OPTIMIZER, micro_batch=2))
    d = lab.per_device
    assert (d.parameters_bytes, d.gradients_bytes) == (2 * 7e9, 2 * 7e9)
    assert d.optimizer_bytes == pytest.approx(12 * 7e9 / 8)
    assert d.activations_bytes == expected.activations_bytes_per_device
    assert d.total_bytes == expected.used_bytes_per_device
    assert d.capacity_bytes == 80e9 and d.headroom_bytes == pytest.approx(0.15 * 80e9)
    assert d.fits is expected.fits(80e9) and d.free_bytes == pytest.approx(d.usable_bytes - d.total_bytes)
    bpp = lab.bytes_per_parameter
    assert (bpp.weights, bpp.gradients, bpp.master_weights, bpp.optimizer_states, bpp.optimizer, bpp.total) == (
        2, 2, 4, 8, 12, 16)


def test_sharding_needed_above_is_where_ddp_stops_fitting() -> None:
    """The marked point agrees with the memory model: DDP fits just below it and not just above,
    with the same derived shapes the curve uses."""
    lab = memory_lab(SEVEN_B, H100, devices=8)
    limit = lab.sharding_needed_above
    assert limit is not None and limit == lab.fits_up_to.ddp
    usable = H100.memory_bytes * (1 - lab.headroom)

    def ddp_used(parameters: float) -> float:
        shape = Transformer.from_parameters(parameters, seq_len=SEVEN_B.seq_len, vocab_size=SEVEN_B.vocab_size)
        return estimate_memory(shape, Layout(dp=8)).used_bytes_per_device

    assert ddp_used(limit) <= usable < ddp_used(limit * 1.001)
    # 16 B per parameter on every rank: under 80 GB x 0.85 / 16 = 4.25B parameters, activations aside
    assert 1e9 < limit < 68e9 / 16
    # each further stage shards more, so fits a larger model; FSDP over 8 ranks about 8x DDP's states
    f = lab.fits_up_to
    assert f.ddp < f.zero1 < f.zero2 < f.fsdp


def test_memory_curve_orders_the_shardings_and_grows_with_parameters() -> None:
    lab = memory_lab(SEVEN_B, H100, devices=64)
    assert len(lab.curve) == 61 and lab.curve[0].parameters == pytest.approx(7e6)
    for point in lab.curve:
        assert point.ddp >= point.zero1 >= point.zero2 >= point.fsdp
    big = lab.curve[-1]
    assert big.ddp - big.fsdp == pytest.approx(16 * big.parameters * (1 - 1 / 64), rel=1e-9)


def test_memory_lab_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="devices"):
        memory_lab(SEVEN_B, H100, devices=0)
    with pytest.raises(ValueError, match="curve"):
        memory_lab(SEVEN_B, H100, devices=8, curve_from=1e12, curve_to=1e9)


# ----------------------------------------------------------------------------- scaling


def test_node_counts_double_up_to_the_maximum() -> None:
    assert node_counts(1) == [1]
    assert node_counts(16) == [1, 2, 4, 8, 16]
    assert node_counts(12) == [1, 2, 4, 8, 12]


def test_scaling_points_are_the_planners_step_estimates() -> None:
    lab = scaling_lab(SEVEN_B, H100, nodes=[1, 4], devices_per_node=8, global_batch=256, sharding="fsdp")
    topology = lab_topology(H100, devices_per_node=8)
    step = estimate_step(SEVEN_B, Layout(dp=32, zero_stage=ZeroStage.PARAMETERS, microbatches=8), H100, topology)
    point = lab.points[1]
    assert (point.devices, point.global_batch, point.microbatches) == (32, 256, 8)
    assert point.step_seconds == step.step_seconds and point.tokens_per_second == step.tokens_per_second
    assert point.communication_seconds == step.exposed_comm_seconds
    assert point.comm_to_compute == pytest.approx(point.communication_seconds / point.compute_seconds)
    assert lab.points[0].efficiency == 1 and lab.points[0].marginal_efficiency is None


def test_comm_to_compute_grows_as_the_interconnect_bandwidth_drops() -> None:
    def lab(gbps: float):
        return scaling_lab(SEVEN_B, H100, nodes=node_counts(32), devices_per_node=8, global_batch=512,
                           interconnect_bandwidth=gbps * 1e9)

    fast, slow = lab(50), lab(5)
    for f, s in zip(fast.points[1:], slow.points[1:], strict=True):
        assert s.comm_to_compute > f.comm_to_compute and s.step_seconds > f.step_seconds
    # inside one node the interconnect is not used: the same point
    assert fast.points[0].step_seconds == slow.points[0].step_seconds
    # the ratio grows with the node count too (the same batch, less compute per device)
    ratios = [p.comm_to_compute for p in fast.points]
    assert ratios == sorted(ratios)
    assert slow.interconnect_bandwidth == 5e9 and fast.intra_node_bandwidth == H100.nvlink_bandwidth


def test_stops_helping_at_follows_its_stated_rule_and_moves_left_as_bandwidth_drops() -> None:
    def lab(gbps: float):
        return scaling_lab(SEVEN_B, H100, nodes=node_counts(64), devices_per_node=8, global_batch=512,
                           interconnect_bandwidth=gbps * 1e9)

    fast, slow = lab(50), lab(2)
    for result in (fast, slow):
        stops = result.stops_helping_at
        assert stops is not None
        index = next(i for i, p in enumerate(result.points) if p.devices == stops)
        assert all(p.marginal_efficiency >= 0.5 for p in result.points[1:index + 1])
        assert result.points[index + 1].marginal_efficiency < 0.5
        assert "0.5" in result.rule
    assert slow.stops_helping_at < fast.stops_helping_at


def test_scaling_refuses_a_tensor_degree_that_does_not_divide_a_node() -> None:
    with pytest.raises(ValueError, match="tensor"):
        scaling_lab(SEVEN_B, H100, nodes=[1], devices_per_node=8, global_batch=8, tensor=3)


# ----------------------------------------------------------------------------- checkpoint


@pytest.mark.parametrize(("mtbf_hours", "write_seconds", "restart_seconds"), [(3.1, 60, 300), (49, 100, 0),
                                                                              (1, 5, 30)])
def test_the_optimum_is_the_minimum_of_the_waste_curve(mtbf_hours: float, write_seconds: float,
                                                       restart_seconds: float) -> None:
    lab = checkpoint_lab(mtbf_seconds=mtbf_hours * 3600, write_seconds=write_seconds,
                         restart_seconds=restart_seconds, step_seconds=2.0)
    assert lab.optimum_seconds == young_interval(write_seconds, mtbf_hours * 3600)
    assert min(lab.curve, key=lambda p: p.waste_fraction).interval_seconds == lab.optimum_seconds
    assert lab.optimum_waste_fraction == pytest.approx(
        math.sqrt(2 * write_seconds / (mtbf_hours * 3600)) + restart_seconds / (mtbf_hours * 3600))
    assert lab.daly_optimum_seconds == daly_optimal_interval(write_seconds, mtbf_hours * 3600)
    assert lab.optimum_steps == round(lab.optimum_seconds / 2.0)
    # redo grows with the interval, overhead shrinks; they are equal at the optimum
    redo = [p.redo_fraction for p in lab.curve]
    overhead = [p.overhead_fraction for p in lab.curve]
    assert redo == sorted(redo) and overhead == sorted(overhead, reverse=True)
    at = next(p for p in lab.curve if p.interval_seconds == lab.optimum_seconds)
    assert at.redo_fraction == pytest.approx(at.overhead_fraction)
    for p in lab.curve:
        assert p.waste_fraction == pytest.approx(p.redo_fraction + p.overhead_fraction + p.restart_fraction)


def test_checkpoint_lab_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        checkpoint_lab(mtbf_seconds=0, write_seconds=10)
    with pytest.raises(ValueError):
        checkpoint_lab(mtbf_seconds=3600, write_seconds=0)


def test_sharding_names_map_to_zero_stages() -> None:
    assert [s.zero_stage for s in Sharding] == list(ZeroStage)
    assert MIXED_PRECISION_ADAM.total == 16


def test_a_measured_step_fits_the_efficiency_so_the_planner_reproduces_it() -> None:
    """Open in the Lab: a job measured 3 s per step on 2 nodes; the curve then passes through it."""
    lab = scaling_lab(SEVEN_B, H100, nodes=[1, 2, 4], devices_per_node=8, global_batch=256,
                      measured_nodes=2, measured_step_seconds=3.0)
    assert lab.points[1].step_seconds == pytest.approx(3.0)
    assert 0 < lab.compute_efficiency < 1 and "reproduces the measured step" in lab.fitted
    given = scaling_lab(SEVEN_B, H100, nodes=[1, 2], devices_per_node=8, global_batch=256)
    assert given.fitted is None and given.compute_efficiency == given.points[0].matmul_efficiency  # by shape
    # compute faster than the peak allows: capped at 1, and said so
    at = given.points[1]
    capped = scaling_lab(SEVEN_B, H100, nodes=[2], devices_per_node=8, global_batch=256, measured_nodes=2,
                         measured_step_seconds=at.communication_seconds + 0.25 * at.compute_seconds)
    assert capped.compute_efficiency == 1.0 and "capped at 1" in capped.fitted
    # shorter than the communication alone: the links must be faster than modelled
    faster = scaling_lab(SEVEN_B, H100, nodes=[2], devices_per_node=8, global_batch=256, measured_nodes=2,
                         measured_step_seconds=at.communication_seconds / 2)
    assert faster.compute_efficiency == 1.0 and "links are faster than modelled" in faster.fitted
