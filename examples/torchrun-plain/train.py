"""A plain torchrun-style script: no trainyard SDK, only the standard torch.distributed environment.

trainyard starts one copy per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set,
exactly as ``torchrun`` would, so ``init_process_group("env://")`` just works. What the platform gives
such a script: a topology-aware gang, the rendezvous, per-rank logs, failure classification and a
restart of the whole gang after a failure. What it cannot give without the SDK: checkpoints it
verifies, resume from them (a new attempt starts this script **from scratch**), pause/preemption at
a step, per-step metrics, straggler detection and goodput.

Run it anywhere torchrun runs:  torchrun --nproc-per-node 2 train.py --steps 50
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)

    # y = 3x - 1 with noise: small enough to train in seconds on CPU
    model = DistributedDataParallel(torch.nn.Linear(1, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 1, generator=generator)
        y = 3 * x - 1 + 0.01 * torch.randn(64, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step}/{args.steps} loss {loss.item():.5f}", flush=True)
    if rank == 0:
        weight, bias = model.module.weight.item(), model.module.bias.item()
        print(f"done: y = {weight:.3f}x {bias:+.3f} across {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
