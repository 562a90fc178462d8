"""A plain-PyTorch GPT trained on trainyard through the rank SDK (``import trainyard``).

On trainyard:  trainyard submit examples/gpt-sdk/spec.yaml --code examples/gpt-sdk
On a laptop:   TRAINYARD_LOCAL=1 TRAINYARD_ARTIFACT_ROOT=<dir with datasets/tinycorpus/v1> python train.py

Everything trainyard-specific is the ``run``: where this rank is, the job's data, restore,
metrics, checkpoints and stop requests. The rest is ordinary PyTorch (DDP over the job's
process group when there is more than one rank).
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import trainyard

#: seconds each step sleeps (default none): a sweep's test stands a slower model in with it
PAUSE_S = float(os.environ.get("EXAMPLE_STEP_PAUSE_SECONDS", "0"))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, n_layers: int, n_heads: int, d_model: int, max_seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        """GPT-2's initialisation: small normal weights, so the first loss is about ln(vocabulary)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def learning_rate(step: int, *, peak: float, warmup: int, max_steps: int) -> float:
    """Linear warm-up, then cosine to 10% of the peak (a function of the step: nothing to checkpoint)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    with trainyard.init() as run:
        cfg, t = run.model_config, run.spec.training
        torch.manual_seed(t.seed)  # the same initial weights on every rank
        model = GPT(run.dataset().tokenizer.vocab_size, cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.max_seq_len,
                    cfg.dropout).to(run.device)
        ddp = DistributedDataParallel(model) if run.world_size > 1 else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, betas=(0.9, 0.95),
                                      weight_decay=t.optimizer.weight_decay)
        loader = run.data_loader()
        state = {"model": trainyard.ModelState(model), "optimizer": trainyard.OptimizerState(model, optimizer),
                 "loader": loader}
        step = run.restore(state)  # 0, or the step of the checkpoint this attempt resumes from

        model.train()
        while step < run.max_steps:
            with run.timing.data():
                micro_batches = next(loader)
            lr = learning_rate(step, peak=t.learning_rate, warmup=t.lr_schedule.warmup_steps, max_steps=run.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with run.timing.compute():
                loss_sum = torch.zeros((), device=run.device)
                for k, (inputs, targets) in enumerate(micro_batches):
                    last = k == len(micro_batches) - 1
                    with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                        loss = (ddp or model)(inputs, targets)  # DDP all-reduces in the last backward
                        (loss / len(micro_batches)).backward()
                    loss_sum += loss.detach()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
                optimizer.step()  # waits, if it must, for an asynchronous checkpoint's copy of the state
                optimizer.zero_grad(set_to_none=True)
            with run.timing.collective():
                mean_loss = loss_sum / len(micro_batches)
                if run.world_size > 1:
                    dist.all_reduce(mean_loss)  # gloo has no AVG
                    mean_loss /= run.world_size
            if PAUSE_S:
                time.sleep(PAUSE_S)
            step += 1
            run.report(step, loss=mean_loss.item(), lr=lr, grad_norm=grad_norm.item())
            run.checkpoint(step, state)  # every step on every rank: the policy and stop requests decide
            if run.should_stop():  # paused or preempted at this step, and it is saved: exit 7, resume later
                break


if __name__ == "__main__":
    main()
