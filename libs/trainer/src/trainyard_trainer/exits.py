"""Which exit code a rank's failure becomes (see ``trainyard_common.exitcodes``)."""

from __future__ import annotations

import torch

from trainyard_common import exitcodes
from trainyard_common.errors import CheckpointError, ConfigError, DataError, NonFiniteError, SpecError


def exit_code_for(exc: BaseException) -> int:
    """The rank exit code for an exception (see trainyard_common.exitcodes)."""
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
