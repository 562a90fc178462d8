"""A resumable, deterministic loader over the job's trainyard dataset (``run.data_loader()``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from trainyard_contract.errors import ConfigError, DataError
from trainyard_contract.spec import TrainingSpec

from trainyard.data import TokenDataset
from trainyard.sampler import BatchLoader, GlobalSampler
from trainyard.shardcache import ShardCache

__all__ = ["DataLoader", "open_loader"]


class DataLoader(BatchLoader):
    """Yields this rank's share of each optimizer step: a list of ``(inputs, targets)`` micro batches.

    ``len(next(loader)) == loader.grad_accumulation`` (one when ``microBatchSize x data ranks ==
    globalBatchSize``); each micro batch is ``microBatchSize`` rows of ``sequenceLength`` tokens,
    ``targets`` the inputs shifted by one. The order is a seeded permutation of the dataset per
    epoch (see :mod:`trainyard.sampler`); it never ends (epochs follow each other).

    ``Stateful``: put it in the state you checkpoint and a restored run reads exactly the batches
    an uninterrupted one would have, on any number of ranks (the position is global, not per rank).
    """

    def __init__(self, dataset: Any, sampler: GlobalSampler, device: torch.device) -> None:
        super().__init__(dataset, sampler, device)

    @property
    def grad_accumulation(self) -> int:
        return self.sampler.grad_accumulation

    @property
    def position(self) -> int:
        """Global position of the next step's first sample (``global_step x globalBatchSize`` from step 0)."""
        return self.sampler.position

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.next_step()

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self.last_start = self.sampler.position
        self.maybe_prefetch()


def open_loader(spec: TrainingSpec, manifest_path: Path, *, dp: int, dp_rank: int, device: torch.device,
                cache: Callable[[], ShardCache | None]) -> DataLoader:
    """The loader ``run.data_loader()`` returns: the spec's batch over the dataset at ``manifest_path``, this
    data-parallel rank's rows; ``cache`` opens the node's shard cache (once the batch sizes are known to divide)."""
    t = spec.training
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"training.globalBatchSize {t.global_batch_size} is not a multiple of microBatchSize "
            f"{t.micro_batch_size} x data-parallel size {dp}: choose sizes that divide")
    try:
        dataset = TokenDataset(manifest_path, t.sequence_length, cache=cache())
    except FileNotFoundError as exc:
        raise DataError(f"dataset {spec.dataset} not found at {manifest_path}: {exc}") from exc
    sampler = GlobalSampler(len(dataset), seed=t.seed, global_batch=t.global_batch_size,
                            micro_batch=t.micro_batch_size, dp=dp, dp_rank=dp_rank)
    return DataLoader(dataset, sampler, device)
