"""Everything a checkpoint holds, each piece a ``torch.distributed.checkpoint`` ``Stateful``.

The checkpointed dict (:func:`checkpoint_state`) is::

    model         ModelState       FQN-keyed weights (DDP/FSDP wrappers stripped)
    optimizer     OptimizerState   FQN-keyed optimizer state and param groups
    lr_scheduler  LambdaLR         schedule position (= optimizer steps taken)
    sampler       GlobalSampler    global data position (not per rank)
    progress      Progress         global step, consumed tokens / samples
    rng           RngState         per-rank generator states under ``rank_<r>``

DCP de-duplicates replicated entries (the same key on every rank) and writes each once;
keys that exist on one rank only (``rng.rank_<r>.*``) are written by that rank. So every
rank's shard file holds at least its own RNG state, and a restore gives each rank back
exactly the generators it had.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainyard_common.errors import CheckpointError


class ModelState:
    """The model's weights by fully qualified name, independent of parallel wrappers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's state keyed by parameter FQN (so it survives re-wrapping / resharding)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class Progress:
    """Counters of the whole job (identical on every rank)."""

    def __init__(self) -> None:
        self.global_step = 0
        self.consumed_tokens = 0
        self.consumed_samples = 0

    def advance(self, *, samples: int, tokens: int) -> None:
        self.global_step += 1
        self.consumed_samples += samples
        self.consumed_tokens += tokens

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "consumed_tokens": self.consumed_tokens,
            "consumed_samples": self.consumed_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.consumed_tokens = int(state["consumed_tokens"])
        self.consumed_samples = int(state["consumed_samples"])


class RngState:
    """This rank's random streams: its own Python generator, torch CPU and (when present) CUDA.

    The Python stream is a private ``random.Random`` (``self.python``), not the ``random``
    module's global one: OpenTelemetry draws span ids and the OTLP exporter's retry jitter
    from the global generator, from a background thread at arbitrary moments, so the global
    state is neither reproducible nor ours to restore (restoring it would also make a resumed
    attempt reissue the span ids of the attempt before). Trainer code that needs Python-side
    randomness uses ``rng.python``. torch's default generators are the ones dropout draws from.
    """

    def __init__(self, rank: int, device: torch.device, *, seed: int) -> None:
        self.rank = rank
        self.device = device
        self.python = random.Random(seed + rank)

    @property
    def key(self) -> str:
        return f"rank_{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": self.python.getstate(), "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return {self.key: state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            mine = state[self.key]
        except KeyError:
            raise CheckpointError(f"checkpoint holds no RNG state for rank {self.rank}") from None
        self.python.setstate(mine["python"])
        torch.set_rng_state(mine["torch"])
        if self.device.type == "cuda" and "cuda" in mine:
            torch.cuda.set_rng_state(mine["cuda"], self.device)


def checkpoint_state(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    sampler: Stateful,
    progress: Progress,
    rng: RngState,
) -> dict[str, Stateful]:
    """The dict handed to ``dcp.save`` / ``dcp.load``: one Stateful per piece of training state."""
    return {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "lr_scheduler": lr_scheduler,
        "sampler": sampler,
        "progress": progress,
        "rng": rng,
    }
