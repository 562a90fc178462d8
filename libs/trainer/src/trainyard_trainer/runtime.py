"""Where a rank runs: device, collective backend, numeric precision, determinism."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainyard_common.errors import ConfigError

from trainyard_trainer.settings import RankSettings


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    backend: str
    autocast_dtype: torch.dtype | None  # None: full fp32

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def select_runtime(settings: RankSettings) -> Runtime:
    """nccl + CUDA (bf16 autocast where supported) when a GPU is visible, else gloo + CPU fp32."""
    cuda = torch.cuda.is_available()
    if settings.backend == "nccl" and not cuda:
        raise ConfigError("TRAINYARD_BACKEND=nccl but no CUDA device is visible to this process")
    if not cuda or settings.backend == "gloo":
        return Runtime(torch.device("cpu"), "gloo", None)
    count = torch.cuda.device_count()
    # A node agent that narrows CUDA_VISIBLE_DEVICES to this rank's device leaves one visible.
    index = 0 if count == 1 else (settings.device_index if settings.device_index is not None else settings.local_rank)
    if index >= count:
        raise ConfigError(f"device index {index} but only {count} CUDA devices are visible")
    torch.cuda.set_device(index)
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return Runtime(torch.device("cuda", index), "nccl", dtype)


def configure_determinism(runtime: Runtime, *, seed: int, rank: int, deterministic: bool) -> None:
    """Seed this rank's torch generators and pin the numerics.

    Each rank gets its own stream (``seed + rank``: dropout masks differ across data-parallel
    ranks, as they should); the model is initialised from ``seed`` alone, see ``build_model``.
    The global ``random`` module is left unseeded on purpose: tracing draws span ids from it
    (see ``RngState``). On CPU a single intra-op thread keeps reductions in one order, so a
    resumed run is bitwise identical to an uninterrupted one.
    """
    torch.manual_seed(seed + rank)
    if runtime.device.type == "cpu":
        torch.set_num_threads(1)
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


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
