"""Memory per device: model states under ZeRO / FSDP, TP and PP, plus activations.

Model states (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §3 and Figure 1): with ``Psi`` parameters on a device, mixed-precision Adam keeps
2 bytes of fp16/bf16 weights, 2 of gradients and ``K = 12`` of optimizer state (fp32 master copy,
Adam m and v), 16 bytes per parameter. Stage 1 divides the ``K`` bytes by the data-parallel degree
``Nd``, stage 2 the gradients too, stage 3 (FSDP) everything:

    stage 0: (2 + 2 + K) Psi      stage 1: (2 + 2) Psi + K Psi / Nd
    stage 2: 2 Psi + (2 + K) Psi / Nd      stage 3: (2 + 2 + K) Psi / Nd

Tensor parallelism divides ``Psi`` by ``tp``; pipeline parallelism gives each device the layers of
one stage (the fullest stage counts, see :meth:`Transformer.stage_parameters`).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4-5, Table 2), in bytes per transformer layer with 16-bit activations and 1-byte dropout
masks, ``s`` sequence, ``b`` micro-batch, ``h`` width, ``a`` heads, ``t`` tensor parallel:

    no parallelism                       sbh (34 + 5as/h)
    tensor parallel                      sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel           sbh (34/t + 5as/(ht))
    tensor parallel + selective          sbh (10 + 24/t)
    tensor + sequence + selective        sbh (34/t)
    full recomputation                   2sbh  (2sbh/t with sequence parallelism)

The 24 of the split part is ``8 + 4f/h`` with FFN width ``f`` (16 of it is the MLP's GeLU input
and output at ``f = 4h``); other widths and gated MLPs scale that part. Under grouped-query
attention K and V (4 of the 24) are ``kv heads / heads`` as wide; each tensor-parallel rank holds
``1/t`` of them too, since ``t`` divides the kv heads (see :mod:`.recommend`), as it holds ``1/t``
of the narrower K/V weights counted in ``Psi``. With pipeline parallelism
the first stage holds ``p`` micro-batches of ``L/p`` layers under 1F1B, i.e. ``L`` layers' worth
whatever ``p`` is (§4.2.3); the interleaved schedule multiplies that by ``1 + (p-1)/(p v)``.
The output layer adds ``4sbh/t (1 + V/h)`` (norm, projection input, fp32 logits; §4.3) on the last
stage.

Headroom (default 15 %, the seed's 10-20 %) is memory left free for workspace, communication
buffers and fragmentation: a layout needs ``used / (1 - headroom)`` bytes of device memory.
"""

from __future__ import annotations


from pydantic import Field

from trainyard_planner._private import Model, gb
from trainyard_planner.bubble import inflight_microbatches
from trainyard_planner.layout import Layout, Recompute, Schedule, ZeroStage
from trainyard_planner.model import Transformer

DEFAULT_HEADROOM = 0.15


class BytesPerParameter(Model):
    """Bytes of training state per parameter, by kind."""

    weights: float = Field(default=2, ge=0, description="working weights (bf16)")
    gradients: float = Field(default=2, ge=0, description="gradients (bf16)")
    master_weights: float = Field(default=4, ge=0, description="fp32 master copy of the weights")
    optimizer_states: float = Field(default=8, ge=0, description="optimizer moments (Adam m and v, fp32)")

    @property
    def optimizer_total(self) -> float:
        """ZeRO's ``K``: everything the optimizer owns (master weights and moments)."""
        return self.master_weights + self.optimizer_states

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_total


MIXED_PRECISION_ADAM = BytesPerParameter()
"""The seed's table: bf16 weights 2 + bf16 gradients 2 + fp32 master 4 + Adam m 4 + v 4 = 16."""

FP32_ADAM = BytesPerParameter(weights=4, gradients=4, master_weights=0, optimizer_states=8)
"""Full fp32 training with Adam: 16 bytes, no separate master copy."""


class MemoryBreakdown(Model):
    """Memory of one device (the fullest one) under a layout; bytes unless named otherwise."""

    parameters_per_device: float
    weights_bytes_per_device: float
    gradients_bytes_per_device: float
    optimizer_bytes_per_device: float
    model_states_bytes_per_device: float
    model_states_bytes_total: float = Field(description="unsharded: parameters x bytes per parameter")
    activation_bytes_per_layer: float
    activations_bytes_per_device: float
    used_bytes_per_device: float
    headroom: float
    required_bytes_per_device: float = Field(description="used / (1 - headroom)")

    def fits(self, device_memory_bytes: float) -> bool:
        return self.required_bytes_per_device <= device_memory_bytes

    def shortfall(self, device_memory_bytes: float) -> str | None:
        """``None`` when it fits, else e.g. ``"needs 93.1 GB per device, 80 GB available"``."""
        if self.fits(device_memory_bytes):
            return None
        return f"needs {gb(self.required_bytes_per_device)} GB per device, {gb(device_memory_bytes)} GB available"


def model_states_bytes(parameters: float, bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM) -> float:
    """Weights, gradients and optimizer state of the whole model, unsharded (70B x 16 B = 1.12 TB)."""
    return parameters * bytes_per_parameter.total


