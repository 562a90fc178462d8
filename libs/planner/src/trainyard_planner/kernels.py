"""How long a pipeline stage computes one micro-batch: its matmuls at a share of the device's peak that depends on
their shape, plus the memory-bound kernels at the device's memory bandwidth (pure).

One constant share of peak cannot describe both ends of Megatron-LM's Table 1 (Narayanan et al. 2021): the 1.7B
model (h = 2304, 24 heads on one GPU, micro-batch 16) reaches 44 % of the A100's peak and the 1T model (h =
25,600 over 8 tensor ranks, micro-batch 1) 52 % *with* a 12 % pipeline bubble, because what does not scale with
the matmuls differs: the softmax over a materialised ``a s^2 b`` score matrix, and the norms, dropout, GeLU and
residual adds, which move bytes proportional to ``s b h`` while the matmuls grow with ``s b h^2``. So a layer's
forward on one rank is

    matmuls / (peak x e(shape))  +  attention core / (peak x e x attention share)  +  bytes moved / HBM bandwidth

``e(shape)`` is the device's sustained matmul share (:attr:`DeviceSpec.matmul_efficiency`: A100 0.80, H100
0.60, what large bf16 GEMMs sustain through a run) scaled by ``d / (d + d_half)`` for the smallest GEMM
dimension ``d`` (tiles go idle on thin matmuls). The backward pass costs twice the forward (matmuls and bytes
alike); full recomputation runs the forward again, selective the attention core. The last stage adds the output layer
(logits and the fp32 cross-entropy), not recomputed.

Bytes moved per layer forward (:class:`KernelModel`): ``replicated_bytes`` per token per hidden unit (norms,
dropout, residuals, biases: on every tensor rank unless sequence parallelism splits them), ``ffn_bytes`` per
token per FFN unit (the activation function, split by ``t``), and ``score_bytes`` per materialised score (scale,
mask, softmax, dropout: absent under a fused attention kernel, which also skips the masked half of a causal
score matrix). The defaults reproduce Megatron-LM's Table 1 and Llama 3's Table 4 with one setting for all rows
(tests/unit/trainyard_planner/test_published.py).
"""

from __future__ import annotations

from pydantic import Field

from trainyard_planner._private import Model
from trainyard_planner.compute import DeviceSpec
from trainyard_planner.layout import Layout, Recompute
from trainyard_planner.model import Transformer


class KernelModel(Model):
    """The few constants of the kernel-time model (one setting for every device and run)."""

    matmul_half_dim: float = Field(default=192.0, gt=0, description="GEMM dimension at which a matmul "
                                                                    "reaches half of the device's matmul share")
    replicated_bytes: float = Field(default=48.0, ge=0, description="bytes moved per token per hidden unit per "
                                                                    "layer forward by norms, dropout, residuals")
    ffn_bytes: float = Field(default=8.0, ge=0, description="bytes per token per FFN unit (the activation)")
    score_bytes: float = Field(default=16.0, ge=0, description="bytes per materialised attention score "
                                                               "(scale, mask, softmax, dropout), forward")
    batched_attention: float = Field(default=0.6, gt=0, le=1, description="share of the matmul rate the "
                                                                          "unfused score and value matmuls reach")
    fused_attention: float = Field(default=0.45, gt=0, le=1, description="share of the matmul rate a fused "
                                                                         "(flash) attention kernel reaches "
                                                                         "(FlashAttention-2 on an H100)")
    collective_efficiency: float = Field(default=0.8, gt=0, le=1, description="share of a link's bandwidth "
                                                                              "a collective sustains")


KERNELS = KernelModel()


class StageTime(Model):
    """One micro-batch through the slowest pipeline stage on one rank (forward, backward, recomputation)."""

    layers: int = Field(description="transformer layers on that stage")
    matmul_seconds: float
    memory_seconds: float = Field(description="memory-bound kernels")
    output_seconds: float = Field(description="the output layer, on the last stage")
    matmul_efficiency: float = Field(description="the share of peak its layer matmuls sustain")

    @property
    def seconds(self) -> float:
        return self.matmul_seconds + self.memory_seconds + self.output_seconds


