"""Why a rank ended: the ``reason`` of its WorkerExited, from what the node agent knows. Pure.

Order of evidence: the agent's own decision (it revoked the rank, or stopped it as hung); the
trainer's exit code (``trainyard_contract.exitcodes``: 3 nan, 6 oom, 2 config, 4 checkpoint,
5 data, 7 preempted: it checkpointed on request and stopped); a SIGKILL while the cgroup's OOM-kill counter went up (the
kernel OOM killer, best effort); markers in the tail of the rank's log (CUDA out of memory, NCCL / CUDA / hardware
errors, collective timeouts); otherwise what the exit code says (error, killed, signal-<n>).

User code (``spec.code``) is the job's own: an entrypoint the launcher cannot start, and a script
that fails at start (before it wrote anything to its event spool) with ``ModuleNotFoundError``,
``ImportError``, ``SyntaxError`` or a file the interpreter cannot open, is ``config`` (the job
fails at once: a retry would fail the same way). Once it made progress, an exception is ``error``
(retried) like any other.

The reasons are :class:`~trainyard_contract.exitreasons.ExitReason` (``signal-<n>`` on the wire for
:attr:`~trainyard_contract.exitreasons.ExitReason.SIGNAL`); docs/failures.md has the table.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from trainyard_contract.exitreasons import ExitReason, exit_reason

from trainyard_node_agent.sandbox import NEVER_FOLLOWED, SANDBOX_EXIT, SANDBOX_FAILURE

# Checked in this order: an OOM often mentions CUDA, a collective timeout often mentions NCCL.
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "torch.OutOfMemoryError", "Cannot allocate memory",
               "std::bad_alloc", "Out of memory")
HANG_MARKERS = ("Watchdog caught collective operation timeout", "collective operation timeout",
                "Timed out waiting", "ProcessGroupGloo::recv timed out", "Socket Timeout",
                "DistNetworkError: timed out")
NCCL_MARKERS = ("NCCL error", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError", "ncclRemoteError",
                "ncclInvalidUsage", "NCCL WARN", "CUDA error", "cudaError", "CUBLAS_STATUS", "uncorrectable ECC",
                "ECC error", "Xid", "illegal memory access", "device-side assert")
_EXCEPTION_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*")
# What a Python script that cannot start prints last (IndentationError and TabError are SyntaxErrors).
_START_FAILURE_LINE = re.compile(
    r"^\s*(?:(?:ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError)\b.*"
    r"|\S*python[\d.]*: can't open file .*)")
_DETAIL_CHARS = 300


@dataclass(frozen=True)
class ExitFacts:
    """Everything the agent knows about one ended rank."""

    exit_code: int
    log_tail: str = ""
    revoked: str | None = None  # the revocation's reason, when the agent stopped it for that
    hang: str | None = None  # why the agent stopped it as hung
    lost: str | None = None  # the rank vanished and nobody recorded how it ended
    oom_kills: int = 0  # kernel OOM kills in its cgroup while it ran
    user_code: bool = False  # the rank ran the job's own code (spec.code), not the built-in trainer
    progressed: bool = False  # it wrote to its event spool before it ended
    start_error: str | None = None  # the launcher could not start the command (its OSError)
    violation: str | None = None  # the agent stopped it for a claim a rank may not make (relay.check_line)


def classify_exit(facts: ExitFacts) -> tuple[str, str | None]:
    """(reason, detail) of an ended rank."""
    if facts.violation is not None:
        return ExitReason.SECURITY, facts.violation
    if facts.lost is not None:
        return ExitReason.LOST, facts.lost
    if facts.revoked is not None:
        preempted = "preempt" in facts.revoked.lower()
        return (ExitReason.PREEMPTED if preempted else ExitReason.REVOKED), facts.revoked
    if facts.hang is not None:
        return ExitReason.HANG, facts.hang
    code = facts.exit_code
    if code == 0:
        return ExitReason.OK, None
    if facts.start_error is not None:
        return start_failure(facts.start_error, user_code=facts.user_code)
    if code == SANDBOX_EXIT and (line := marker_line(facts.log_tail, (SANDBOX_FAILURE,))):
        if NEVER_FOLLOWED in line:  # a directory it was to see was swapped for a link: tampering, not the node
            return ExitReason.SECURITY, line
        return ExitReason.ERROR, line  # this node could not confine the rank: retried, elsewhere if it persists
    if facts.user_code and code > 0 and not facts.progressed and (line := start_failure_line(facts.log_tail)):
        return ExitReason.CONFIG, line
    return _from_exit_status(facts)


def _from_exit_status(facts: ExitFacts) -> tuple[str, str | None]:
    """What the exit code names, then the OOM-kill counter, then markers in the log."""
    named = exit_reason(facts.exit_code)
    if named == ExitReason.PREEMPTED:
        return named, "checkpointed on request and stopped"
    if ExitReason.parse(named).from_exit_code:  # the trainer named the cause: the log is not searched
        return named, last_error_line(facts.log_tail)
    if facts.exit_code == -signal.SIGKILL and facts.oom_kills > 0:
        return ExitReason.OOM, (f"killed by the kernel OOM killer ({facts.oom_kills} OOM kill(s) in its cgroup "
                                "while it ran)")
    for reason, markers in ((ExitReason.OOM, OOM_MARKERS), (ExitReason.HANG, HANG_MARKERS),
                            (ExitReason.NCCL, NCCL_MARKERS)):
        if line := marker_line(facts.log_tail, markers):
            return reason, line
    return named, last_error_line(facts.log_tail)


def start_failure(error: str, *, user_code: bool) -> tuple[str, str]:
    """A command the launcher could not exec: the job's fault for its own entrypoint, else the node's."""
    if not user_code:
        return ExitReason.ERROR, f"cannot start the rank command: {_trim(error)}"
    missing = "No such file or directory" in error or "Errno 2]" in error
    return ExitReason.CONFIG, _trim(f"entrypoint {'not found' if missing else 'cannot be started'}: {error}")


def start_failure_line(text: str) -> str | None:
    """The last line of a log tail that says a Python script could not start (import, syntax, no file)."""
    for line in reversed(text.splitlines()):
        if _EXCEPTION_LINE.match(line) or _START_FAILURE_LINE.match(line):
            return _trim(line) if _START_FAILURE_LINE.match(line) else None
    return None


def marker_line(text: str, markers: tuple[str, ...]) -> str | None:
    """The last line of ``text`` containing one of ``markers`` (trimmed), or None."""
    for line in reversed(text.splitlines()):
        if any(m in line for m in markers):
            return _trim(line)
    return None


def last_error_line(text: str) -> str | None:
    """The last line that looks like an exception (``SomethingError: …``), for the detail."""
    for line in reversed(text.splitlines()):
        if _EXCEPTION_LINE.match(line):
            return _trim(line)
    return None


def parse_oom_kills(text: str) -> int | None:
    """The ``oom_kill`` counter of a cgroup ``memory.events`` (v2) or ``memory.oom_control`` (v1)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _trim(line: str) -> str:
    line = line.strip()
    return line if len(line) <= _DETAIL_CHARS else line[: _DETAIL_CHARS - 1] + "…"
