"""The shape of a decoder-only transformer and its exact parameter count.

The planner needs the shape, not just the parameter count: activations grow with sequence
length, width and heads, and tensor / pipeline parallelism split layers and heads. When only a
parameter count is known (``trainyard plan memory --params 70e9``), :meth:`Transformer.from_parameters`
picks a plausible shape and keeps the declared count for the model-state arithmetic.
"""

from __future__ import annotations

import math
from typing import Protocol

from pydantic import Field, model_validator

from trainyard_planner._private import Model

# Widths of published models (GPT-3, Llama, Megatron); a shape derived from a parameter count
# uses one of them so that heads and tensor-parallel degrees divide evenly.
_WIDTHS = (256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 10240, 12288,
           16384, 20480, 25600, 32768)
_HEAD_DIM = 128
_ASPECT = 128  # width / depth of GPT-3 6.7B..175B


class ModelConfigLike(Protocol):
    """What :meth:`Transformer.from_model_config` reads (``trainyard_contract.catalog.ModelConfig``), read-only:
    the catalog's models are frozen."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def architecture(self) -> str: ...
    @property
    def n_kv_heads(self) -> int | None: ...
    @property
    def ffn_width(self) -> int: ...


class CatalogModelLike(ModelConfigLike, Protocol):
    """What :func:`transformer_for` reads: a model config that also knows its exact parameter count."""

    @property
    def num_parameters(self) -> int: ...


class Transformer(Model):
    """A decoder-only transformer: pre-norm blocks of attention and MLP, embeddings, final norm.

    The defaults describe the trainer's GPT-2 style network (LayerNorm with bias, biases in the
    linears, learned positions, output head tied to the input embedding), so that
    :attr:`exact_parameters` equals ``trainyard_contract.catalog.ModelConfig.num_parameters``.
    """

    n_layers: int = Field(gt=0)
    d_model: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    d_ff: int | None = Field(default=None, gt=0, description="FFN width; 4*d_model when omitted")
    d_head: int | None = Field(default=None, gt=0, description="width of one head; dModel / nHeads when omitted")
    vocab_size: int = Field(gt=0)
    seq_len: int = Field(gt=0, description="training sequence length in tokens")
    tied_embeddings: bool = True
    learned_positions: bool = True
    biases: bool = True
    gated_mlp: bool = Field(default=False, description="SwiGLU-style MLP with three matrices")
    n_kv_heads: int | None = Field(
        default=None, gt=0, description="key/value heads (grouped-query attention); nHeads when omitted",
    )
    declared_parameters: int | None = Field(
        default=None, gt=0,
        description="a parameter count given by the user; used for model states instead of the shape's",
    )
    dropout: bool = Field(default=True, description="dropout after attention and the MLP (its masks are kept "
                                                    "for the backward); Llama has none")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> Transformer:
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(f"dModel ({self.d_model}) must be divisible by nHeads ({self.n_heads})")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"nHeads ({self.n_heads}) must be divisible by nKvHeads ({self.n_kv_heads})")
        return self

    @property
    def ffn_width(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def attention_width(self) -> int:
        """``H x Q``: heads times head width (``d_model`` unless ``d_head`` says otherwise)."""
        return self.n_heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads`` under grouped-query attention, else one per query head."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: kv heads times head width."""
        return self.kv_heads * self.head_dim

    @property
    def parameters_per_layer(self) -> int:
        h, f, q, kv, bias = self.d_model, self.ffn_width, self.attention_width, self.kv_width, int(self.biases)
        norms = 2 * (h + bias * h)
        attention = 2 * h * q + 2 * h * kv + bias * (q + 2 * kv + h)  # q and out, k and v
        matrices = 3 if self.gated_mlp else 2
        mlp = matrices * h * f + bias * ((matrices - 1) * f + h)
        return norms + attention + mlp

    @property
    def input_embedding_parameters(self) -> int:
        positions = self.seq_len * self.d_model if self.learned_positions else 0
        return self.vocab_size * self.d_model + positions

    @property
    def output_parameters(self) -> int:
        """Final norm, plus the output projection when it is not tied to the input embedding."""
        final_norm = self.d_model * (1 + int(self.biases))
        head = 0 if self.tied_embeddings else self.vocab_size * self.d_model
        return final_norm + head

    @property
    def exact_parameters(self) -> int:
        """The parameter count of this shape, every weight and bias counted once."""
        return (self.input_embedding_parameters + self.n_layers * self.parameters_per_layer
                + self.output_parameters)

    @property
    def parameters(self) -> int:
        """The count used for model states: the declared one when given, else the exact one."""
        return self.declared_parameters or self.exact_parameters

    def stage_parameters(self, pipeline: int, layers: tuple[int, ...] | None = None) -> float:
        """Parameters held by the fullest of ``pipeline`` stages (before tensor parallelism).

        Layers are split as evenly as possible; the first stage also holds the input embedding and
        the last the final norm and output head. With tied embeddings and more than one stage the
        last stage keeps its own copy of the embedding matrix for the head, as Megatron-LM does.
        Scaled to :attr:`parameters` when a count was declared.
        """
        if pipeline == 1:
            return float(self.parameters)
        counts = layers or (math.ceil(self.n_layers / pipeline),) * pipeline
        per = self.parameters_per_layer
        head = self.output_parameters + (self.vocab_size * self.d_model if self.tied_embeddings else 0)
        fullest = max(counts[0] * per + self.input_embedding_parameters, counts[-1] * per + head,
                      max(counts) * per)
        return fullest * self.parameters / self.exact_parameters

    @classmethod
    def from_model_config(cls, config: ModelConfigLike, *, seq_len: int | None = None) -> Transformer:
        """The shape of a catalog model; ``seq_len`` defaults to its maximum sequence length.

        ``llama``: RMSNorm and linears without biases, rotary (not learned) positions, SwiGLU,
        an untied head, and ``nKvHeads`` key/value heads.
        """
        llama = config.architecture == "llama"
        return cls(
            n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
            d_ff=config.ffn_width, vocab_size=config.vocab_size,
            seq_len=seq_len or config.max_seq_len,
            tied_embeddings=not llama, learned_positions=not llama, biases=not llama, gated_mlp=llama,
            n_kv_heads=config.n_kv_heads if llama else None, dropout=not llama,
        )

    @classmethod
    def from_parameters(cls, parameters: float, *, seq_len: int = 2048, vocab_size: int = 32_000) -> Transformer:
        """A plausible GPT shape for a parameter count, keeping the count itself for model states.

        The width is the published width whose depth ``N / 12h^2`` (each block holds about
        ``12h^2`` parameters) gives a width/depth ratio closest to GPT-3's 128; heads are 128 wide.
        """
        n = int(parameters)
        if n <= 0:
            raise ValueError(f"parameters must be positive, got {parameters}")

        def depth(width: int) -> int:
            return max(1, round((n - vocab_size * width) / (12 * width * width)))

        width = min(_WIDTHS, key=lambda w: abs(math.log(w / (depth(w) * _ASPECT))))
        return cls(
            n_layers=depth(width), d_model=width, n_heads=max(1, width // _HEAD_DIM),
            vocab_size=vocab_size, seq_len=seq_len, declared_parameters=n,
        )


def transformer_for(config: CatalogModelLike, seq_len: int | None = None) -> Transformer:
    """The planner's shape of a catalog or inline model, keeping its exact parameter count
    (learned positions count ``maxSeqLen`` rows even when a job trains on shorter sequences)."""
    shape = Transformer.from_model_config(config, seq_len=seq_len)
    return shape.model_copy(update={"declared_parameters": config.num_parameters})
