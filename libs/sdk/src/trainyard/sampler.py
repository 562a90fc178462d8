"""Which samples each rank reads at each step, independent of how many ranks there are.

The data order of a job is one global sequence of *positions* 0, 1, 2, …. Position ``p``
is sample ``perm_e[p mod N]`` of epoch ``e = p div N``, where ``N`` is the number of
samples in the dataset and ``perm_e`` is a permutation of ``0..N-1`` drawn from
``numpy.random.default_rng(seed + e)`` (PCG64). Re-permuting per epoch keeps
epochs from repeating one order.

An optimizer step consumes ``global_batch`` consecutive positions starting at ``g``
(``g = global_step * global_batch`` for a run that started at step 0). The rule that maps
them onto micro steps, data-parallel ranks and rows::

    position(k, r, i) = g + (k * dp + r) * micro_batch + i

    k: micro step (0 .. grad_accumulation-1), r: dp rank (0 .. dp-1), i: row (0 .. micro_batch-1)

So every optimizer step sees exactly the positions ``g .. g + global_batch - 1`` whatever
``dp`` and ``grad_accumulation`` are (``micro_batch * dp * grad_accumulation =
global_batch``), ranks read disjoint rows, and the only state is the global position
``g``: the sampler state is global, not per rank, which is what lets a job resume on a
different number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainyard_contract.errors import ConfigError, DataError


def sample_position(start: int, micro_step: int, dp_rank: int, row: int, *, micro_batch: int, dp: int) -> int:
    """Global position of row ``row`` of micro step ``micro_step`` on dp rank ``dp_rank``."""
    return start + (micro_step * dp + dp_rank) * micro_batch + row


def micro_batch_positions(start: int, micro_step: int, dp_rank: int, *, micro_batch: int, dp: int) -> range:
    first = sample_position(start, micro_step, dp_rank, 0, micro_batch=micro_batch, dp=dp)
    return range(first, first + micro_batch)


def micro_batch_seed(seed: int, position: int) -> int:
    """The RNG seed of the micro batch whose first row is global position ``position``.

    Dropout draws from a generator reseeded per micro batch from the data, not from the rank:
    a micro batch holds the same rows whatever the number of ranks (``micro_batch`` is fixed), so
    its dropout masks are too, and a resume on a different DP size, TP peers (which must agree
    on the masks of replicated activations) and recomputed checkpointed activations all see the
    same randomness.
    """
    return (seed * 0x9E3779B1 + position) % (2**63 - 1)


@dataclass(frozen=True)
class BatchLayout:
    """``global batch = micro batch x data-parallel size x gradient accumulation``, for one attempt."""

    global_batch: int
    micro_batch: int
    dp: int
    spec_dp: int
    sequence_length: int

    @property
    def grad_accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.sequence_length

    def statement(self) -> str:
        """What this attempt runs, in words; says so when the DP size is not the spec's."""
        text = (f"micro batch {self.micro_batch} x data-parallel {self.dp} x gradient accumulation "
                f"{self.grad_accumulation} = global batch {self.global_batch} sequences "
                f"({self.tokens_per_step} tokens per optimizer step)")
        if self.dp != self.spec_dp:
            spec_accumulation = self.global_batch // (self.micro_batch * self.spec_dp)
            text += (f"; the spec asked for parallelism.data {self.spec_dp} (accumulation {spec_accumulation}): "
                     f"this attempt runs data-parallel {self.dp} with accumulation {self.grad_accumulation}, so the "
                     "global batch, the data order and the optimisation semantics are the same")
        return text


def batch_layout(*, global_batch: int, micro_batch: int, dp: int, spec_dp: int, sequence_length: int) -> BatchLayout:
    """The layout for ``dp`` ranks; ConfigError spelling out the numbers when it does not divide."""
    if global_batch % (micro_batch * dp):
        raise ConfigError(
            f"training.globalBatchSize {global_batch} is not a multiple of microBatchSize {micro_batch} x "
            f"data-parallel size {dp} = {micro_batch * dp}: this attempt cannot keep the spec's global batch"
        )
    return BatchLayout(global_batch=global_batch, micro_batch=micro_batch, dp=dp, spec_dp=spec_dp,
                       sequence_length=sequence_length)


class SampleOrder:
    """Maps global positions to sample ids: a seeded permutation per epoch."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples <= 0:
            raise DataError("a dataset needs at least one sample")
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            self._epoch = epoch
        return self._perm

    def sample_id(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        return int(self.permutation(epoch)[offset])


class GlobalSampler:
    """The data position of the whole job; ``Stateful`` for torch.distributed.checkpoint."""

    def __init__(
        self, num_samples: int, *, seed: int, global_batch: int, micro_batch: int, dp: int, dp_rank: int
    ) -> None:
        if global_batch % (micro_batch * dp):
            raise DataError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x dp {dp}")
        if not 0 <= dp_rank < dp:
            raise DataError(f"dp rank {dp_rank} out of range 0..{dp - 1}")
        self.order = SampleOrder(num_samples, seed)
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp = dp
        self.dp_rank = dp_rank
        self.position = 0

    @property
    def grad_accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def step_sample_ids(self) -> list[list[int]]:
        """Sample ids of this rank's micro batches for the next optimizer step."""
        return [
            [self.order.sample_id(p) for p in micro_batch_positions(
                self.position, k, self.dp_rank, micro_batch=self.micro_batch, dp=self.dp)]
            for k in range(self.grad_accumulation)
        ]

    def advance(self) -> None:
        """Mark the next global batch as consumed (by every rank of the job)."""
        self.position += self.global_batch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "num_samples": self.order.num_samples, "seed": self.order.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.order.num_samples or state["seed"] != self.order.seed:
            raise DataError(
                f"checkpointed data order (samples={state['num_samples']}, seed={state['seed']}) does not match "
                f"this run (samples={self.order.num_samples}, seed={self.order.seed}): different dataset or spec"
            )
        self.position = int(state["position"])


class BatchLoader:
    """Reads this rank's micro batches for one optimizer step as ``(inputs, targets)`` tensors.

    After :meth:`next_step`, ``last_positions`` holds the global position of each micro batch's
    first row (the key of :func:`micro_batch_seed`) and ``last_start`` the step's first position.
    """

    def __init__(self, dataset: Any, sampler: GlobalSampler, device: torch.device) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.last_positions: list[int] = []
        self.last_start = sampler.position

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s = self.sampler
        self.last_start = s.position
        self.last_positions = [
            sample_position(s.position, k, s.dp_rank, 0, micro_batch=s.micro_batch, dp=s.dp)
            for k in range(s.grad_accumulation)
        ]
        batches = []
        for ids in s.step_sample_ids():
            windows = torch.from_numpy(self.dataset.windows(ids))
            if self.device.type == "cuda":
                windows = windows.pin_memory().to(self.device, non_blocking=True)
            batches.append((windows[:, :-1], windows[:, 1:]))
        s.advance()
        self.maybe_prefetch()
        return batches

    def maybe_prefetch(self) -> None:
        """Start fetching the shards of the next step's samples, for a dataset read through a shard cache
        (an object store): they arrive while this step computes."""
        if getattr(self.dataset, "cache", None) is not None:
            self.dataset.prefetch([i for ids in self.sampler.step_sample_ids() for i in ids])
