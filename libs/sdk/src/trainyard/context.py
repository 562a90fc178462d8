"""The small CPU-side collectives every rank of a job makes together (agreement, barriers, gathers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainyard.runtime import new_cpu_group

__all__ = ["Agreement", "Context", "open_context"]


class Agreement:
    """An all-reduce in flight; :meth:`result` waits for it (at once in a world of one)."""

    def __init__(self, values: Any, work: Any = None) -> None:
        self._values = values
        self._work = work

    def result(self) -> list[int]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        values = self._values
        return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


@dataclass
class Context:
    """Collectives the SDK needs beyond the model's: a CPU control group and its helpers.

    Every method is a collective: every rank calls it at the same point, in the same order.
    In a world of one they return at once without touching ``torch.distributed``.
    """

    rank: int
    world_size: int
    control: Any = None  # gloo group for the main thread's small agreements (None in a world of one)
    background: Any = None  # gloo group of background checkpoint writes: a group per thread
    mesh: Any = None  # the trainer's device mesh, when it builds one

    def barrier(self) -> None:
        if self.control is not None:
            dist.barrier(group=self.control)

    def agree(self, values: list[int]) -> list[int]:
        """Element-wise sum of ``values`` over all ranks."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def agree_max_later(self, values: list[int]) -> Agreement:
        """Element-wise maximum of ``values`` over all ranks (any rank's "yes" is everyone's), started now and
        collected later (:meth:`Agreement.result`): the small all-reduce runs on gloo's thread while the caller
        goes on (the step boundary's agreement)."""
        if self.world_size == 1:
            return Agreement(list(values))
        tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control, async_op=True)
        return Agreement(tensor, work)

    def _all_reduce(self, values: list[int], op: Any) -> list[int]:
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=op, group=self.control)
        return [int(v) for v in tensor.tolist()]

    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out


def open_context(rank: int, world_size: int) -> Context:
    """The context of an initialised process group (two gloo groups), or a world of one without one."""
    if not dist.is_initialized():
        return Context(rank=0, world_size=1)
    return Context(rank=rank, world_size=world_size, control=new_cpu_group(), background=new_cpu_group())
