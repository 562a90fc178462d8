"""The decoder-only networks of the catalog's two architectures.

``gpt2`` (:class:`GPT`): pre-norm blocks, causal scaled-dot-product attention, GELU MLP, learned
positions, tied input/output embeddings.

``llama`` (:class:`Llama`): RMSNorm, rotary position embeddings in the Hugging Face
``transformers`` convention (``rotate_half`` over the two halves of each head), SwiGLU MLP,
grouped-query attention, no biases, an untied output head. Its parameter names map 1:1 onto
``LlamaForCausalLM``'s (:func:`hf_llama_name`).

Parameter counts equal ``ModelConfig.num_parameters`` exactly (the tests hold them to that).
Parallelism is applied from outside (:mod:`trainyard_trainer.parallel`), never here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainyard_contract.catalog import LLAMA_RMS_NORM_EPS, LLAMA_ROPE_THETA, ModelConfig


class CausalSelfAttention(nn.Module):
    """Causal self-attention with a fused, head-major QKV projection.

    ``qkv``'s output rows are laid out head by head (``[q_0 k_0 v_0 | q_1 k_1 v_1 | …]``), so a
    column-wise tensor-parallel split of ``qkv`` hands each rank whole heads, and the number of
    heads a rank computes is read from the width it actually holds (``n_heads / tp`` under TP).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.d_model // config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # local heads under tensor parallelism
        q, k, v = qkv.view(batch, seq, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ffn_width)
        self.proj = nn.Linear(config.ffn_width, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.architecture != "gpt2":
            raise ValueError(f"GPT builds architecture 'gpt2', not {config.architecture!r}; use build_model")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.out", "mlp.proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, seq, vocab)`` and, given targets, the mean token cross-entropy."""
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds maxSeqLen {self.config.max_seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output embedding, no bias
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 as ``LlamaRMSNorm`` does."""

    def __init__(self, width: int, eps: float = LLAMA_RMS_NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension's halves (the transformers convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_tables(seq: int, head_dim: int, *, device: torch.device, dtype: torch.dtype,
                  theta: float = LLAMA_ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of shape ``(seq, head_dim)``: frequencies ``theta^(-2i/d)`` repeated
    over both halves, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(seq, dtype=torch.float, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with rotary positions: ``n_heads`` query heads share
    ``n_kv_heads`` key/value heads, ``n_heads / n_kv_heads`` each. Separate ``q/k/v/o`` projections
    without biases, named as ``LlamaAttention``'s. Head counts are read from the widths the
    projections actually hold."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        d, kv = config.d_model, config.kv_heads * config.head_dim
        self.q_proj = nn.Linear(d, config.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(config.n_heads * self.head_dim, d, bias=False)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # each kv head serves `groups` consecutive query heads, as repeat_kv does
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases (``LlamaMLP``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_width, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_width, bias=False)
        self.down_proj = nn.Linear(config.ffn_width, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model)
        self.mlp = SwiGLU(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class Llama(nn.Module):
    """The ``llama`` architecture. ``blocks`` (like :class:`GPT`'s) holds the layers; see
    :func:`hf_llama_name` for the mapping onto ``LlamaForCausalLM``'s parameter names."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.architecture != "llama":
            raise ValueError(f"Llama builds architecture 'llama', not {config.architecture!r}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) for embeddings and projections, residual projections (``o_proj``,
        ``down_proj``) scaled by 1/sqrt(2 * layers) as in GPT-2; norms at one."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("o_proj", "down_proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(batch, seq, vocab)`` and, given targets, the mean token cross-entropy."""
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds maxSeqLen {self.config.max_seq_len}")
        x = self.drop(self.embed_tokens(idx))
        cos, sin = rotary_tables(seq, self.config.head_dim, device=idx.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def hf_llama_name(name: str) -> str:
    """A :class:`Llama` parameter name as ``LlamaForCausalLM`` spells it
    (``blocks.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name.startswith("lm_head."):
        return name
    if name.startswith("blocks."):
        return "model.layers." + name[len("blocks."):]
    return "model." + name


def model_class(config: ModelConfig) -> type[GPT | Llama]:
    """The network class of ``config``'s architecture."""
    return Llama if config.architecture == "llama" else GPT


def build_model(config: ModelConfig, *, seed: int, device: torch.device) -> GPT | Llama:
    """The network of ``config``'s architecture, initialised from ``seed`` (identical on every rank)."""
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    model = model_class(config)(config)
    torch.set_rng_state(generator_state)
    return model.to(device)
