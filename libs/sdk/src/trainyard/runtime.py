"""Where a rank runs: device, collective backend, numeric precision, determinism."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainyard_contract.errors import ConfigError

from trainyard.settings import RankSettings


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    backend: str
    autocast_dtype: torch.dtype | None  # None: full fp32

    @property
    def precision(self) -> str:
        """``bf16-autocast`` or ``fp32``: what the run record and the MFU table call it."""
        return "fp32" if self.autocast_dtype is None else f"{str(self.autocast_dtype).removeprefix('torch.')}-autocast"

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA runs ahead of the host; timing needs this)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def select_runtime(settings: RankSettings) -> Runtime:
    """nccl + CUDA when a GPU is visible, else gloo + CPU; autocast as ``TRAINYARD_AUTOCAST`` says.

    ``auto`` is bf16 on a CUDA device that supports it and fp32 on CPU (CPU bf16 autocast works
    and is deterministic, but is slower than fp32 on most CPUs; ask for it with ``bf16``).
    """
    cuda = torch.cuda.is_available()
    if settings.backend == "nccl" and not cuda:
        raise ConfigError("TRAINYARD_BACKEND=nccl but no CUDA device is visible to this process")
    if not cuda or settings.backend == "gloo":
        device, backend = torch.device("cpu"), "gloo"
    else:
        count = torch.cuda.device_count()
        # A node agent that narrows CUDA_VISIBLE_DEVICES to this rank's device leaves one visible.
        chosen = settings.device_index if settings.device_index is not None else settings.local_rank
        index = 0 if count == 1 else chosen
        if index >= count:
            raise ConfigError(f"device index {index} but only {count} CUDA devices are visible")
        torch.cuda.set_device(index)
        device, backend = torch.device("cuda", index), "nccl"
    return Runtime(device, backend, autocast_dtype(settings.autocast, device))


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``TRAINYARD_AUTOCAST`` (auto | bf16 | off) on ``device``."""
    if choice == "off":
        return None
    bf16_ok = device.type == "cpu" or torch.cuda.is_bf16_supported()
    if choice == "bf16":
        if not bf16_ok:
            raise ConfigError(f"TRAINYARD_AUTOCAST=bf16 but {torch.cuda.get_device_name(device)} has no bf16 support")
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" and bf16_ok else None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a cgroup or taskset narrows it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def rank_cpu_threads(settings: RankSettings, cores: int) -> int:
    """This rank's intra-op CPU threads: ``TRAINYARD_CPU_THREADS`` (the node agent's share), else
    ``OMP_NUM_THREADS`` (its first figure), else an equal share of ``cores`` among the node's ranks
    (the agent's rule, for ranks started without it). Pure."""
    if settings.cpu_threads is not None:
        return settings.cpu_threads
    head = (settings.omp_num_threads or "").split(",")[0].strip()
    if head.isdigit() and int(head) > 0:
        return int(head)
    return max(1, cores // settings.local_world_size)


def set_cpu_threads(threads: int) -> None:
    """Intra-op threads to ``threads`` (and inter-op, while torch still allows it: only once, before
    any inter-op work; a warm interpreter that imported torch earlier still gets its intra-op count)."""
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(threads)


def configure_determinism(runtime: Runtime, *, seed: int, rank: int, deterministic: bool,
                          cpu_threads: int = 1) -> None:
    """Seed this rank's torch generators and pin the numerics.

    Each rank gets its own stream (``seed + rank``: dropout masks differ across data-parallel
    ranks, as they should); the model is initialised from ``seed`` alone, see ``build_model``.
    The global ``random`` module is left unseeded on purpose: tracing draws span ids from it
    (see ``RngState``). On CPU the rank runs ``cpu_threads`` intra-op threads: torch's CPU
    kernels split a reduction into chunks by the thread count, so for a fixed count they sum in
    the same order every time and a resumed run is bitwise identical to an uninterrupted one
    with the same count (the run record says each rank's count; a resume with another count is
    reported there, see ``cpu_threads_change``).
    """
    torch.manual_seed(seed + rank)
    if runtime.device.type == "cpu":
        set_cpu_threads(cpu_threads)
        torch.use_deterministic_algorithms(deterministic)
        return
    if deterministic:
        # cuBLAS needs this before its first handle is created to choose deterministic kernels.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        # Some CUDA kernels (e.g. attention backward) have no deterministic variant: warn, do not fail.
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic


def init_distributed(settings: RankSettings, runtime: Runtime) -> None:
    """Join the job's process group (rendezvous at MASTER_ADDR:MASTER_PORT)."""
    dist.init_process_group(
        backend=runtime.backend,
        init_method=settings.init_method,
        rank=settings.rank,
        world_size=settings.world_size,
        timeout=timedelta(seconds=settings.collective_timeout_s),
        device_id=runtime.device if runtime.device.type == "cuda" else None,
    )


def init_replica_world(runtime: Runtime) -> None:
    """A fault-tolerant job's replica is a world of one of its own (an in-process store: nothing to dial); the
    replicas are joined per step by torchft (:mod:`trainyard.replicas`), so one that fails stops no other."""
    dist.init_process_group(backend=runtime.backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=runtime.device if runtime.device.type == "cuda" else None)


def new_cpu_group() -> dist.ProcessGroup:
    """A gloo group over the whole world, for CPU-side agreement and background checkpoint I/O.

    Collectives on one group must be issued in the same order on every rank, so work that runs
    on another thread (``dcp.async_save``) or on CPU tensors beside NCCL gets a group of its own.
    """
    return dist.new_group(backend="gloo")


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
