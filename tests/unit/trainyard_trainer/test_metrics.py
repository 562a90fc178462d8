"""MFU accounting: PaLM FLOPs per token, the device table, the cached CPU probe."""

import json
from pathlib import Path

import pytest
import torch

from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_planner import Transformer
from trainyard_planner.compute import model_flops_per_token
from trainyard import metrics
from trainyard.metrics import cpu_peak_flops, device_peak_flops, flops_per_token, mfu, table_peak_flops


@pytest.mark.parametrize("ref", sorted(MODEL_CATALOG))
def test_flops_per_token_is_palms_and_agrees_with_the_planner(ref: str) -> None:
    c = MODEL_CATALOG[ref]
    seq = c.max_seq_len
    assert flops_per_token(c, seq) == 6 * c.num_parameters + 12 * c.n_layers * c.d_model * seq
    planner = Transformer.from_model_config(c, seq_len=seq)
    assert flops_per_token(c, seq) == pytest.approx(model_flops_per_token(planner))


def test_mfu() -> None:
    # 1B-ish: 8e9 FLOPs per token at 50k tokens/s on 8 devices of 1e14 = 0.5
    assert mfu(flops_per_token=8e9, tokens_per_second=50_000, devices=8, peak_flops=1e14) == pytest.approx(0.5)


@pytest.mark.parametrize(("name", "precision", "flops"), [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12), ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H200", "bf16", 989e12), ("NVIDIA H100 PCIe", "tf32", 494e12), ("NVIDIA A100-PCIE-40GB", "fp32", 19.5e12),
    ("Tesla T4", "bf16", None),
])
def test_device_table(name: str, precision: str, flops: float | None) -> None:
    assert table_peak_flops(name, precision) == flops


def test_cpu_probe_runs_once_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "calibration" / "peak-flops.json"
    probes: list[int] = []
    monkeypatch.setattr(metrics, "probe_cpu_flops", lambda **kw: probes.append(1) or 2.5e10)
    first = cpu_peak_flops(cache)
    second = cpu_peak_flops(cache)
    assert first.flops == second.flops == 2.5e10 and probes == [1]
    assert "measured now" in first.source and "cached" in second.source
    key = metrics.cpu_probe_key(torch.float32)
    assert json.loads(cache.read_text()) == {key: 2.5e10}
    with pytest.raises(LookupError):
        cpu_peak_flops(cache, dtype=torch.bfloat16, probe=False)


def test_the_probe_measures_something(tmp_path: Path) -> None:
    flops = metrics.probe_cpu_flops(size=128, seconds=0.05)
    assert 1e8 < flops < 1e14


def test_device_peak_flops_on_cpu_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "probe_cpu_flops", lambda **kw: 3e10)
    cache = tmp_path / "peak.json"
    peak = device_peak_flops(torch.device("cpu"), None, cache_file=cache)
    assert peak is not None and peak.flops == 3e10 and peak.device == "cpu"
    forced = device_peak_flops(torch.device("cpu"), None, cache_file=cache, override=1e12)
    assert forced is not None and forced.flops == 1e12 and "TRAINYARD_PEAK_FLOPS" in forced.source
