"""Exit codes of a trainer rank, and how a node agent names them (WorkerExited.reason)."""

from __future__ import annotations

import signal

OK = 0
ERROR = 1
CONFIG = 2
NAN = 3
CHECKPOINT = 4
DATA = 5
OOM = 6
PREEMPTED = 7  # checkpointed on request (CheckpointRequested: preemption or pause) and stopped

_REASONS = {OK: "ok", ERROR: "error", CONFIG: "config", NAN: "nan", CHECKPOINT: "checkpoint",
            DATA: "data", OOM: "oom", PREEMPTED: "preempted"}
RETRYABLE_REASONS = frozenset({"error", "killed", "lost", "oom", "hang", "nccl", "preempted"})
# not started: the rendezvous port is held on rank 0's node (a squatter). An interruption, not a failure: the
# scheduler retries on another port without spending the job's budget or blaming the node
PORT_IN_USE = "port-in-use"


def exit_reason(code: int) -> str:
    """Classify a process exit code (negative = killed by that signal, as subprocess reports)."""
    if code < 0:
        return "killed" if -code in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT) else f"signal-{-code}"
    return _REASONS.get(code, "error")
