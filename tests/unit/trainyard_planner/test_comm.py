"""Communication per step: ring collectives, ZeRO volumes, TP and PP traffic, link tiers."""

from __future__ import annotations

import pytest

from trainyard_planner import (
    Bottleneck,
    Layout,
    LinkTier,
    Recompute,
    Tier,
    Topology,
    Transformer,
    ZeroStage,
    all_gather_bytes,
    allreduce_bytes,
    allreduce_seconds,
    bottleneck,
    device_spec,
    estimate_comm,
    reduce_scatter_bytes,
)

RING = [
    # (ranks, all-reduce bytes per rank, reduce-scatter / all-gather bytes per rank) for S = 1
    (1, 0.0, 0.0),
    (2, 1.0, 0.5),
    (4, 1.5, 0.75),
    (8, 1.75, 0.875),
    (1024, 2 * 1023 / 1024, 1023 / 1024),
]


@pytest.mark.parametrize(("n", "allreduce", "scatter"), RING)
def test_ring_volumes(n: int, allreduce: float, scatter: float) -> None:
    """Patarasuk & Yuan 2009, the bandwidth-optimal ring: all-reduce sends 2(n-1)/n of the buffer
    per rank; reduce-scatter and all-gather (n-1)/n each."""
    assert allreduce_bytes(1.0, n) == pytest.approx(allreduce)
    assert reduce_scatter_bytes(1.0, n) == pytest.approx(scatter)
    assert all_gather_bytes(1.0, n) == pytest.approx(scatter)


def test_ring_time_is_latency_steps_plus_bandwidth() -> None:
    link = LinkTier(bandwidth=100e9, latency=10e-6)
    assert allreduce_seconds(8e9, 8, link) == pytest.approx(14 * 10e-6 + 1.75 * 8e9 / 100e9)


MODEL = Transformer.from_parameters(7.5e9)


@pytest.mark.parametrize(("stage", "volume"), [(0, 2.0), (1, 2.0), (2, 2.0), (3, 3.0)])
def test_zero_paper_communication_volume(stage: int, volume: float) -> None:
    """Rajbhandari et al. 2019 §7: data parallelism all-reduces 2 Psi per step (reduce-scatter +
    all-gather); P_os and P_os+g move the same 2 Psi; P_os+g+p 3 Psi, 1.5x the baseline. Counted
    here in parameters with n -> large, one micro-batch."""
    n = 1_000_000
    comm = estimate_comm(MODEL, Layout(dp=n, zero_stage=stage), Topology(), gradient_bytes=1, weight_bytes=1)
    assert comm.dp_bytes == pytest.approx(volume * MODEL.parameters, rel=1e-5)


def test_zero_3_reshards_every_micro_batch() -> None:
    one = estimate_comm(MODEL, Layout(dp=8, zero_stage=ZeroStage.PARAMETERS, microbatches=1), Topology())
    four = estimate_comm(MODEL, Layout(dp=8, zero_stage=ZeroStage.PARAMETERS, microbatches=4), Topology())
    ddp = estimate_comm(MODEL, Layout(dp=8, microbatches=4), Topology())
    assert four.dp_bytes == pytest.approx(4 * one.dp_bytes)
    assert ddp.dp_bytes == pytest.approx(one.dp_bytes * 2 / 3)  # one all-reduce per step


def test_tensor_parallel_all_reduces_per_layer() -> None:
    """Shoeybi et al. 2019 (Megatron-LM) §3: two all-reduces per layer in the forward pass and two
    in the backward, each over the b x s x h activations."""
    model = Transformer(n_layers=4, d_model=1024, n_heads=16, vocab_size=1000, seq_len=512)
    layout = Layout(tp=4, micro_batch=2, microbatches=3)
    comm = estimate_comm(model, layout, Topology())
    activation = 2 * 2 * 512 * 1024
    assert comm.tp_bytes == pytest.approx(4 * 4 * 3 * allreduce_bytes(activation, 4))
    recomputed = estimate_comm(model, layout.model_copy(update={"recompute": Recompute.FULL}), Topology())
    assert recomputed.tp_bytes == pytest.approx(comm.tp_bytes * 6 / 4)


