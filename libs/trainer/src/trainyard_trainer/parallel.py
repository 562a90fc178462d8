"""Parallelism applied to a model from outside (torchtitan style): ``apply_ddp(model, …)``.

FSDP and tensor parallelism will join here as ``apply_fsdp(model, mesh)`` / ``apply_tp``;
the model class never knows how it is sharded.
"""

# No ``from __future__ import annotations`` here: DDP checks the comm hook's annotations
# against the real classes (``dist.GradBucket``), not their string forms.
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


class CollectiveTimer:
    """Measures how long a backward pass waits on the gradient all-reduce.

    DDP overlaps bucket all-reduces with the backward computation; the bucket holding the
    first layers is launched last, when their gradients are ready, i.e. when the local
    computation is over. ``exposed_seconds(backward_end)`` is the time from that last
    launch until ``backward()`` returned: communication the computation did not hide.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.last_launch: float | None = None

    def reset(self) -> None:
        self.last_launch = None

    def exposed_seconds(self, backward_end: float) -> float:
        return 0.0 if self.last_launch is None else max(0.0, backward_end - self.last_launch)


def _timed_allreduce(timer: CollectiveTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    timer.last_launch = time.perf_counter()
    # The stock hook: divide by the world size, then all-reduce(SUM); the same arithmetic
    # as DDP's built-in path, so results do not depend on whether the timer is installed.
    return default_hooks.allreduce_hook(timer.process_group, bucket)


def apply_ddp(
    model: torch.nn.Module,
    *,
    device: torch.device,
    timer: CollectiveTimer | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over ``process_group`` (default: the world); parameters are
    broadcast from rank 0 and gradients averaged across ranks in each synchronising backward."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
    )
    if timer is not None:
        ddp.register_comm_hook(timer, _timed_allreduce)
    return ddp
