"""Which exit code a rank's failure becomes (``trainyard_contract.exitcodes``; what each one means to the platform:
``trainyard_contract.exitreasons.ExitReason``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trainyard_contract import exitcodes
from trainyard_contract.errors import CheckpointError, ConfigError, DataError, NonFiniteError, SpecError
from trainyard_contract.storage import atomic_write_bytes

from trainyard.preemption import StoppedOnRequest


class NothingToHeal(Exception):  # noqa: N818 - not an error: the way a replaced replica leaves with nothing to do
    """A replaced replica (faultTolerance) found no peer in its first quorum: the others finished or ended, and
    training alone from a checkpoint would apply steps again. It leaves with exit 0; the attempt goes on or ends
    as the other replicas' exits say."""


def exit_code_for(exc: BaseException) -> int:
    """The rank exit code for an exception (see trainyard_contract.exitcodes)."""
    if isinstance(exc, NothingToHeal):
        return exitcodes.OK
    if isinstance(exc, StoppedOnRequest):
        return exitcodes.PREEMPTED
    if isinstance(exc, NonFiniteError):
        return exitcodes.NAN
    if isinstance(exc, CheckpointError):
        return exitcodes.CHECKPOINT
    if isinstance(exc, DataError):
        return exitcodes.DATA
    if isinstance(exc, ConfigError | SpecError):
        return exitcodes.CONFIG
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return exitcodes.OOM
    return exitcodes.ERROR


@dataclass
class RankEnd:
    """What a rank knows about how it ended beyond its exit code, for the node agent's WorkerExited.

    ``global_step``: the last step it completed, or the step that failed (a NaN), or the step it
    checkpointed at when asked to stop. Written as ``{"exitCode", "reason", "globalStep", "error"}``
    to ``TRAINYARD_EXIT_NOTE_FILE`` when the agent sets it.
    """

    global_step: int | None = None

    def write(self, path: Path, *, code: int, error: str | None = None) -> None:
        note = {"exitCode": code, "reason": exitcodes.exit_reason(code), "globalStep": self.global_step,
                "error": error}
        atomic_write_bytes(path, json.dumps(note).encode())