def matmul_efficiency(model: Transformer, layout: Layout, device: DeviceSpec, kernels: KernelModel = KERNELS) -> float:
    """The share of peak a layer's matmuls sustain: the device's, lower when a GEMM is thin."""
    rows = layout.micro_batch * model.seq_len // layout.cp
    thinnest = max(1, min(rows, model.d_model, (model.attention_width + 2 * model.kv_width) // layout.tp,
                          model.ffn_width // layout.tp))
    return device.matmul_efficiency * thinnest / (thinnest + kernels.matmul_half_dim)


def layer_forward(model: Transformer, layout: Layout, device: DeviceSpec, efficiency: float,
                  kernels: KernelModel = KERNELS) -> tuple[float, float, float]:
    """(matmul, attention core, memory-bound) seconds of one layer's forward for one micro-batch on one rank."""
    t, cp = layout.tp, layout.cp
    tokens = layout.micro_batch * model.seq_len // cp  # this rank's queries
    h, f, q, kv = model.d_model, model.ffn_width, model.attention_width, model.kv_width
    matrices = 3 if model.gated_mlp else 2
    flops = 2 * tokens * h * (q + 2 * kv + q) / t + 2 * tokens * h * f * matrices / t
    rate = device.peak_flops * efficiency
    scores = tokens * model.seq_len * model.n_heads / t  # this rank's score elements (queries x keys x heads)
    core = 4 * scores * model.head_dim  # QK^T and AV, forward
    if layout.fused_attention:  # a causal fused kernel skips the masked half, keeps no scores in memory
        core_seconds = core / 2 / (rate * kernels.fused_attention)
        score_bytes = 0.0
    else:
        core_seconds = core / (rate * kernels.batched_attention)
        score_bytes = kernels.score_bytes * scores
    replicated = kernels.replicated_bytes * tokens * h / (t if layout.sequence_parallel else 1)
    moved = replicated + kernels.ffn_bytes * tokens * f / t + score_bytes
    return flops / rate, core_seconds, moved / device.memory_bandwidth


def stage_time(model: Transformer, layout: Layout, device: DeviceSpec, *, efficiency: float | None = None,
               kernels: KernelModel = KERNELS) -> StageTime:
    """One micro-batch through the slowest stage (the fullest one, or the last with the output layer)."""
    e = efficiency if efficiency is not None else matmul_efficiency(model, layout, device, kernels)
    mm, core, mem = layer_forward(model, layout, device, e, kernels)
    # recomputation runs the forward again (full) or the attention core (selective: nothing to redo when a fused
    # kernel kept no scores in the first place)
    extra_compute, extra_memory = 0.0, 0.0
    if layout.recompute is Recompute.FULL:
        extra_compute, extra_memory = mm + core, mem
    elif layout.recompute is Recompute.SELECTIVE and not layout.fused_attention:
        extra_compute = core
    per_layer_compute = 3 * (mm + core) + extra_compute  # forward, backward (twice), recomputation
    per_layer_memory = 3 * mem + extra_memory
    counts = layout.stage_layers(model.n_layers)
    tokens = layout.micro_batch * model.seq_len // layout.cp
    output_flops = 3 * 2 * tokens * model.d_model * model.vocab_size / layout.tp
    output = (output_flops / (device.peak_flops * device.matmul_efficiency)
              + 3 * 4 * tokens * model.vocab_size / layout.tp / device.memory_bandwidth)
    fullest = max(counts)
    last = counts[-1]
    slowest_layers, with_output = max((fullest, 0.0), (last, output), key=lambda c: c[0] * (
        per_layer_compute + per_layer_memory) + c[1])
    return StageTime(layers=slowest_layers, matmul_seconds=slowest_layers * per_layer_compute,
                     memory_seconds=slowest_layers * per_layer_memory, output_seconds=with_output,
                     matmul_efficiency=e)
