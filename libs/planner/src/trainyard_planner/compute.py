"""Training FLOPs, time to train, MFU, and the accelerators the planner knows.

``training FLOPs ~ 6 N D`` (Kaplan et al. 2020: 2 FLOPs per parameter per token forward, 4
backward). The attention-aware count per token is PaLM's (Chowdhery et al. 2022, Appendix B):
``6N + 12 L H Q T`` with ``L`` layers, ``H`` heads of width ``Q`` (``H Q = d_model``) and sequence
``T``; MFU = achieved tokens/s x that count / (devices x peak). Recomputation adds hardware FLOPs
(the layers' forward again, about ``2N + 4LHQT`` per token, when full) but not model FLOPs, so MFU ignores it.

Model FLOPs or hardware FLOPs. A published throughput says which it counts, and time to train must
divide the same count: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", §5.1) quote achieved TFLOP/s that include full activation
recomputation, ``8 N`` per token instead of ``6 N`` (their end-to-end time ``8 T P / (n X)``), so
GPT-3 175B on 300B tokens at 140 TFLOP/s on 1024 A100s is ~34 days, not the 25 days ``6 N D``
gives at the same rate. :class:`FlopsCount` names the two; :func:`training_time` takes the FLOPs the
rate counts, :func:`hardware_training_flops` gives the hardware count (with the attention and
logits terms their own per-iteration formula keeps, about 3 % above ``8 T P`` for GPT-3).

Both architectures use the same count with their own exact ``N``: for ``llama`` that includes the
untied output head and the narrower K/V projections of grouped-query attention, while the
attention term keeps ``H`` query heads (every query head scores against its shared K/V head).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from trainyard_planner._private import GB, Model
from trainyard_planner.layout import Recompute
from trainyard_planner.model import Transformer

SECONDS_PER_DAY = 86_400.0


def training_flops(parameters: float, tokens: float) -> float:
    """``6 N D``: 6 x 70e9 x 1e12 = 4.2e23."""
    return 6.0 * parameters * tokens


def attention_flops_per_token(model: Transformer) -> float:
    """PaLM's ``12 L H Q T``: the score and value matmuls, forward and backward."""
    return 12.0 * model.n_layers * model.attention_width * model.seq_len


def model_flops_per_token(model: Transformer, *, attention: bool = True) -> float:
    """``6N + 12 L H Q T`` (PaLM Appendix B), or ``6N`` without the attention term."""
    return 6.0 * model.parameters + (attention_flops_per_token(model) if attention else 0.0)


def hardware_flops_per_token(model: Transformer, recompute: Recompute | str = Recompute.NONE) -> float:
    """Model FLOPs plus what recomputation runs again: every transformer layer's forward (full;
    the output head is not recomputed) or the attention core's forward (selective)."""
    recompute = Recompute(recompute)
    flops = model_flops_per_token(model)
    if recompute is Recompute.FULL:
        layer_share = model.n_layers * model.parameters_per_layer / model.exact_parameters
        flops += 2.0 * model.parameters * layer_share + attention_flops_per_token(model) / 3
    elif recompute is Recompute.SELECTIVE:
        flops += attention_flops_per_token(model) / 3
    return flops


def hardware_training_flops(model: Transformer, tokens: float, recompute: Recompute | str = Recompute.NONE) -> float:
    """What the devices execute over ``tokens``: :func:`hardware_flops_per_token` x ``D``
    (about ``8 N D`` with full recomputation)."""
    return hardware_flops_per_token(model, recompute) * tokens


class FlopsCount(StrEnum):
    """What a throughput (a peak x MFU, an achieved TFLOP/s) counts.

    ``model``: the model's own FLOPs, ``6N + 12 L H Q T`` per token (PaLM's: what every MFU in trainyard
    divides, attention included);
    ``hardware``: what the devices run, recomputation included (Megatron-LM's achieved TFLOP/s,
    hardware FLOPs utilisation)."""

    MODEL = "model"
    HARDWARE = "hardware"


class TrainingTime(Model):
    flops: float = Field(description="the FLOPs divided by the rate: model (6N + 12LHQT per token) or hardware, as "
                                     "`counts` says")
    devices: int
    peak_flops_per_device: float
    mfu: float
    seconds: float
    days: float
    counts: FlopsCount = Field(default=FlopsCount.MODEL,
                               description="what `flops` and the rate (peak x mfu) count: model or hardware FLOPs")


def training_time(
    flops: float,
    *,
    devices: int,
    peak_flops_per_device: float,
    mfu: float = 1.0,
    counts: FlopsCount | str = FlopsCount.MODEL,
) -> TrainingTime:
    """``FLOPs / (devices x peak x MFU)``. With ``mfu=1`` the peak is what each device sustains:
    4.2e23 / (256 x 3e14) = 5.47e6 s, about 63 days. ``counts`` records which FLOPs both sides
    count (the caller passes model FLOPs with a model-FLOPs rate, hardware with hardware)."""
    if devices < 1 or peak_flops_per_device <= 0 or not 0 < mfu <= 1:
        raise ValueError("devices must be >= 1, the peak positive and mfu in (0, 1]")
    seconds = flops / (devices * peak_flops_per_device * mfu)
    return TrainingTime(
        flops=flops, devices=devices, peak_flops_per_device=peak_flops_per_device, mfu=mfu,
        seconds=seconds, days=seconds / SECONDS_PER_DAY, counts=FlopsCount(counts),
    )


