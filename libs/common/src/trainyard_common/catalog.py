"""The model catalog: named, versioned GPT configurations (`name@version`).

Pure data, no torch: the API validates references against it and the trainer builds
the network from it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class ModelConfig(BaseModel):
    """A decoder-only transformer (GPT-2 style, pre-norm, tied embeddings)."""

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

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"dModel ({self.d_model}) must be divisible by nHeads ({self.n_heads})"
            )
        return self

    @property
    def ffn_width(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def num_parameters(self) -> int:
        """Exact parameter count of the trainer's GPT (tied embeddings, biases in linears)."""
        d, f, v, s = self.d_model, self.ffn_width, self.vocab_size, self.max_seq_len
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
}


def resolve_model(ref: str) -> ModelConfig:
    """Look up ``name@version``; raises KeyError naming the known entries."""
    try:
        return MODEL_CATALOG[ref]
    except KeyError:
        known = ", ".join(sorted(MODEL_CATALOG))
        raise KeyError(f"unknown model {ref!r}; the catalog has: {known}") from None
