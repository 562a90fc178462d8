"""Fault-tolerant training (``spec.faultTolerance``): this rank is one replica; the others go on when it fails.

``run.replicas(model, optimizer)`` gives the script torchft's pieces, set up from the rank contract:

* a :class:`torchft.Manager` — the quorum of every step at the job's Lighthouse (``TRAINYARD_LIGHTHOUSE``, run by
  the platform on rank 0's node), a process group over the replicas that step (gloo on CPUs, NCCL on GPUs),
  reconfigured when one drops out or comes back, and live recovery: a replica that joins behind the others
  (the platform's replacement of a failed one) loads the model, optimizer, progress (and ``extra``: other
  ``Stateful`` objects, e.g. an LR scheduler) from a healthy peer, not from storage;
* ``replicas.model`` — the model wrapped in torchft's DistributedDataParallel (gradients averaged over the
  replicas of the step's quorum);
* ``replicas.optimizer`` — the optimizer wrapped so ``zero_grad()`` starts the step's quorum and ``step()``
  applies the update only when every replica of the quorum finished its backward (``should_commit``).

A step of the loop::

    while replicas.step < run.max_steps:
        replicas.optimizer.zero_grad()                # the quorum of this step
        for inputs, targets in replicas.batch(loader):  # this replica's share of the global batch
            loss = replicas.model(inputs, targets) * replicas.scale
            loss.backward()
        if replicas.commit():                          # the update, applied by every replica of the quorum
            run.report(replicas.step, loss=..., **replicas.metrics())
            run.checkpoint(replicas.step, state)       # replica 0 writes the job's checkpoints

The global batch of a step with fewer replicas (``faultTolerance.batch``): ``reduced`` — each replica reads its
own rows (``dp = replicas``), the missing replicas' rows are skipped and the step's batch is smaller;
``accumulate`` — the replicas of the quorum share every micro-batch of the global batch between them (more
micro-batches each, :attr:`Replicas.scale` weights them), so the update is the full batch's. Either way the
steps that ran with fewer replicas are counted (``replicas.metrics()`` in StepMetrics, the run record).

Checkpoints: the replicas hold the same weights, so only replica 0 saves, as a world of one; a checkpoint step
while replica 0 is being replaced is skipped (the next one is written once it is back). A new attempt restores
every replica from the latest READY checkpoint as usual; a replaced replica does not (it heals from a peer).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import TCPStore
from torch.distributed.checkpoint.stateful import Stateful
from trainyard_contract.errors import ConfigError

from trainyard.exits import NothingToHeal

if TYPE_CHECKING:
    from trainyard.loader import DataLoader
    from trainyard.run import Run

__all__ = ["Replicas", "ReplicaCounts", "open_replicas"]

log = logging.getLogger("trainyard")
LIGHTHOUSE_ENV = "TRAINYARD_LIGHTHOUSE"
GENERATION_ENV = "TRAINYARD_REPLICA_GENERATION"


@dataclass
class ReplicaCounts:
    """How the steps of this replica went: committed, with fewer replicas than the spec's, healed from a peer."""

    committed: int = 0
    degraded: list[int] = field(default_factory=list)  # steps committed with fewer replicas (bounded: the first)
    degraded_total: int = 0
    healed_at: int | None = None  # the step this replica joined at, healed from a peer
    not_committed: int = 0  # steps a quorum abandoned (a replica failed during them)

    def note(self, step: int, participants: int, replicas: int) -> None:
        self.committed += 1
        if participants < replicas:
            self.degraded_total += 1
            if len(self.degraded) < 1000:
                self.degraded.append(step)


def replica_id(job_id: str, rank: int) -> str:
    """torchft reads a replica's index from its id's trailing digits (``…replica3``)."""
    return f"{job_id}-replica{rank}"


