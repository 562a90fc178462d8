"""Node agent settings (``TRAINYARD_*``), parsed once in ``main()``."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from trainyard_common.settings import ServiceSettings


class NodeAgentSettings(ServiceSettings):
    """One node: its identity, its devices and how ranks are launched on it."""

    node_id: str = Field(min_length=1, max_length=128, description="this node's id (unique in the cluster)")
    host: str = Field(default="127.0.0.1", description="address other nodes reach this one at (rendezvous)")
    device_count: int = Field(default=4, ge=0, le=1024, description="devices this node offers")
    device_type: str = Field(default="cpu", min_length=1, description="device type, matched to resources.gpuType")
    device_memory_bytes: int = Field(default=16 * 2**30, ge=0, description="memory per device (reported)")
    rack: str | None = Field(default=None, description="rack, for topology-aware placement")
    nvlink_domain: str | None = Field(default=None, description="high-bandwidth domain of the devices")
    heartbeat_s: float = Field(default=2.0, gt=0, description="seconds between NodeHeartbeats")
    rank_command: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [sys.executable, "-m", "trainyard_trainer"],
        description="command run once per rank: a JSON list or a shell-quoted string",
    )
    rank_env: dict[str, str] = Field(
        default_factory=dict,
        description='extra environment for every rank, JSON (e.g. {"TRAINYARD_CHECKPOINT_MODE": "sync"}); '
                    "the agent's own TRAINYARD_* variables are not passed on",
    )
    kill_grace_s: float = Field(default=10.0, ge=0, description="SIGTERM → SIGKILL grace when stopping ranks")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="torch.distributed backend; auto: nccl when nvidia-smi exists and devices are not cpu",
    )
    spool_poll_s: float = Field(default=0.25, gt=0, description="how often rank event spools are relayed")

    @field_validator("rank_command", mode="before")
    @classmethod
    def _command(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            parsed = json.loads(text) if text.startswith("[") else shlex.split(text)
            if not parsed:
                raise ValueError("rank_command must not be empty")
            return parsed
        return value
