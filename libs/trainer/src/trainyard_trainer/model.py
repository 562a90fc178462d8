"""A decoder-only GPT (GPT-2 shape): pre-norm blocks, causal scaled-dot-product attention,
GELU MLP, learned positions, tied input/output embeddings.

The parameter count equals ``ModelConfig.num_parameters`` exactly (the tests hold it to
that). Parallelism is applied from outside (:mod:`trainyard_trainer.parallel`), never here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainyard_common.catalog import ModelConfig


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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def build_model(config: ModelConfig, *, seed: int, device: torch.device) -> GPT:
    """The GPT of ``config``, initialised from ``seed`` (identical on every rank)."""
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    model = GPT(config)
    torch.set_rng_state(generator_state)
    return model.to(device)
