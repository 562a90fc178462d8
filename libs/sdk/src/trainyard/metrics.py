"""Throughput accounting: model FLOPs per token, device peak FLOP/s, MFU.

Model FLOPs per token follow PaLM (Chowdhery et al. 2022, Appendix B): ``6N + 12 L H Q T`` —
``N`` parameters (every parameter, as :mod:`trainyard_planner` counts them, so the two agree),
``L`` layers, ``H`` heads of width ``Q``, ``T`` the training sequence length. MFU is achieved
model FLOP/s over the peak of the devices that produced them::

    mfu = flops_per_token x tokens_per_second / (world_size x peak_flops_per_device)

Recomputed activations (activation checkpointing) cost hardware FLOPs but are not model FLOPs,
so they lower MFU, as they should. Peak FLOP/s come from a device table (dense, no sparsity) or,
on CPU, from a matmul probe run once per host and cached under the artifact root.
"""

from __future__ import annotations

import json
import logging
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.storage import atomic_write_bytes

log = logging.getLogger("trainyard")

# Dense peak FLOP/s per device (vendor datasheets, SXM parts): bf16 tensor cores, and fp32
# (TF32 tensor cores when matmuls may use them, plain fp32 otherwise).
DEVICE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12},
}
CPU_PROBE_SIZE = 512
CPU_PROBE_SECONDS = 0.5


def flops_per_token(config: ModelConfig, sequence_length: int) -> float:
    """PaLM's model FLOPs per trained token: ``6N + 12 L H Q T`` (``H Q = d_model``)."""
    return 6.0 * config.num_parameters + 12.0 * config.n_layers * config.d_model * sequence_length


def mfu(*, flops_per_token: float, tokens_per_second: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation of ``devices`` devices of ``peak_flops`` each."""
    return flops_per_token * tokens_per_second / (devices * peak_flops)


def table_peak_flops(device_name: str, precision: str) -> float | None:
    """The table's figure for a device name such as ``NVIDIA H100 80GB HBM3``; None if unknown.

    ``precision`` is ``bf16``, ``tf32`` or ``fp32``.
    """
    upper = device_name.upper()
    for family, figures in DEVICE_PEAK_FLOPS.items():
        if family in upper:
            return figures[precision]
    return None


@dataclass(frozen=True)
class PeakFlops:
    """Peak FLOP/s of one device and where the number came from."""

    flops: float
    source: str  # "table: H100 bf16", "probe: cached …", "setting"
    device: str


def probe_cpu_flops(*, size: int = CPU_PROBE_SIZE, seconds: float = CPU_PROBE_SECONDS,
                    dtype: torch.dtype = torch.float32) -> float:
    """Measured FLOP/s of ``size``-square matmuls on this process's CPU threads (best of the run)."""
    a = torch.randn(size, size, dtype=dtype, generator=torch.Generator().manual_seed(0))
    b = torch.randn(size, size, dtype=dtype, generator=torch.Generator().manual_seed(1))
    torch.mm(a, b)  # warm up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        elapsed = time.perf_counter() - started
        best = max(best, 4 * 2 * size**3 / elapsed)
    return best


def cpu_probe_key(dtype: torch.dtype) -> str:
    """What a cached CPU figure is valid for: the host, its processor, the thread count, the dtype."""
    processor = platform.processor() or platform.machine()
    return f"{socket.gethostname()}|{processor}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"


def cpu_peak_flops(cache_file: Path, *, dtype: torch.dtype = torch.float32, probe: bool = True) -> PeakFlops:
    """The cached probe figure for this host, or a fresh probe (then cached) when ``probe``."""
    key = cpu_probe_key(dtype)
    cached = _read_cache(cache_file)
    if key in cached:
        return PeakFlops(float(cached[key]), f"probe (cached in {cache_file.name})", "cpu")
    if not probe:
        raise LookupError(key)
    flops = probe_cpu_flops(dtype=dtype)
    cached = _read_cache(cache_file)  # another host may have written meanwhile
    cached[key] = flops
    try:
        atomic_write_bytes(cache_file, json.dumps(cached, indent=2, sort_keys=True).encode())
    except OSError as exc:  # a sandboxed rank sees the host's cache read-only (or not at all)
        log.info("CPU matmul probe: %.3g FLOP/s (%s), not cached (%s)", flops, key, exc.strerror or exc)
        return PeakFlops(flops, "probe (measured now)", "cpu")
    log.info("CPU matmul probe: %.3g FLOP/s (%s), cached in %s", flops, key, cache_file)
    return PeakFlops(flops, "probe (measured now)", "cpu")


def _read_cache(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def device_peak_flops(device: torch.device, autocast: torch.dtype | None, *, cache_file: Path,
                      override: float | None = None, probe: bool = True) -> PeakFlops | None:
    """Peak FLOP/s of one device of this run, or None when neither the table nor a probe knows it."""
    if override is not None:
        return PeakFlops(override, "setting TRAINYARD_PEAK_FLOPS", str(device))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if autocast == torch.bfloat16:
            precision = "bf16"
        else:
            precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        flops = table_peak_flops(name, precision)
        return None if flops is None else PeakFlops(flops, f"table: {name} {precision}", name)
    dtype = torch.bfloat16 if autocast == torch.bfloat16 else torch.float32
    try:
        return cpu_peak_flops(cache_file, dtype=dtype, probe=probe)
    except LookupError:
        return None