def micro_batch_share(micro_batches: int, participants: int, participating_rank: int) -> list[int]:
    """``accumulate``: the global micro-batch indices (0 … ``micro_batches``-1) this replica reads when
    ``participants`` replicas step: every ``participants``-th, from its place in the quorum."""
    if participants <= 0 or not 0 <= participating_rank < participants:
        raise ValueError(f"participating rank {participating_rank} of {participants}")
    return list(range(participating_rank, micro_batches, participants))


class Replicas:
    """This rank's replica of a fault-tolerant job (see the module docstring); open it with
    ``run.replicas(model, optimizer)``."""

    def __init__(self, run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 extra: Mapping[str, Stateful], *, lighthouse: str, host: str) -> None:
        from torchft import Manager, Optimizer, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.http_transport import HTTPTransport

        ft = run.spec.fault_tolerance
        assert ft is not None
        self.run, self.spec_ft = run, ft
        self.counts = ReplicaCounts()
        # what a rejoining replica loads from a peer: plain torch state dicts (read from torchft's quorum thread
        # while this one trains: torch's DCP helpers would initialise an empty optimizer state in place)
        self._model, self._optimizer, self._extra = model, optimizer, dict(extra)
        timeout = timedelta(seconds=ft.quorum_timeout_seconds)
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        pg = ProcessGroupNCCL(timeout=timeout) if run.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)

        class _Transport(HTTPTransport):
            def address(self) -> str:  # the node's address, not its hostname (another host may not resolve it)
                port = self._server.socket.getsockname()[1]
                return f"http://{_bracket(host)}:{port}/checkpoint/"

        self.manager = Manager(
            pg=pg, min_replica_size=ft.min_replicas, load_state_dict=self._load, state_dict=self._dump,
            replica_id=replica_id(run.job_id, run.rank), rank=0, world_size=1, store_addr=host,
            store_port=self.store.port, lighthouse_addr=lighthouse, hostname=host, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout,
            checkpoint_transport=_Transport(timeout=timeout, num_chunks=0),
            init_sync=False,  # every replica starts from the same seed or READY checkpoint
            use_async_quorum=True)
        self._barrier = None if is_replacement(run.spec) else start_together(run, timeout)
        self.model = _DistributedDataParallel(self.manager, model)
        self.optimizer = Optimizer(self.manager, optimizer)
        restored = run.progress.global_step
        if restored:  # every replica of a new attempt restored the same READY checkpoint: start the count there
            self.manager.load_state_dict({"step": restored, "batches_committed": restored * ft.replicas})
        self.scale = 1.0
        self._newcomer = is_replacement(run.spec)
        self._loaders: dict[tuple[int, int], DataLoader] = {}
        log.info("replica %d of %d (min %d, batch %s), lighthouse %s, generation %s", run.rank, ft.replicas,
                 ft.min_replicas, ft.batch, lighthouse, os.environ.get(GENERATION_ENV, "0"))

    # ------------------------------------------------------------------ healing state

    def _dump(self) -> dict[str, Any]:
        return {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict(),
                "progress": self.run.progress.state_dict(), **{k: v.state_dict() for k, v in self._extra.items()}}

    def _load(self, state: dict[str, Any]) -> None:
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self.run.progress.load_state_dict(state["progress"])
        for key, stateful in self._extra.items():
            stateful.load_state_dict(state[key])
        self.counts.healed_at = self.run.progress.global_step
        log.warning("healed from a peer at step %s", self.counts.healed_at)

    # ------------------------------------------------------------------ the step

    @property
    def step(self) -> int:
        """Steps committed by the job (the quorum's step counter: a healed replica has its peer's)."""
        return int(self.manager.current_step())

    def participants(self) -> int:
        """Replicas in this step's quorum (waits for the quorum)."""
        return int(self.manager.num_participants())

    def batch(self, loader: Callable[[int, int], DataLoader] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's micro-batches of the current step (after ``optimizer.zero_grad()``), and
        :attr:`scale` to weight each micro-batch's loss with (gradients are averaged over the quorum).

        ``loader(dp, dp_rank)``: a loader over the job's dataset (default ``run.data_loader``)."""
        self._check_peers()
        open_loader = loader or (lambda dp, dp_rank: self.run.data_loader(dp=dp, dp_rank=dp_rank))
        t, ft = self.run.spec.training, self.spec_ft
        position = self.step * t.global_batch_size
        if ft.batch == "reduced":
            batches = self._read(open_loader, ft.replicas, self.run.rank, position)
            self.scale = 1.0 / len(batches)
            return batches
        micro_batches = t.global_batch_size // t.micro_batch_size
        participants = max(1, self.participants())
        out = []  # a loader per global micro-batch index ("rank" of a world of micro_batches): read by position
        for index in micro_batch_share(micro_batches, participants, self.manager.participating_rank() or 0):
            out.extend(self._read(open_loader, micro_batches, index, position))
        self.scale = participants / micro_batches
        return out

    def _check_peers(self) -> None:
        """A newcomer's first quorum must hold a peer to heal from (or to step with): alone, the others finished
        or ended, and training on alone from a checkpoint would apply their steps again (NothingToHeal: exit 0)."""
        if not self._newcomer:
            return
        self._newcomer = False
        if self.participants() <= 1 and not getattr(self.manager, "_healing", False):
            log.warning("no replica to heal from in the first quorum (the others finished or ended): leaving")
            raise NothingToHeal(f"replica {self.run.rank} found no peer at step {self.step}")

    def _read(self, open_loader: Callable[[int, int], DataLoader], dp: int, dp_rank: int,
              position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of data-parallel rank ``dp_rank`` of ``dp`` at global ``position``."""
        key = (dp, dp_rank)
        if key not in self._loaders:
            self._loaders[key] = open_loader(dp, dp_rank)
        data = self._loaders[key]
        if data.position != position:  # a step run again, a heal, another quorum size: read from there
            data.load_state_dict({**data.state_dict(), "position": position})
        return next(data)

    def commit(self) -> bool:
        """``optimizer.step()``: applied when every replica of the quorum finished the step; True when it was
        (the step counter moved on). False: the step was abandoned (a replica failed during it), run it again."""
        before = self.step
        participants = self.participants()
        self.optimizer.step()
        if self.step == before:
            self.counts.not_committed += 1
            log.warning("step %d was not committed (a replica failed during it); running it again", before + 1)
            return False
        self.counts.note(self.step, participants, self.spec_ft.replicas)
        # the record the chaos suite's invariant reads: no step is applied by two quorums
        log.info("committed step %d in quorum %s with %d of %d replicas", self.step,
                 getattr(self.manager, "_quorum_id", "?"), participants, self.spec_ft.replicas)
        return True

    def metrics(self) -> dict[str, float]:
        """What StepMetrics carries about the replicas: how many stepped, how many steps ran with fewer."""
        participants = self.participants()
        return {"replicas": float(participants), "replicas_missing": float(self.spec_ft.replicas - participants),
                "degraded_steps": float(self.counts.degraded_total)}

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self._barrier = None


def start_together(run: Run, timeout: timedelta) -> TCPStore:
    """The replicas of a new attempt take their first step together (a barrier on the attempt's rendezvous
    port, hosted by replica 0): a quorum only waits for replicas the Lighthouse has heard of, so one that is
    still importing torch would otherwise miss the first steps and join them healed. A replaced replica joins
    the running ones instead, without it. The store stays open while the run lasts (replica 0 hosts it)."""
    ft = run.spec.fault_tolerance
    assert ft is not None
    store = TCPStore(run.settings.master_addr, run.settings.master_port, world_size=ft.replicas,
                     is_master=run.rank == 0, timeout=timeout, wait_for_workers=False)
    if store.add(f"start/{run.attempt}", 1) == ft.replicas:
        store.set(f"go/{run.attempt}", "1")
    store.wait([f"go/{run.attempt}"], timeout)
    return store


def _mended_comm_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    work = state.allreduce(bucket.buffer())
    work.wait()
    fut = work.get_future()
    inner = getattr(fut, "_fut", None)
    if state.errored() is None and inner is not None:
        return inner
    # the allreduce failed (a peer died): torchft's own future may never complete; the step will not be
    # committed (should_commit), so hand DDP this bucket back as it is
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


# torch's DDP compares a hook's annotations with its real classes; this module's are strings (PEP 563)
_mended_comm_hook.__annotations__ = {}


def _ddp_class() -> type:
    from torchft import DistributedDataParallel

    class FaultTolerantDDP(DistributedDataParallel):
        """torchft's DDP with its comm hook mended: after an error in the step's allreduce (a replica died),
        torchft's hook asserted on a future it does not have (the surviving replica crashed), or returned one
        that never completes (it hung); here the step goes on, and ``should_commit`` abandons it."""

        _comm_hook = staticmethod(_mended_comm_hook)

    return FaultTolerantDDP


def _DistributedDataParallel(manager: Any, model: torch.nn.Module) -> torch.nn.Module:  # noqa: N802 - a class
    return _ddp_class()(manager, model)


def replacement_view(run: Run) -> Any:
    """What a replaced replica restores from before it heals: the job's newest READY checkpoint (a floor: should
    every replica it could heal from be gone too, it resumes there, never from step 0)."""
    from types import SimpleNamespace

    from trainyard_contract.events import CheckpointRef

    from trainyard.checkpoint import find_ready_checkpoints

    s = run.settings
    newest = next((c for c in find_ready_checkpoints(run.layout.checkpoints_dir(s.tenant, s.job_id))
                   if c.manifest is not None and c.global_step is not None), None)
    start = (CheckpointRef(manifest_uri=newest.manifest_uri, global_step=newest.global_step,
                           attempt=newest.attempt or s.attempt) if newest is not None
             else run.allocation.start_checkpoint)
    return SimpleNamespace(settings=s, allocation=run.allocation.model_copy(update={"start_checkpoint": start}))


def is_replacement(spec: Any) -> bool:
    """This rank replaces a failed replica of its running attempt (faultTolerance): it heals from a peer."""
    return spec.fault_tolerance is not None and int(os.environ.get(GENERATION_ENV, "0") or 0) > 0


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def node_host(run: Run) -> str:
    """This rank's node address, as the allocation names it (peers dial its store and recovery server there)."""
    for node in run.allocation.nodes:
        if any(slot.rank == run.rank for slot in node.ranks):
            return node.host
    return run.settings.master_addr if run.local else "127.0.0.1"


def open_replicas(run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  extra: Mapping[str, Stateful] | None = None, *,
                  closers: contextlib.ExitStack | None = None) -> Replicas:
    """:class:`Replicas` for this rank (shut down by ``closers``), or ConfigError saying what is missing."""
    if run.spec.fault_tolerance is None:
        raise ConfigError("run.replicas() needs faultTolerance in the spec ({replicas: R, minReplicas: k})")
    lighthouse = os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise ConfigError(f"{LIGHTHOUSE_ENV} is not set: the platform sets it for a job with faultTolerance "
                          "(locally, start a Lighthouse: python -m trainyard_node_agent.lighthouse --bind "
                          "127.0.0.1:29510 --min-replicas 1, and set it to http://127.0.0.1:29510)")
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"faultTolerance needs torchft on the node (pip install torchft==0.2.0): {exc}") from None
    if is_replacement(run.spec):
        log.info("this replica replaces a failed one: it heals from a healthy peer, not from storage")
    replicas = Replicas(run, model, optimizer, extra or {}, lighthouse=lighthouse, host=node_host(run))
    if closers is not None:
        closers.callback(replicas.shutdown)
    return replicas

