"""A fault-tolerant data-parallel job on trainyard: each rank is one replica, joined to the others per step by
torchft through ``run.replicas`` (``spec.faultTolerance``).

On trainyard:  trainyard submit examples/fault-tolerant/spec.yaml --code examples/fault-tolerant

When a replica fails the others keep stepping; the platform starts the failed rank again, it heals from a healthy
peer (weights, optimizer, data position, step) and rejoins the quorum. Only replica 0 writes checkpoints; a new
attempt (fewer than ``minReplicas`` left) resumes every replica from the latest READY one.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import trainyard


class ContextMLP(nn.Module):
    """Next-token prediction from the mean embedding of the tokens so far, through a small MLP."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(2 * width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        context = x.cumsum(dim=1) / torch.arange(1, idx.shape[1] + 1, device=idx.device).view(1, -1, 1)
        logits = self.head(self.mlp(torch.cat([x, context], dim=-1)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


#: Seconds to wait after each step, to stand for a longer step (the tests give the model a realistic step time
#: this way, so that a replaced replica can rejoin before the others finish); 0 by default.
PAUSE_S = float(os.environ.get("EXAMPLE_STEP_PAUSE_SECONDS", "0"))


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter's bytes: equal on replicas that hold bitwise-equal weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def held_out_loss(run: trainyard.Run, model: nn.Module, batches: int = 8) -> float:
    """The loss on the same batches for every run of this spec: data far past what training reads."""
    loader = run.data_loader(dp=1, dp_rank=0)
    loader.load_state_dict({**loader.state_dict(), "position": 10_000_000 * run.spec.training.global_batch_size})
    model.eval()
    losses = [float(model(inputs, targets)) for _ in range(batches) for inputs, targets in next(loader)]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    with trainyard.init() as run:
        t = run.spec.training
        torch.manual_seed(t.seed)  # the same initial weights on every replica
        model = ContextMLP(run.dataset().tokenizer.vocab_size, 64).to(run.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=0.0)
        state = {"model": trainyard.ModelState(model), "optimizer": trainyard.OptimizerState(model, optimizer)}
        run.restore(state)  # a new attempt: the latest READY checkpoint; a replaced replica heals instead
        replicas = run.replicas(model, optimizer)

        model.train()
        while replicas.step < run.max_steps:
            replicas.optimizer.zero_grad()  # this step's quorum
            loss_sum, batches = 0.0, replicas.batch()
            for inputs, targets in batches:
                loss = replicas.model(inputs, targets)
                (loss * replicas.scale).backward()
                loss_sum += loss.item()
            if not replicas.commit():  # a replica failed during the step: the quorum runs it again
                continue
            step = replicas.step
            run.report(step, loss=loss_sum / len(batches), at=time.time(), **replicas.metrics())
            run.checkpoint(step, state)  # replica 0 writes the job's checkpoints
            if run.should_stop():
                break
            time.sleep(PAUSE_S)
        print(f"final weights sha256 {weights_digest(model)} at step {replicas.step}", flush=True)
        print(f"final held-out loss {held_out_loss(run, model):.6f}", flush=True)


if __name__ == "__main__":
    main()
