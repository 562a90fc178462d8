"""The model catalog: named, versioned decoder-only configurations (`name@version`).

Pure data, no torch: the API validates references against it and the trainer builds
the network from it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


Architecture = Literal["gpt2", "llama"]

# Fixed constants of the llama architecture (the Llama 2 / TinyLlama values); an export writes
# them into the Hugging Face config as ``rms_norm_eps`` and ``rope_theta``.
LLAMA_RMS_NORM_EPS = 1e-5
LLAMA_ROPE_THETA = 10_000.0


class ModelConfig(BaseModel):
    """A decoder-only, pre-norm transformer of one of two architectures.

    ``gpt2`` (the default): LayerNorm, learned positions, GELU MLP, biases, tied embeddings.
    ``llama``: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention (``nKvHeads``),
    no biases, an untied output head.

    ``architecture`` and ``nKvHeads`` are left out of the wire form when they are not set (or
    ``architecture`` is the default ``gpt2``), so every spec written before they existed keeps
    its hash.
    """

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, extra="forbid"
    )

    vocab_size: int = Field(gt=0, le=1_000_000)
    n_layers: int = Field(gt=0, le=512)
    n_heads: int = Field(gt=0, le=512)
    d_model: int = Field(gt=0, le=65_536)
    d_ff: int | None = Field(default=None, gt=0, description="FFN width; 4*d_model when omitted")
    max_seq_len: int = Field(gt=0, le=1_048_576)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    architecture: Architecture = Field(
        default="gpt2", exclude_if=lambda v: v == "gpt2",
        description="gpt2 (default) or llama",
    )
    n_kv_heads: int | None = Field(
        default=None, gt=0, le=512, exclude_if=lambda v: v is None,
        description="llama only: key/value heads for grouped-query attention (divides nHeads); nHeads when omitted",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"dModel ({self.d_model}) must be divisible by nHeads ({self.n_heads})"
            )
        if self.n_kv_heads is not None:
            if self.architecture != "llama":
                raise ValueError(
                    "nKvHeads applies only to architecture 'llama'; remove it or set architecture: llama"
                )
            if self.n_heads % self.n_kv_heads:
                raise ValueError(
                    f"nHeads ({self.n_heads}) must be divisible by nKvHeads ({self.n_kv_heads})"
                )
        if self.architecture == "llama" and (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"dModel / nHeads (the head width, {self.d_model // self.n_heads}) must be even for "
                "architecture 'llama' (rotary positions rotate pairs of dimensions)"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``nKvHeads`` for llama when set, else ``nHeads``."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_width(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def num_parameters(self) -> int:
        """Exact parameter count of the trainer's network of this architecture."""
        d, f, v, s = self.d_model, self.ffn_width, self.vocab_size, self.max_seq_len
        if self.architecture == "llama":
            kv = self.kv_heads * self.head_dim
            llama_layer = (
                d  # input_layernorm (RMSNorm weight)
                + 2 * d * d + 2 * d * kv  # q, o and k, v projections
                + d  # post_attention_layernorm
                + 3 * d * f  # gate, up, down
            )
            return 2 * v * d + self.n_layers * llama_layer + d  # embedding, untied head, final norm
        per_layer = (
            2 * d  # ln1
            + 3 * d * d + 3 * d  # qkv
            + d * d + d  # attention out
            + 2 * d  # ln2
            + d * f + f  # fc in
            + f * d + d  # fc out
        )
        return v * d + s * d + self.n_layers * per_layer + 2 * d  # + final ln


MODEL_CATALOG: dict[str, ModelConfig] = {
    # ~0.2M parameters: a 2-rank job of a few dozen steps runs in about a minute on 2 CPU cores.
    "gpt-tiny@v1": ModelConfig(
        vocab_size=1024, n_layers=2, n_heads=4, d_model=64, max_seq_len=128
    ),
    # ~11M parameters: a laptop-sized model for longer CPU runs.
    "gpt-small@v1": ModelConfig(
        vocab_size=1024, n_layers=6, n_heads=8, d_model=384, max_seq_len=256
    ),
    # GPT-2 small shape (124M with a GPT-2 vocabulary).
    "gpt2-124m@v1": ModelConfig(
        vocab_size=50304, n_layers=12, n_heads=12, d_model=768, max_seq_len=1024
    ),
    # ~1.3B parameters: the single-GPU MFU benchmark model.
    "gpt-1b@v1": ModelConfig(
        vocab_size=50304, n_layers=24, n_heads=16, d_model=2048, max_seq_len=2048
    ),
    # ~0.2M parameters, the llama counterpart of gpt-tiny for CPU tests (GQA: 2 kv heads of 4).
    "llama-tiny@v1": ModelConfig(
        architecture="llama", vocab_size=1024, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
        d_ff=176, max_seq_len=128,
    ),
    # 124.7M parameters with a 32k vocabulary: a 125M-class llama (12 x 768, SwiGLU 2048, GQA 4).
    "llama-125m@v1": ModelConfig(
        architecture="llama", vocab_size=32000, n_layers=12, n_heads=12, n_kv_heads=4,
        d_model=768, d_ff=2048, max_seq_len=2048,
    ),
    # TinyLlama 1.1B's shape (22 x 2048, 32 heads, 4 kv heads, SwiGLU 5632): 1,100,048,384.
    "llama-1b@v1": ModelConfig(
        architecture="llama", vocab_size=32000, n_layers=22, n_heads=32, n_kv_heads=4,
        d_model=2048, d_ff=5632, max_seq_len=2048,
    ),
}


def resolve_model(ref: str) -> ModelConfig:
    """Look up ``name@version``; raises KeyError naming the known entries."""
    try:
        return MODEL_CATALOG[ref]
    except KeyError:
        known = ", ".join(sorted(MODEL_CATALOG))
        raise KeyError(f"unknown model {ref!r}; the catalog has: {known}") from None
