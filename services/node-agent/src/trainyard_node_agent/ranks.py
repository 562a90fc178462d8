"""Rank processes: spawn one in its own session (so its whole process group can be
signalled), wait for it, stop it with SIGTERM then SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainyard_common.spool import SpoolReader


@dataclass
class RankProcess:
    """One rank this agent launched, and what it knows about it."""

    job_id: str
    tenant: str
    attempt: int
    allocation_id: str
    epoch: int
    rank: int
    local_rank: int
    pid: int
    log_path: Path
    spool: SpoolReader
    traceparent: str | None
    process: asyncio.subprocess.Process | None = None
    revoked: bool = False
    stop_detail: str | None = None
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return f"{self.allocation_id}/{self.rank}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def persisted(self, boot_id: str) -> dict[str, Any]:
        """What survives an agent restart (so a new agent can stop and report leftovers)."""
        return {
            "jobId": self.job_id, "tenant": self.tenant, "attempt": self.attempt,
            "allocationId": self.allocation_id, "epoch": self.epoch, "rank": self.rank,
            "pid": self.pid, "pgid": self.pid, "spool": str(self.spool.path), "offset": self.spool.offset,
            "traceparent": self.traceparent, "boot": boot_id,
        }


async def spawn(command: Sequence[str], env: Mapping[str, str], log_path: Path) -> asyncio.subprocess.Process:
    """Start ``command`` in a new session with stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return await asyncio.create_subprocess_exec(
            *command, env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def wait_exited(process: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait up to ``timeout_s``; True once the process has exited."""
    if process.returncode is not None:
        return True
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Signal a whole process group; False when nothing is left in it."""
    if pgid <= 1:  # 0 or 1 would mean our own group or every process: never
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def stop(rank: RankProcess, grace_s: float) -> None:
    """SIGTERM the rank's process group, SIGKILL whatever is left after ``grace_s``."""
    process = rank.process
    if process is None:
        return
    if process.returncode is None:
        signal_group(rank.pid, signal.SIGTERM)
        await wait_exited(process, grace_s)
    # Children that outlive the rank (dataloader workers, …) go too.
    signal_group(rank.pid, signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(process.wait(), 5.0)


def alive(pid: int, pgid: int) -> bool:
    """Whether ``pid`` still runs in process group ``pgid`` (a restarted agent's leftover)."""
    try:
        return os.getpgid(pid) == pgid
    except (ProcessLookupError, PermissionError):
        return False