def test_pipeline_sends_activations_and_gradients_per_micro_batch() -> None:
    model = Transformer(n_layers=8, d_model=1024, n_heads=16, vocab_size=1000, seq_len=512)
    comm = estimate_comm(model, Layout(pp=4, micro_batch=1, microbatches=8), Topology())
    assert comm.pp_bytes == 2 * 8 * (2 * 512 * 1024)
    assert comm.pp_tier is Tier.NVLINK


TIERS = [
    # (layout, topology, expected tiers for (dp, tp, pp))
    (Layout(tp=8), Topology(devices_per_node=8), (None, Tier.NVLINK, None)),
    (Layout(tp=8, dp=2), Topology(devices_per_node=8), (Tier.INTRA_RACK, Tier.NVLINK, None)),
    (Layout(tp=2, dp=4), Topology(devices_per_node=8), (Tier.NVLINK, Tier.NVLINK, None)),
    (Layout(tp=8, dp=64), Topology(devices_per_node=8, nodes_per_rack=4), (Tier.CROSS_RACK, Tier.NVLINK, None)),
    (Layout(tp=4, pp=4), Topology(devices_per_node=8), (None, Tier.NVLINK, Tier.INTRA_RACK)),
    (Layout(tp=72), Topology(devices_per_node=4, nvlink_domain=72), (None, Tier.NVLINK, None)),
]


@pytest.mark.parametrize(("layout", "topology", "tiers"), TIERS)
def test_which_link_each_group_crosses(layout: Layout, topology: Topology, tiers: tuple) -> None:
    """Ranks are ordered tensor, data, pipeline (Megatron-LM): TP stays inside the NVLink domain,
    DP and PP cross nodes and racks as they grow."""
    model = Transformer(n_layers=8, d_model=4608, n_heads=72, vocab_size=1000, seq_len=128)
    comm = estimate_comm(model, layout, topology)
    assert (comm.dp_tier, comm.tp_tier, comm.pp_tier) == tiers


def test_topology_from_device() -> None:
    h100 = device_spec("h100-80gb")
    topology = Topology.for_device(h100)
    assert topology.domain == 8
    assert topology.nvlink.bandwidth == h100.nvlink_bandwidth
    assert topology.intra_rack.bandwidth == h100.network_bandwidth
    assert Topology.for_device(h100, devices_per_node=4).domain == 4


def test_bandwidth_factor_scales_the_time_not_the_volume() -> None:
    layout = Layout(dp=16, tp=8)
    fast = estimate_comm(MODEL, layout, Topology())
    slow = estimate_comm(MODEL, layout, Topology(), bandwidth_factor=0.1)
    assert slow.dp_bytes == fast.dp_bytes
    assert slow.dp_seconds > 9 * fast.dp_seconds


@pytest.mark.parametrize(("fits", "compute", "comm", "expected"), [
    (False, 1.0, 0.1, Bottleneck.MEMORY),
    (True, 1.0, 0.1, Bottleneck.COMPUTE),
    (True, 1.0, 2.0, Bottleneck.INTERCONNECT),
])
def test_bottleneck(fits: bool, compute: float, comm: float, expected: Bottleneck) -> None:
    assert bottleneck(fits=fits, compute_seconds=compute, comm_seconds=comm) is expected


def test_grouped_query_attention_exchanges_what_full_attention_does_under_tensor_parallelism() -> None:
    """The TP collectives carry a layer's b s h output: narrower K/V stay inside each rank."""
    mha = Transformer(n_layers=22, d_model=2048, n_heads=32, d_ff=5632, vocab_size=32000, seq_len=2048,
                      gated_mlp=True, biases=False, learned_positions=False, tied_embeddings=False)
    gqa = mha.model_copy(update={"n_kv_heads": 4})
    topology = Topology.for_device(device_spec("h100-80gb"))
    layout = Layout(tp=4, micro_batch=2, microbatches=4, sequence_parallel=True)
    full, grouped = estimate_comm(mha, layout, topology), estimate_comm(gqa, layout, topology)
    assert grouped.tp_bytes == full.tp_bytes == 4 * 22 * 4 * allreduce_bytes(2 * 2 * 2048 * 2048, 4)