def model_states_per_device(
    model: Transformer, layout: Layout, bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on the fullest device: the ZeRO stage divides by ``dp``
    what it shards, ``tp`` and the fullest pipeline stage split the parameters."""
    bpp, dp, stage = bytes_per_parameter, layout.dp, layout.zero_stage
    params = model.stage_parameters(layout.pp, layout.stage_layers(model.n_layers)) / layout.tp
    weights = bpp.weights * params / (dp if stage >= ZeroStage.PARAMETERS else 1)
    gradients = bpp.gradients * params / (dp if stage >= ZeroStage.GRADIENTS else 1)
    optimizer = bpp.optimizer_total * params / (dp if stage >= ZeroStage.OPTIMIZER else 1)
    return weights, gradients, optimizer


def activation_bytes_per_layer(
    model: Transformer,
    *,
    micro_batch: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute | str = Recompute.NONE,
    cp: int = 1,
    fused_attention: bool = False,
) -> float:
    """Activations one transformer layer keeps for its backward pass (Korthikanti Table 2); ``cp`` ranks share
    the sequence; a fused attention kernel keeps no score matrix (as selective recomputation)."""
    recompute = Recompute(recompute)
    s, b, h, a, f = model.seq_len // cp, micro_batch, model.d_model, model.n_heads, model.ffn_width
    sbh = s * b * h
    if recompute is Recompute.FULL:
        return 2 * sbh / (tp if sequence_parallel else 1)
    # GeLU: its input and output; a fused SwiGLU: its two inputs (gate and up) and the down projection's input
    mlp = (6 if model.gated_mlp else 4) * s * b * f
    # layer-norm inputs, QKV and MLP inputs, and two 1-byte dropout masks (none without dropout: Llama)
    replicated = (10 if model.dropout else 8) * sbh
    kv = 4 * sbh * model.kv_width // model.attention_width  # K and V: narrower than Q under GQA
    split = 4 * sbh + kv + mlp  # Q, K, V, projection input, MLP intermediates
    # softmax output, its dropout mask and output (the softmax output alone without dropout)
    kept_scores = 0 if recompute is Recompute.SELECTIVE or fused_attention else (5 if model.dropout else 2)
    attention = kept_scores * a * s * model.seq_len * b
    if sequence_parallel:
        return (replicated + split + attention) / tp
    return replicated + (split + attention) / tp


def activations_bytes_per_device(model: Transformer, layout: Layout) -> float:
    """Peak activations on the busiest pipeline stage (the first, or the last with its output layer)."""
    t, p = layout.tp, layout.pp
    per_layer = activation_bytes_per_layer(
        model, micro_batch=layout.micro_batch, tp=t, sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute, cp=layout.cp, fused_attention=layout.fused_attention,
    )
    # Full recomputation rebuilds one layer's activations at a time during the backward pass.
    working = 0.0
    if layout.recompute is Recompute.FULL:
        working = activation_bytes_per_layer(
            model, micro_batch=layout.micro_batch, tp=t, sequence_parallel=layout.sequence_parallel,
            cp=layout.cp, fused_attention=layout.fused_attention,
        )
    sbh = model.seq_len // layout.cp * layout.micro_batch * model.d_model
    output = 4 * sbh / t * (1 + model.vocab_size / model.d_model)
    embedding_masks = sbh / t if model.dropout else 0.0
    if p == 1:
        return model.n_layers * per_layer + working + embedding_masks + output
    counts = layout.stage_layers(model.n_layers)
    inflight = inflight_microbatches(layout.schedule, p, layout.microbatches)
    v = layout.interleaving
    scale = 1 + (p - 1) / (p * v) if v > 1 else 1.0
    # stage i holds the activations of p - i micro-batches under 1F1B (at most m; all m under GPipe)
    gpipe = layout.schedule is Schedule.GPIPE
    held = [counts[i] * (inflight if gpipe else min(layout.microbatches, p - i)) * scale for i in range(p)]
    first = held[0] * per_layer + working + embedding_masks * inflight
    middle = max(held) * per_layer + working
    last = held[-1] * per_layer + working + output
    return max(first, middle, last)


def estimate_memory(
    model: Transformer,
    layout: Layout,
    *,
    bytes_per_parameter: BytesPerParameter = MIXED_PRECISION_ADAM,
    headroom: float = DEFAULT_HEADROOM,
) -> MemoryBreakdown:
    """Model states (ZeRO stage over ``dp``, split by ``tp`` and ``pp``) plus activations, per device."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    bpp = bytes_per_parameter
    params = model.stage_parameters(layout.pp, layout.stage_layers(model.n_layers)) / layout.tp
    weights, gradients, optimizer = model_states_per_device(model, layout, bpp)
    states = weights + gradients + optimizer
    activations = activations_bytes_per_device(model, layout)
    used = states + activations
    return MemoryBreakdown(
        parameters_per_device=params,
        weights_bytes_per_device=weights,
        gradients_bytes_per_device=gradients,
        optimizer_bytes_per_device=optimizer,
        model_states_bytes_per_device=states,
        model_states_bytes_total=model_states_bytes(model.parameters, bpp),
        activation_bytes_per_layer=activation_bytes_per_layer(
            model, micro_batch=layout.micro_batch, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
            recompute=layout.recompute, cp=layout.cp, fused_attention=layout.fused_attention,
        ),
        activations_bytes_per_device=activations,
        used_bytes_per_device=used,
        headroom=headroom,
        required_bytes_per_device=used / (1 - headroom),
    )