def mfu(tokens_per_second: float, flops_per_token: float, *, devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    return tokens_per_second * flops_per_token / (devices * peak_flops_per_device)


class DeviceSpec(Model):
    """One accelerator type: dense bf16 peak, memory, and per-device link bandwidths (one direction)."""

    name: str
    peak_flops: float = Field(gt=0, description="dense bf16 FLOP/s")
    memory_bytes: float = Field(gt=0)
    nvlink_bandwidth: float = Field(gt=0, description="bytes/s per device inside the NVLink domain")
    network_bandwidth: float = Field(gt=0, description="bytes/s per device across nodes (its NIC)")
    nvlink_domain: int = Field(default=8, gt=0, description="devices per NVLink/NVSwitch domain")
    memory_bandwidth: float = Field(default=2.0e12, ge=1e6, description="bytes/s of device memory (HBM)")
    matmul_efficiency: float = Field(default=0.75, ge=0.01, le=1, description="the share of peak large bf16 "
                                                                              "matmuls sustain on it (kernels.py)")


# Datasheet numbers: dense bf16 peak; NVLink 3 / 4 is 600 / 900 GB/s both directions together, so
# 300 / 450 GB/s each way; one HDR (200 Gb/s) or NDR (400 Gb/s) InfiniBand NIC per GPU; HBM bandwidth.
# The matmul share is what large bf16 GEMMs sustain through a long training run: about 250 of the A100's 312
# TFLOP/s, about 590 of the H100 SXM's 989 (the datasheet peak assumes boost clocks that a GPU at its 700 W limit
# does not keep under sustained tensor-core load). Both are what Megatron-LM's Table 1 and Llama 3's Table 4
# imply with the kernel model of kernels.py (tests/unit/trainyard_planner/test_published.py).
DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(name="a100-40gb", peak_flops=312e12, memory_bytes=40 * GB,
                   nvlink_bandwidth=300 * GB, network_bandwidth=25 * GB, memory_bandwidth=1555 * GB,
                   matmul_efficiency=0.80),
        DeviceSpec(name="a100-80gb", peak_flops=312e12, memory_bytes=80 * GB,
                   nvlink_bandwidth=300 * GB, network_bandwidth=25 * GB, memory_bandwidth=2039 * GB,
                   matmul_efficiency=0.80),
        DeviceSpec(name="h100-80gb", peak_flops=989e12, memory_bytes=80 * GB,
                   nvlink_bandwidth=450 * GB, network_bandwidth=50 * GB, memory_bandwidth=3350 * GB,
                   matmul_efficiency=0.60),
        DeviceSpec(name="h200-141gb", peak_flops=989e12, memory_bytes=141 * GB,
                   nvlink_bandwidth=450 * GB, network_bandwidth=50 * GB, memory_bandwidth=4800 * GB,
                   matmul_efficiency=0.60),
    )
}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200": "h200-141gb"}


def device_spec(name: str) -> DeviceSpec:
    """Look up a device type (``h100-80gb``, ``a100``, ...); raises KeyError naming the known ones."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    try:
        return DEVICES[key]
    except KeyError:
        known = ", ".join(sorted([*DEVICES, *_ALIASES]))
        raise KeyError(f"unknown device type {name!r}; known: {known}") from None


def cpu_device(
    measured_peak_flops: float,
    memory_bytes: float,
    *,
    name: str = "cpu",
    memory_bandwidth: float = 10 * GB,
    devices_per_node: int = 1,
) -> DeviceSpec:
    """A CPU "device" from a measured matmul peak (FLOP/s per rank); gloo ranks on one host talk
    through shared memory, so both bandwidths default to a modest memory-copy rate."""
    return DeviceSpec(
        name=name, peak_flops=measured_peak_flops, memory_bytes=memory_bytes,
        nvlink_bandwidth=memory_bandwidth, network_bandwidth=memory_bandwidth,
        nvlink_domain=devices_per_node, memory_bandwidth=memory_bandwidth, matmul_efficiency=1.0,
    )


def resolve_device(
    device: str | DeviceSpec,
    *,
    peak_flops: float | None = None,
    memory_bytes: float | None = None,
    cpu: DeviceSpec | None = None,
) -> DeviceSpec:
    """The DeviceSpec a caller names: a DeviceSpec as is; ``cpu`` (any case) as ``cpu`` when the caller
    describes its CPU ranks; a known type with ``peak_flops`` / ``memory_bytes`` overriding its
    datasheet; an unknown name when both describe it (a :func:`cpu_device` of that name).
    Raises :func:`device_spec`'s KeyError otherwise."""
    if isinstance(device, DeviceSpec):
        return device
    if cpu is not None and device.strip().lower() == "cpu":
        return cpu
    try:
        known = device_spec(device)
    except KeyError:
        if peak_flops is None or memory_bytes is None:
            raise
        return cpu_device(peak_flops, memory_bytes, name=device)
    overrides = {k: v for k, v in (("peak_flops", peak_flops), ("memory_bytes", memory_bytes)) if v is not None}
    return known.model_copy(update=overrides)
