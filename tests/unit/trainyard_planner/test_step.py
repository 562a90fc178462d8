"""One step's estimate, and the Lab's experiments: where the bottleneck moves."""

from __future__ import annotations

import pytest

from trainyard_planner import Bottleneck, Layout, LinkTier, Recompute, Topology, Transformer, device_spec, estimate_step

H100 = device_spec("h100-80gb")
MODEL = Transformer.from_parameters(7e9, seq_len=4096)
GLOBAL_BATCH = 512


def network(bandwidth: float) -> Topology:
    """8-GPU NVLink nodes joined by a network of ``bandwidth`` bytes/s per GPU."""
    return Topology.for_device(H100).model_copy(update={
        "intra_rack": LinkTier(bandwidth=bandwidth, latency=8e-6),
        "cross_rack": LinkTier(bandwidth=bandwidth, latency=15e-6),
    })


def step(devices: int, bandwidth: float, model: Transformer = MODEL, zero: int = 1):
    layout = Layout(dp=devices, zero_stage=zero, microbatches=GLOBAL_BATCH // devices, recompute=Recompute.SELECTIVE)
    return estimate_step(model, layout, H100, network(bandwidth))


def test_step_is_compute_times_bubble_plus_exposed_comm() -> None:
    layout = Layout(dp=2, tp=2, pp=2, microbatches=8, sequence_parallel=True)
    estimate = estimate_step(MODEL, layout, H100, network(50e9))
    assert estimate.bubble_ratio == pytest.approx(1 / 8)
    assert estimate.step_seconds == pytest.approx(
        estimate.compute_seconds * (1 + 1 / 8) + estimate.exposed_comm_seconds)
    c = estimate.comm
    assert c.tp_seconds + c.pp_seconds <= estimate.exposed_comm_seconds <= c.total_seconds  # DP partly hidden
    assert estimate.compute_seconds == pytest.approx(8 * estimate.stage.seconds)
    assert estimate.tokens_per_step == 2 * 8 * 4096
    assert 0 < estimate.mfu < H100.matmul_efficiency
    assert "stepSeconds" in estimate.wire()


def test_lab_more_nodes_on_a_fast_network_stays_compute_bound() -> None:
    """Lab experiment 2 with a 50 GB/s-per-GPU fabric: 8 -> 128 GPUs scales nearly linearly."""
    small, large = step(8, 50e9), step(128, 50e9)
    assert large.bottleneck is Bottleneck.COMPUTE
    assert small.step_seconds / large.step_seconds > 10


def test_lab_more_nodes_on_a_slow_network_moves_the_bottleneck_to_the_interconnect() -> None:
    """Lab experiment 2: add GPUs but lower the interconnect; theoretical compute keeps growing
    while step time stops falling, and the communication-to-compute ratio passes 1."""
    assert step(8, 2e9).bottleneck is Bottleneck.COMPUTE  # one node: NVLink only
    mid, large = step(32, 2e9), step(128, 2e9)
    assert large.compute_seconds == pytest.approx(mid.compute_seconds / 4)
    assert mid.step_seconds / large.step_seconds < 1.5
    assert large.bottleneck is Bottleneck.INTERCONNECT
    assert large.comm_to_compute_ratio > 1


def test_lab_a_bigger_model_on_the_same_gpus_runs_out_of_memory() -> None:
    """Lab experiment 1: on 16 H100s with plain DDP, 1B fits and 13B does not."""
    assert step(16, 50e9, Transformer.from_parameters(1e9, seq_len=4096), zero=0).bottleneck is Bottleneck.COMPUTE
    big = step(16, 50e9, Transformer.from_parameters(13e9, seq_len=4096), zero=0)
    assert big.bottleneck is Bottleneck.MEMORY
    assert not big.fits


def test_efficiency_and_overlap_are_validated() -> None:
    with pytest.raises(ValueError):
        estimate_step(MODEL, Layout(), H100, network(50e9), efficiency=0)
    with pytest.raises(ValueError):
        estimate_step(MODEL, Layout(), H100, network(50e9), dp_overlap=1.5)


def test_a_layout_that_cannot_run_the_model_is_refused_with_the_reason() -> None:
    """Megatron-LM's interleaved schedule needs micro-batches in multiples of the stages and at least a layer
    per chunk; layersPerStage must name every stage and every layer."""
    interleaved = Layout(pp=4, microbatches=6, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match=r"micro-batches \(6\) to be a multiple of the pipeline stages \(4\)"):
        estimate_step(MODEL, interleaved, H100, network(50e9))
    with pytest.raises(ValueError, match="cannot fill 8 chunks on each of 4 stages"):
        Layout(pp=4, microbatches=8, schedule="interleaved", virtual_stages=8).check_layers(8)
    with pytest.raises(ValueError, match="layersPerStage names 2 stages; the pipeline has 4"):
        Layout(pp=4, layers_per_stage=(4, 4)).check_layers(8)
    with pytest.raises(ValueError, match="layersPerStage holds 7 layers; the model has 8"):
        Layout(pp=2, layers_per_stage=(3, 4)).check_layers(8)
