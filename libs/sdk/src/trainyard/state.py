"""Everything a checkpoint holds, each piece a ``torch.distributed.checkpoint`` ``Stateful``.

The checkpointed dict (:func:`checkpoint_state`) is::

    model         ModelState       FQN-keyed weights (DDP/FSDP/TP/AC wrappers stripped)
    optimizer     OptimizerState   flattened, FQN-keyed optimizer state (``state.<fqn>.exp_avg``, …)
    lr_scheduler  LambdaLR         schedule position (= optimizer steps taken)
    sampler       GlobalSampler    global data position (not per rank)
    progress      Progress         global step, consumed tokens / samples
    rng           RngState         per-rank generator states under ``rank_<r>``

DCP de-duplicates replicated entries (the same key on every rank) and writes each once;
keys that exist on one rank only (``rng.rank_<r>.*``) are written by that rank. So every
rank's shard file holds at least its own RNG state, and a restore gives each rank back
exactly the generators it had.

Everything is keyed by parameter name, never by rank or position, which is what lets a
checkpoint written by one layout be loaded by another (elastic resume): DCP reshards DTensor
shards (FSDP, TP) and ZeRO-1 optimizer partitions (each rank saves and loads the entries of
the parameters it owns) by name.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainyard_contract.errors import CheckpointError


class _FqnMap:
    """Parameter/buffer name -> canonical FQN (wrapper prefixes stripped), computed once per name."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._cache: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self._cache:
            from torch.distributed.checkpoint.state_dict import _get_fqns

            (fqn,) = _get_fqns(self.model, name)
            self._cache[name] = fqn
        return self._cache[name]


class ModelState:
    """The model's weights by fully qualified name, independent of parallel wrappers.

    The first ``state_dict()`` is torch's ``get_model_state_dict``; when a direct walk of the
    named parameters and buffers gives the same entries, later calls take that walk (a few
    hundred microseconds instead of milliseconds: it is part of an asynchronous save's stall).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._fqn = _FqnMap(model)
        self._fast: bool | None = None

    def _walk(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, tensor in itertools.chain(self.model.named_parameters(), self.model.named_buffers()):
            out[self._fqn(name)] = tensor.detach()
        return out

    def state_dict(self) -> dict[str, Any]:
        if self._fast:
            return self._walk()
        reference = get_model_state_dict(self.model)
        if self._fast is None:
            self._fast = _same_entries(reference, self._walk())
        return reference

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's state keyed by parameter FQN (so it survives re-wrapping / resharding).

    Flattened (one entry per parameter and field: ``state.<fqn>.exp_avg``) so that entries can
    differ between ranks: with ZeRO-1 each rank holds the state of its own partition only
    (``optimizer.optim`` of a ``ZeroRedundancyOptimizer``), saves those entries and, on load,
    reads whichever entries its partition of the new world needs.

    Only the per-parameter tensors are saved. The hyper-parameters (``param_groups.<fqn>.*``)
    are the spec's, which a job cannot change, and the learning rate is the schedule's, which is
    restored with it; saving them would add a dozen pickled entries per parameter (most of a
    checkpoint's per-item cost). On load they are taken from the live optimizer. As with
    :class:`ModelState`, a direct walk replaces torch's helper once it is shown to agree.
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = local_optimizer(optimizer)
        self._fqn = _FqnMap(model)
        self._fast: bool | None = None

    def _full(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.OPTIONS)

    def _walk(self) -> dict[str, Any] | None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not all(self.optimizer.state.get(p) for p in params):
            return None  # not initialised yet: torch's helper knows how
        fqn_of = {id(p): self._fqn(name) for name, p in self.model.named_parameters()}
        return {f"state.{fqn_of[id(p)]}.{key}": value for p in params for key, value in self.optimizer.state[p].items()}

    def state_dict(self) -> dict[str, Any]:
        if self._fast and (walked := self._walk()) is not None:
            return walked
        reference = {k: v for k, v in self._full().items() if k.startswith("state.")}
        if self._fast is None and (walked := self._walk()) is not None:
            self._fast = _same_entries(reference, walked)
        return reference

    def load_state_dict(self, state: dict[str, Any]) -> None:
        live = self._full()
        merged = {k: v for k, v in live.items() if not k.startswith("state.")}
        merged.update(state)
        set_optimizer_state_dict(self.model, self.optimizer, merged, options=self.OPTIONS)


def _same_entries(reference: dict[str, Any], walked: dict[str, Any]) -> bool:
    """The same keys, holding the same tensors (same storage, shape and type)."""
    if reference.keys() != walked.keys():
        return False
    for key, value in reference.items():
        other = walked[key]
        if isinstance(value, torch.Tensor) != isinstance(other, torch.Tensor):
            return False
        if isinstance(value, torch.Tensor):
            local_a = value.to_local() if hasattr(value, "to_local") else value
            local_b = other.to_local() if hasattr(other, "to_local") else other
            if (type(value) is not type(other) or value.shape != other.shape
                    or local_a.data_ptr() != local_b.data_ptr()):
                return False
    return True


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: a ZeroRedundancyOptimizer's local shard, else itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


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
        self.seed = seed
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

    def reseed(self, global_step: int) -> None:
        """Fresh streams for a resume on a different number of ranks, where rank ``r`` of the old
        world is no one in particular: derived from (seed, rank, step), so still reproducible."""
        derived = (self.seed * 1_000_003 + global_step) * 65_537 + self.rank
        self.python = random.Random(derived)
        torch.manual_seed(derived % (2**63))


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
