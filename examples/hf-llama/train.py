"""A Hugging Face ``transformers`` Llama trained on trainyard: FSDP2 over its decoder layers, the job's
dataset through the SDK's resumable loader, verified checkpoints, pause/preempt and bitwise resume.

On trainyard:  trainyard submit examples/hf-llama/spec.yaml --code examples/hf-llama
On a laptop:   TRAINYARD_LOCAL=1 TRAINYARD_ARTIFACT_ROOT=<dir with datasets/tinycorpus/v1> python train.py

The model is built from a small ``LlamaConfig`` (nothing is downloaded); its sizes come from the
spec's ``modelConfig`` so one spec field changes the model. Save it for ``from_pretrained`` with
``model.save_pretrained`` from a READY checkpoint (docs/sdk.md).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import trainyard


def build_llama(run: trainyard.Run) -> LlamaForCausalLM:
    """A Llama the size the spec's modelConfig says, initialised from the spec's seed (same on every rank)."""
    cfg = run.model_config
    config = LlamaConfig(
        vocab_size=run.dataset().tokenizer.vocab_size, hidden_size=cfg.d_model, intermediate_size=4 * cfg.d_model,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=max(1, cfg.n_heads // 2),
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False, attention_dropout=0.0,
    )
    config._attn_implementation = "eager"  # deterministic on CPU; use "sdpa" or "flash_attention_2" on GPUs
    torch.manual_seed(run.spec.training.seed)
    return LlamaForCausalLM(config).to(run.device)


def shard(model: LlamaForCausalLM, run: trainyard.Run) -> LlamaForCausalLM:
    """FSDP2: each decoder layer is its own unit (gathered just in time), the embeddings and head in the root."""
    if run.world_size == 1:
        return model
    mesh = init_device_mesh(run.device.type, (run.world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def learning_rate(step: int, *, peak: float, warmup: int, max_steps: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, max_steps - warmup)))


def main() -> None:
    with trainyard.init() as run:
        t = run.spec.training
        model = shard(build_llama(run), run)
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.optimizer.weight_decay)
        loader = run.data_loader()
        state = {"model": trainyard.ModelState(model), "optimizer": trainyard.OptimizerState(model, optimizer),
                 "loader": loader}
        step = run.restore(state)

        model.train()
        while step < run.max_steps:
            with run.timing.data():
                micro_batches = next(loader)
            lr = learning_rate(step, peak=t.learning_rate, warmup=t.lr_schedule.warmup_steps, max_steps=run.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with run.timing.compute():
                total = torch.zeros((), device=run.device)
                for k, (inputs, targets) in enumerate(micro_batches):
                    if run.world_size > 1:  # reduce-scatter the gradients in the last micro-batch's backward only
                        model.set_requires_gradient_sync(k == len(micro_batches) - 1)
                    logits = model(input_ids=inputs).logits
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
                    (loss / len(micro_batches)).backward()
                    total += loss.detach()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            with run.timing.collective():
                mean = total / len(micro_batches)
                if run.world_size > 1:
                    dist.all_reduce(mean)
                    mean /= run.world_size
            step += 1
            grad_norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            run.report(step, loss=mean.item(), lr=lr, grad_norm=grad_norm.item())
            run.checkpoint(step, state)
            if run.should_stop():
                break


if __name__ == "__main__":
    main()
