"""What the platform assumes where neither a plan request nor a spec says, and how the trainer runs a spec.

Shared by the API's capacity planning (``POST /v1/plan``, the submission memory check) and the telemetry
service's calibration (which compares what rank 0 measured with what the planner predicted for the job as
the trainer runs it): both must predict with the same assumptions, or the fitted factors would correct the
wrong figure. Pure; a spec is read by duck typing (the planner depends on pydantic alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainyard_planner.compute import (
    DeviceSpec,
    cpu_device,
    device_spec,
    resolve_device,
)
from trainyard_planner.layout import Layout, LayoutAssumption, spec_layout
from trainyard_planner.memory import FP32_ADAM, BytesPerParameter

__all__ = [
    "DEFAULT_CPU_PEAK_FLOPS",
    "DEFAULT_DEVICE_MTBF_HOURS",
    "DEFAULT_MFU",
    "DEFAULT_WRITE_BANDWIDTH",
    "Assumptions",
    "device_type_of",
    "trainer_bytes_per_parameter",
    "trainer_layout",
]

_GB = 1e9

DEFAULT_MFU = 0.4
"""MFU assumed for time-to-train when no layout was estimated (large dense runs report 35-55 %)."""

DEFAULT_DEVICE_MTBF_HOURS = 50_000.0
"""Per-device MTBF when none is given: Llama 3 saw 419 unexpected interruptions in 54 days on
16,384 H100s (Dubey et al. 2024, §3.3.4), one per ~3.1 h for the job, ~50,000 h per device."""

DEFAULT_CPU_PEAK_FLOPS = 10e9
"""FLOP/s one CPU rank is assumed to reach: a conservative figure for one thread of fp32 matmul on a
current x86 core (AVX2 reaches several times more); calibration corrects it per platform."""

DEFAULT_WRITE_BANDWIDTH = 500e6
"""Bytes/s the platform's checkpoint predictions assume for the artifact store (a local SSD's
fsync'd sequential rate, conservatively); calibration corrects it."""


@dataclass(frozen=True)
class Assumptions:
    """What the platform assumes where neither a request nor a spec says: the ``cpu`` device
    (a configured per-rank peak; ranks of one job share one host) and the checkpoint write bandwidth."""

    cpu_peak_flops: float = DEFAULT_CPU_PEAK_FLOPS
    cpu_memory_bytes: float = 16 * _GB
    write_bandwidth: float = DEFAULT_WRITE_BANDWIDTH
    efficiency: float | None = None  # the matmuls' share of peak: None, the planner's kernel model (kernels.py)

    def device(self, name: str | DeviceSpec, *, devices: int = 1) -> DeviceSpec:
        """The DeviceSpec of a device type; ``cpu`` from the assumed peak, with ``devices`` ranks on
        one host (one shared-memory domain). Raises KeyError naming the known types."""
        cpu = cpu_device(self.cpu_peak_flops, self.cpu_memory_bytes, devices_per_node=devices)
        return resolve_device(name, cpu=cpu)


def device_type_of(name: str) -> str:
    """The canonical device type a calibration is kept under: ``h100`` → ``h100-80gb``, ``CPU`` → ``cpu``;
    a type the planner does not know, lower-cased."""
    key = name.strip().lower()
    if key == "cpu":
        return key
    try:
        return device_spec(key).name
    except KeyError:
        return key


def trainer_bytes_per_parameter(spec: Any) -> BytesPerParameter:
    """fp32 weights and gradients, plus AdamW's m and v (16 B) or SGD's momentum (12 B)."""
    if spec.training.optimizer.name == "sgd":
        return BytesPerParameter(weights=4, gradients=4, master_weights=0, optimizer_states=4)
    return FP32_ADAM


def trainer_layout(spec: Any) -> Layout:
    """The layout the trainer runs a spec with: DDP (ZeRO 0), fused attention, no checkpointing."""
    return spec_layout(spec, assume=LayoutAssumption.TRAINER_DEFAULTS)
