"""Exit codes of a trainer rank; what each one means, and every other reason a rank ends, is
:class:`~trainyard_contract.exitreasons.ExitReason` (a test keeps the two in step)."""

from __future__ import annotations

from trainyard_contract.exitreasons import ExitReason, exit_reason

OK = 0
ERROR = 1
CONFIG = 2
NAN = 3
CHECKPOINT = 4
DATA = 5
OOM = 6
PREEMPTED = 7  # checkpointed on request (CheckpointRequested: preemption or pause) and stopped

# not started: the rendezvous port is held on rank 0's node (a squatter). An interruption, not a failure: the
# scheduler retries on another port without spending the job's budget or blaming the node
PORT_IN_USE = ExitReason.PORT_IN_USE

__all__ = ["CHECKPOINT", "CONFIG", "DATA", "ERROR", "NAN", "OK", "OOM", "PORT_IN_USE", "PREEMPTED", "ExitReason",
           "exit_reason"]
