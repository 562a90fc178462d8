"""Memory per device: the seed's numbers, the ZeRO paper's table, Korthikanti's activation table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_planner import (
    MIXED_PRECISION_ADAM,
    BytesPerParameter,
    Layout,
    Recompute,
    Schedule,
    Transformer,
    ZeroStage,
    activation_bytes_per_layer,
    activations_bytes_per_device,
    estimate_memory,
    model_states_bytes,
)

GB = 1e9


def test_seed_70b_needs_1_12_tb_of_model_states() -> None:
    """The seed: bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam m 4 + v 4 = 16 B/param;
    70B x 16 B = 1.12 TB before activations."""
    assert MIXED_PRECISION_ADAM.total == 16
    assert model_states_bytes(70e9) == 1.12e12
    memory = estimate_memory(Transformer.from_parameters(70e9), Layout())
    assert memory.model_states_bytes_per_device == 1.12e12
    assert memory.model_states_bytes_total == 1.12e12


def test_seed_16_devices_of_70_gb_hold_exactly_the_states_and_nothing_else() -> None:
    """The seed: 16 GPUs with 70 GB each is about 1.12 TB, "just enough" and nothing left for
    activations. Fully sharded over 16, the states alone are 70 GB per device; with the default 15 %
    headroom and the activations the layout no longer fits 80 GB devices."""
    model = Transformer.from_parameters(70e9)
    memory = estimate_memory(model, Layout(dp=16, zero_stage=ZeroStage.PARAMETERS))
    assert memory.model_states_bytes_per_device == 70e9
    assert not memory.fits(80 * GB)
    assert memory.shortfall(80 * GB).endswith("GB per device, 80 GB available")


def test_camel_case_wire_names() -> None:
    wire = estimate_memory(Transformer.from_parameters(1e9), Layout(dp=8, zero_stage=1)).wire()
    assert "modelStatesBytesPerDevice" in wire
    assert "activationsBytesPerDevice" in wire
    assert "requiredBytesPerDevice" in wire


# Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
# Figure 1: a 7.5B model on Nd = 64 GPUs with K = 12 needs 120 GB per device for model states
# under plain data parallelism, 31.4 GB with P_os (stage 1), 16.6 GB with P_os+g (stage 2) and
# 1.88 GB with P_os+g+p (stage 3). Table 1 gives the same arithmetic for other DP degrees (the
# 7.5B column below). Values are as printed, so each is checked to within one unit of its last
# printed digit.
ZERO_TABLE = [
    # (parameters, Nd, stage 1, stage 2, stage 3), as printed
    (7.5e9, 64, "31.4", "16.6", "1.88"),  # Figure 1
    (7.5e9, 1, "120", "120", "120"),
    (7.5e9, 4, "52.5", "41.3", "30"),
    (7.5e9, 16, "35.6", "21.6", "7.5"),
    (7.5e9, 256, "30.4", "15.4", "0.47"),
    (7.5e9, 1024, "30.1", "15.1", "0.12"),
]


def _printed(value: str) -> tuple[float, float]:
    decimals = len(value.partition(".")[2])
    return float(value), 10.0 ** -decimals


@pytest.mark.parametrize(("params", "nd", "os", "os_g", "os_g_p"), ZERO_TABLE)
def test_zero_paper_model_states(params: float, nd: int, os: str, os_g: str, os_g_p: str) -> None:
    """Rajbhandari et al. 2019 Figure 1 (7.5B on 64 GPUs: 120, 31.4, 16.6, 1.88 GB) and Table 1."""
    model = Transformer.from_parameters(params)

    def states(stage: int) -> float:
        return estimate_memory(model, Layout(dp=nd, zero_stage=stage)).model_states_bytes_per_device / GB

    assert states(0) == 120
    for stage, printed in ((1, os), (2, os_g), (3, os_g_p)):
        published, unit = _printed(printed)
        assert abs(states(stage) - published) < unit, (stage, states(stage), printed)


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2
# (activation bytes per transformer layer) as coefficients of sbh: (no attention part, attention
# part as a multiple of as/h). GPT-3 175B shape from their Table 3: a = 96, h = 12288, s = 2048,
# t = 8.
GPT3 = Transformer(n_layers=96, d_model=12288, n_heads=96, vocab_size=51200, seq_len=2048)
MT_NLG = Transformer(n_layers=105, d_model=20480, n_heads=128, vocab_size=51200, seq_len=2048)
T = 8
KORTHIKANTI_TABLE_2 = [
    # (configuration, tp, sequence parallel, recompute, sbh coefficient, 5as/h coefficient)
    ("no parallelism", 1, False, Recompute.NONE, 34, 1),
    ("tensor parallel (baseline)", T, False, Recompute.NONE, 10 + 24 / T, 1 / T),
    ("tensor + sequence parallel", T, True, Recompute.NONE, 34 / T, 1 / T),
    ("tensor parallel + selective recompute", T, False, Recompute.SELECTIVE, 10 + 24 / T, 0),
    ("tensor + sequence parallel + selective recompute", T, True, Recompute.SELECTIVE, 34 / T, 0),
    ("full activation recompute", T, False, Recompute.FULL, 2, 0),
]


@pytest.mark.parametrize(("name", "tp", "sp", "recompute", "base", "attention"), KORTHIKANTI_TABLE_2,
                         ids=[row[0] for row in KORTHIKANTI_TABLE_2])
def test_korthikanti_table_2_per_layer_activations(name: str, tp: int, sp: bool, recompute: Recompute,
                                                     base: float, attention: float) -> None:
    """Korthikanti et al. 2022 Table 2, e.g. sbh(34 + 5as/h) without parallelism and
    sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, evaluated for GPT-3 175B."""
    s, b, h, a = GPT3.seq_len, 1, GPT3.d_model, GPT3.n_heads
    expected = s * b * h * (base + attention * 5 * a * s / h)
    got = activation_bytes_per_layer(GPT3, micro_batch=b, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)


def test_gpt3_layer_without_parallelism_is_2_87_gb() -> None:
    """sbh(34 + 5as/h) for GPT-3 175B: 5as/h = 80, so 2048 x 12288 x 114 bytes = 2.87 GB per layer."""
    assert 5 * GPT3.n_heads * GPT3.seq_len / GPT3.d_model == 80
    assert activation_bytes_per_layer(GPT3) == 2048 * 12288 * 114


@pytest.mark.parametrize(("model", "saving"), [(GPT3, 0.70), (MT_NLG, 0.65)], ids=["GPT-3", "MT-NLG"])
def test_selective_recompute_saves_70_and_65_percent(model: Transformer, saving: float) -> None:
    """Korthikanti §5: with sequence parallelism, selective recomputation cuts the activation memory
    of GPT-3 by 70 % and of MT-NLG 530B by 65 % (5as/h = 80 and 64 against 34)."""
    kwargs = {"tp": T, "sequence_parallel": True}
    full = activation_bytes_per_layer(model, **kwargs)
    selective = activation_bytes_per_layer(model, recompute=Recompute.SELECTIVE, **kwargs)
    assert 1 - selective / full == pytest.approx(saving, abs=0.005)


def test_sequence_parallel_and_selective_recompute_cut_activations_5x() -> None:
    """Korthikanti abstract: the two techniques reduce activation memory about 5x against plain
    tensor parallelism (23 / 4.25 = 5.4 for GPT-3)."""
    baseline = activation_bytes_per_layer(GPT3, tp=T)
    both = activation_bytes_per_layer(GPT3, tp=T, sequence_parallel=True, recompute=Recompute.SELECTIVE)
    assert baseline / both > 5


@pytest.mark.parametrize("pp", [2, 4, 8, 16, 32])
def test_first_pipeline_stage_holds_all_layers_worth_whatever_p(pp: int) -> None:
    """Korthikanti §4.2.3: under 1F1B the first stage keeps p micro-batches of L/p layers, i.e.
    sbhL/t (34 + 5as/h) regardless of p (plus small embedding-dropout masks). The paper's attention keeps its
    score matrix (no fused kernel)."""
    layout = Layout(tp=T, pp=pp, sequence_parallel=True, microbatches=64, fused_attention=False)
    s, h, a, L = GPT3.seq_len, GPT3.d_model, GPT3.n_heads, GPT3.n_layers
    closed_form = s * h * L / T * (34 + 5 * a * s / h)
    assert activations_bytes_per_device(GPT3, layout) == pytest.approx(closed_form, rel=0.005)


def test_interleaved_schedule_penalty() -> None:
    """Korthikanti §4.2.3: the interleaved schedule's first stage holds L (1 + (p-1)/(pm)) layers'
    worth, m being the interleaving stages: 1 + 7/16 for p = 8, m = 2."""
    plain = Layout(tp=T, pp=8, sequence_parallel=True, microbatches=64, fused_attention=False)
    interleaved = plain.model_copy(update={"schedule": Schedule.INTERLEAVED, "virtual_stages": 2})
    ratio = activations_bytes_per_device(GPT3, interleaved) / activations_bytes_per_device(GPT3, plain)
    assert ratio == pytest.approx(1 + 7 / 16, rel=0.005)


def test_a_fused_attention_kernel_keeps_no_scores_and_llama_keeps_no_dropout_masks() -> None:
    """A fused (flash) kernel keeps no score matrix, like selective recomputation (Korthikanti §5); a model
    without dropout (Llama) keeps no masks: 8 of the 10 replicated sbh bytes, and 2 of the 5 as²b."""
    fused = activations_bytes_per_device(GPT3, Layout(tp=T, sequence_parallel=True))
    selective = activations_bytes_per_device(GPT3, Layout(tp=T, sequence_parallel=True, recompute="selective",
                                                          fused_attention=False))
    assert fused == pytest.approx(selective)
    no_dropout = GPT3.model_copy(update={"dropout": False})
    s, h, a = GPT3.seq_len, GPT3.d_model, GPT3.n_heads
    kept = activation_bytes_per_layer(no_dropout)
    assert kept == pytest.approx(activation_bytes_per_layer(GPT3) - 2 * s * h - 3 * a * s * s)


def test_uneven_stages_put_one_layer_fewer_on_the_first_and_last() -> None:
    """Llama 3 (§3.3.2): 126 layers on 16 stages, one fewer on the first and the last, which hold the embedding
    and the output layer; a count that no such rule evens out goes to the middle stages, then the first."""
    assert Layout(pp=16).stage_layers(126) == (7, *(8,) * 14, 7)
    assert Layout(pp=4).stage_layers(128) == (32,) * 4
    assert Layout(pp=4).stage_layers(11) == (3, 3, 3, 2)  # the last, with the output layer, has fewest
    assert Layout(pp=2, layers_per_stage=(5, 7)).stage_layers(12) == (5, 7)


def test_gpipe_holds_every_micro_batch() -> None:
    one_f_one_b = Layout(pp=4, microbatches=16)
    gpipe = one_f_one_b.model_copy(update={"schedule": Schedule.GPIPE})
    ratio = activations_bytes_per_device(GPT3, gpipe) / activations_bytes_per_device(GPT3, one_f_one_b)
    assert ratio == pytest.approx(16 / 4, rel=0.01)


def test_headroom_is_memory_left_free() -> None:
    memory = estimate_memory(Transformer.from_parameters(1e9), Layout(), headroom=0.2)
    assert memory.required_bytes_per_device == pytest.approx(memory.used_bytes_per_device / 0.8)
    with pytest.raises(ValueError):
        estimate_memory(Transformer.from_parameters(1e9), Layout(), headroom=1.0)


def test_bytes_per_parameter_is_configurable() -> None:
    model = Transformer.from_parameters(1e9)
    bf16_adam = BytesPerParameter(weights=2, gradients=2, master_weights=0, optimizer_states=4)
    assert estimate_memory(model, Layout(), bytes_per_parameter=bf16_adam).model_states_bytes_per_device == 8e9


shapes = st.builds(
    lambda layers, heads, head_dim, seq: Transformer(
        n_layers=layers, d_model=heads * head_dim, n_heads=heads, vocab_size=1000, seq_len=seq),
    st.integers(1, 48), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([16, 64, 128]),
    st.sampled_from([128, 512, 2048]),
)
layouts = st.builds(
    Layout, dp=st.sampled_from([1, 2, 8, 64]), tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]),
    micro_batch=st.integers(1, 8), microbatches=st.integers(1, 16), sequence_parallel=st.booleans(),
    recompute=st.sampled_from(list(Recompute)),
)


@settings(max_examples=60, deadline=None)
@given(shapes, layouts)
def test_more_zero_sharding_never_increases_memory(model: Transformer, layout: Layout) -> None:
    used = [estimate_memory(model, layout.model_copy(update={"zero_stage": z})).used_bytes_per_device
            for z in ZeroStage]
    assert used == sorted(used, reverse=True)


@settings(max_examples=60, deadline=None)
@given(shapes, layouts)
def test_recomputation_never_increases_per_layer_activations(model: Transformer, layout: Layout) -> None:
    def per_layer(mode: Recompute) -> float:
        return activation_bytes_per_layer(model, micro_batch=layout.micro_batch, tp=layout.tp,
                                          sequence_parallel=layout.sequence_parallel, recompute=mode)

    assert per_layer(Recompute.NONE) >= per_layer(Recompute.SELECTIVE) >= per_layer(Recompute.FULL)


@settings(max_examples=60, deadline=None)
@given(shapes, layouts)
def test_more_tensor_parallelism_never_increases_memory(model: Transformer, layout: Layout) -> None:
    small = estimate_memory(model, layout).used_bytes_per_device
    large = estimate_memory(model, layout.model_copy(update={"tp": layout.tp * 2})).used_bytes_per_device
    assert large <= small


def test_grouped_query_attention_keeps_narrower_keys_and_values() -> None:
    # Korthikanti's 34sbh counts Q, K and V at 2sbh each; with 8 kv heads of 64, K and V are 1/8 as wide.
    mha = Transformer(n_layers=80, d_model=8192, n_heads=64, d_ff=4 * 8192, vocab_size=32000, seq_len=4096)
    gqa = mha.model_copy(update={"n_kv_heads": 8})
    sbh = 4096 * 8192
    assert activation_bytes_per_layer(mha) - activation_bytes_per_layer(gqa) == 4 * sbh * (1 - 1 / 8)
    assert activation_bytes_per_layer(gqa, recompute=Recompute.FULL) == activation_bytes_per_layer(
        mha, recompute=Recompute.FULL)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_ranks_hold_a_share_of_the_narrower_keys_and_values(tp: int) -> None:
    # Llama 2 70B's attention: 64 query heads share 8 kv heads; tp divides both.
    mha = Transformer(n_layers=80, d_model=8192, n_heads=64, d_ff=28672, vocab_size=32000, seq_len=4096,
                      gated_mlp=True, biases=False, learned_positions=False, tied_embeddings=False)
    gqa = mha.model_copy(update={"n_kv_heads": 8})
    sbh, layout = 4096 * 8192, Layout(tp=tp)
    # activations: each rank keeps 1/tp of K and V, which are 1/8 as wide as MHA's
    assert activation_bytes_per_layer(mha, tp=tp) - activation_bytes_per_layer(gqa, tp=tp) == 4 * sbh * (1 - 1 / 8) / tp
    # model states: the K/V weights are 2 h x (kv heads x 128) per layer, 1/tp of them per rank
    saved = estimate_memory(mha, layout).parameters_per_device - estimate_memory(gqa, layout).parameters_per_device
    assert saved == pytest.approx(80 * 2 * 8192 * (8192 - 8 * 128) / tp)
