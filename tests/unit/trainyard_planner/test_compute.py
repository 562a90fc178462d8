"""Training FLOPs, time to train, MFU and the device table."""

from __future__ import annotations

import pytest

from trainyard_planner import (
    DEVICES,
    DeviceSpec,
    Recompute,
    Transformer,
    cpu_device,
    device_spec,
    hardware_flops_per_token,
    mfu,
    model_flops_per_token,
    resolve_device,
    training_flops,
    training_time,
)


def test_seed_70b_on_1t_tokens_is_4_2e23_flops() -> None:
    """The seed: 6 x 70e9 x 1e12 = 4.2e23 FLOPs."""
    assert training_flops(70e9, 1e12) == pytest.approx(4.2e23, rel=1e-15)


def test_seed_63_days_on_256_devices_at_300_tflops() -> None:
    """The seed: 4.2e23 / (256 x 3e14) = 5.47e6 s, about 63 days, each device sustaining 300 TFLOP/s."""
    time = training_time(4.2e23, devices=256, peak_flops_per_device=300e12)
    assert time.seconds == pytest.approx(5.46875e6)
    assert round(time.days) == 63


def test_mfu_stretches_the_time() -> None:
    """Time = FLOPs / (devices x peak x MFU): 989 TFLOP/s at 30 % MFU is about 297 TFLOP/s."""
    at_peak = training_time(4.2e23, devices=256, peak_flops_per_device=989e12)
    at_mfu = training_time(4.2e23, devices=256, peak_flops_per_device=989e12, mfu=0.3)
    assert at_mfu.seconds == pytest.approx(at_peak.seconds / 0.3)
    assert round(at_mfu.days) == 64


def test_palm_540b_mfu_is_46_2_percent() -> None:
    """Chowdhery et al. 2022 (PaLM), §4 and Appendix B: model FLOPs per token 6N + 12LHQT with
    N = 540.35B, L = 118, H = 48, Q = 256, T = 2048; 238.3K tokens/s on 6144 TPU v4 chips of
    275 TFLOP/s peak is 46.2 % MFU."""
    palm = Transformer(n_layers=118, d_model=18432, n_heads=48, d_head=256, vocab_size=256_000, seq_len=2048,
                       declared_parameters=540_350_000_000)
    per_token = model_flops_per_token(palm)
    assert per_token == 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    assert mfu(238.3e3, per_token, devices=6144, peak_flops_per_device=275e12) == pytest.approx(0.462, abs=0.0005)


def test_full_recompute_matches_megatron_flops_formula() -> None:
    """Narayanan et al. 2021 (Megatron-LM on GPU clusters), §5.1: with full recomputation an
    iteration costs 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs (the layers run forward twice, the
    logits once). For N = 12lh^2 + Vh, the count their formula assumes, ours agrees to 1e-4 (it
    also counts biases, norms and learned positions)."""
    l, h, s, v, b = 96, 12288, 2048, 51200, 1536  # noqa: E741 - the paper's symbols
    model = Transformer(n_layers=l, d_model=h, n_heads=96, vocab_size=v, seq_len=s,
                        declared_parameters=12 * l * h * h + v * h)
    megatron = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert hardware_flops_per_token(model, Recompute.FULL) * b * s == pytest.approx(megatron, rel=1e-4)
    # Model FLOPs (no recomputation): the layers' term is three passes instead of four, the logits'
    # 6BshV unchanged, i.e. 72 B s l h^2 (1 + s/6h + V/12lh), exactly PaLM's 6N + 12LHQT.
    model_flops = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert model_flops_per_token(model) * b * s == pytest.approx(model_flops, rel=1e-12)


def test_attention_term_can_be_left_out() -> None:
    model = Transformer.from_parameters(7e9)
    assert model_flops_per_token(model, attention=False) == 6 * 7e9
    assert hardware_flops_per_token(model, Recompute.SELECTIVE) > model_flops_per_token(model)


DATASHEET = [
    # (name, dense bf16 FLOP/s, memory bytes): NVIDIA A100 / H100 SXM / H200 datasheets.
    ("a100-80gb", 312e12, 80e9),
    ("a100-40gb", 312e12, 40e9),
    ("h100-80gb", 989e12, 80e9),
    ("h200-141gb", 989e12, 141e9),
]


@pytest.mark.parametrize(("name", "peak", "memory"), DATASHEET)
def test_device_table(name: str, peak: float, memory: float) -> None:
    spec = device_spec(name)
    assert (spec.peak_flops, spec.memory_bytes) == (peak, memory)
    assert spec.nvlink_bandwidth > spec.network_bandwidth


def test_device_aliases_and_unknowns() -> None:
    assert device_spec("H100") == DEVICES["h100-80gb"]
    with pytest.raises(KeyError, match="known: a100"):
        device_spec("tpu-v9")


def test_cpu_device_uses_the_measured_peak() -> None:
    cpu = cpu_device(measured_peak_flops=5e10, memory_bytes=8e9)
    assert cpu.peak_flops == 5e10
    assert training_time(6e15, devices=2, peak_flops_per_device=cpu.peak_flops).seconds == 6e4


def test_llama_flops_count_its_own_parameters_and_every_query_head() -> None:
    from trainyard_contract.catalog import MODEL_CATALOG

    config = MODEL_CATALOG["llama-1b@v1"]
    model = Transformer.from_model_config(config, seq_len=2048)
    # 6N with the untied head and narrow K/V in N; the attention term counts all 32 query heads.
    assert model_flops_per_token(model) == 6 * 1_100_048_384 + 12 * 22 * 2048 * 2048
    mha = model.model_copy(update={"n_kv_heads": None})
    assert mha.exact_parameters > model.exact_parameters
    extra = mha.exact_parameters - model.exact_parameters
    assert model_flops_per_token(mha) - model_flops_per_token(model) == 6 * extra


CPU_RANK = cpu_device(10e9, 16e9, devices_per_node=4)


@pytest.mark.parametrize(("device", "kwargs", "expected"), [
    ("h100", {}, device_spec("h100-80gb")),
    (device_spec("a100-40gb"), {"peak_flops": 1.0}, device_spec("a100-40gb")),  # a DeviceSpec is taken as is
    ("h100", {"peak_flops": 5e14}, device_spec("h100").model_copy(update={"peak_flops": 5e14})),
    ("a100", {"memory_bytes": 40e9}, device_spec("a100").model_copy(update={"memory_bytes": 40e9})),
    ("mydev", {"peak_flops": 1e14, "memory_bytes": 2e10}, cpu_device(1e14, 2e10, name="mydev")),
    (" CPU ", {"cpu": CPU_RANK}, CPU_RANK),  # the caller's CPU ranks
    ("cpu", {"peak_flops": 1e11, "memory_bytes": 8e9}, cpu_device(1e11, 8e9, name="cpu")),  # none given
])
def test_resolve_device(device: str | DeviceSpec, kwargs: dict, expected: DeviceSpec) -> None:
    assert resolve_device(device, **kwargs) == expected


@pytest.mark.parametrize(("device", "kwargs"), [("mydev", {}), ("mydev", {"peak_flops": 1e14}), ("cpu", {})])
def test_resolve_device_names_the_known_types_when_it_cannot(device: str, kwargs: dict) -> None:
    with pytest.raises(KeyError, match="known: a100"):
        resolve_device(device, **kwargs)
