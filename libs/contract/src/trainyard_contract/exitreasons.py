"""Why an attempt's rank ended, declared once: :class:`ExitReason`, and what each reason means to the platform.

The reason travels as a plain string (``WorkerExited.reason``, ``AttemptRecord.failureReason``'s prefix,
the exit note a rank writes): the wire never changes. Every party reads that string through
:meth:`ExitReason.parse` and asks the member, never a set of its own:

* ``retryable``   — an attempt that failed so is worth another one (within the job's budget); a
  reason that is not fails the job at once. ``nan`` is retryable once per step: the scheduler
  refuses it again when an earlier attempt hit NaN at the same step (docs/failures.md).
* ``interruption`` — the attempt ends without spending the job's attempt budget and nobody is
  blamed: the platform stopped it (a drain, a control-plane outage, a preemption's checkpoint)
  or a squatter held its rendezvous port. design.md §7.
* ``blames_node`` — the failure points at the node it ran on: its reputation score grows by
  ``blame_weight`` (``trainyard_scheduler.health``); ``tenant_bounded`` says whether what the
  tenant's ranks report of themselves could bring it about (then its share is capped per tenant).
* ``stops_on_purpose`` — how a rank ends when its node stops it on purpose: during a drain this is
  part of the stop, not a failure.
* ``counts_for_mtbf`` — a failure of the hardware or the software stack, counted by the checkpoint
  coordinator's MTBF (Young/Daly interval advice); the job's own faults and the platform's choices
  are not.
* ``from_exit_code`` — the trainer named the cause by its exit code (``exit_code``): the node agent
  does not look for another in the log.

Most reasons come from the rank's exit (the node agent's ``classify``); ``start-timeout``,
``checkpoint-missing``, ``maintenance`` and ``control-plane`` are the scheduler's own diagnoses.
``signal-<n>`` is one reason, ``signal``, for every fatal signal but the ones that say ``killed``.

A string this version does not know (a newer producer's, or one retired) parses as
:attr:`ExitReason.UNKNOWN`: not retried (a job is never retried on a reason nobody can judge;
it fails with the reason it gave, as before this type existed), no node blamed, counted for the
MTBF as any unexplained failure. ``unknown`` itself is never produced.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import StrEnum

_KILLED_BY = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
SIGNAL_PREFIX = "signal-"


@dataclass(frozen=True)
class Traits:
    """What one reason means (see the module docstring for each field)."""

    description: str
    exit_code: int | None = None
    retryable: bool = False
    interruption: bool = False
    blame_weight: float = 0.0
    tenant_bounded: bool = True
    stops_on_purpose: bool = False
    counts_for_mtbf: bool = True
    from_exit_code: bool = False


class ExitReason(StrEnum):
    """A reason, equal to its wire string (``ExitReason.OOM == "oom"``); its traits are properties."""

    OK = "ok"
    ERROR = "error"
    CONFIG = "config"
    NAN = "nan"
    CHECKPOINT = "checkpoint"
    DATA = "data"
    OOM = "oom"
    PREEMPTED = "preempted"
    KILLED = "killed"
    SIGNAL = "signal"
    NCCL = "nccl"
    HANG = "hang"
    LOST = "lost"
    REVOKED = "revoked"
    SECURITY = "security"
    PORT_IN_USE = "port-in-use"
    START_TIMEOUT = "start-timeout"
    CHECKPOINT_MISSING = "checkpoint-missing"
    MAINTENANCE = "maintenance"
    CONTROL_PLANE = "control-plane"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, text: str | None) -> ExitReason:
        """The reason a wire string names: ``signal-<n>`` is :attr:`SIGNAL`; an unknown one, or none at all,
        :attr:`UNKNOWN`."""
        if not text:
            return cls.UNKNOWN
        if text.startswith(SIGNAL_PREFIX):
            return cls.SIGNAL
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN

    @property
    def traits(self) -> Traits:
        return REASONS[self]

    @property
    def description(self) -> str:
        return REASONS[self].description

    @property
    def exit_code(self) -> int | None:
        return REASONS[self].exit_code

    @property
    def retryable(self) -> bool:
        return REASONS[self].retryable

    @property
    def interruption(self) -> bool:
        return REASONS[self].interruption

    @property
    def blames_node(self) -> bool:
        return REASONS[self].blame_weight > 0

    @property
    def blame_weight(self) -> float:
        return REASONS[self].blame_weight

    @property
    def tenant_bounded(self) -> bool:
        return REASONS[self].tenant_bounded

    @property
    def stops_on_purpose(self) -> bool:
        return REASONS[self].stops_on_purpose

    @property
    def counts_for_mtbf(self) -> bool:
        return REASONS[self].counts_for_mtbf

    @property
    def from_exit_code(self) -> bool:
        return REASONS[self].from_exit_code


R = ExitReason
REASONS: dict[ExitReason, Traits] = {
    R.OK: Traits("exit 0", 0, counts_for_mtbf=False),
    R.ERROR: Traits("an exception in the rank (exit 1), a peer's death seen as a broken connection among them",
                    1, retryable=True),
    R.CONFIG: Traits("spec or environment error (exit 2), or the job's own code cannot start", 2,
                     counts_for_mtbf=False, from_exit_code=True),
    R.NAN: Traits("non-finite loss (exit 3); retried once per step: a NaN that repeats at the same step fails "
                  "the job", 3, retryable=True, counts_for_mtbf=False, from_exit_code=True),
    R.CHECKPOINT: Traits("no restorable checkpoint, or its I/O failed in the rank (exit 4)", 4,
                         from_exit_code=True),
    R.DATA: Traits("data error (exit 5)", 5, counts_for_mtbf=False, from_exit_code=True),
    R.OOM: Traits("out of memory: CUDA (exit 6), the kernel OOM killer, or an out-of-memory line in the log", 6,
                  retryable=True, blame_weight=0.5, from_exit_code=True),
    R.PREEMPTED: Traits("checkpointed on request and stopped (exit 7), or revoked for a preemption", 7,
                        retryable=True, interruption=True, stops_on_purpose=True, counts_for_mtbf=False),
    R.KILLED: Traits("SIGKILL, SIGTERM or SIGINT from outside the platform", retryable=True, blame_weight=0.5,
                     stops_on_purpose=True),
    R.SIGNAL: Traits("another fatal signal, on the wire as signal-<n> (signal-11)", retryable=True,
                     blame_weight=1.0),
    R.NCCL: Traits("NCCL, CUDA or hardware error in the log (NCCL error, uncorrectable ECC, Xid…)",
                   retryable=True, blame_weight=1.0),
    R.HANG: Traits("no step progress within the hang timeout, or a collective time-out in the log",
                   retryable=True, blame_weight=1.0),
    R.LOST: Traits("the rank vanished with nobody to record how, or its node stopped heart-beating",
                   retryable=True, blame_weight=1.0, tenant_bounded=False, stops_on_purpose=True),
    R.REVOKED: Traits("the platform stopped it: another rank failed, pause, cancel, or its lease was gone",
                      retryable=True, stops_on_purpose=True, counts_for_mtbf=False),
    R.SECURITY: Traits("a rank claimed what a rank may not (a forged event): the job fails at once"),
    R.PORT_IN_USE: Traits("not started: the rendezvous port was held on rank 0's node (a squatter); "
                          "the next attempt draws another port", retryable=True, interruption=True),
    R.START_TIMEOUT: Traits("the scheduler's: the ranks did not all start within the start time-out",
                            retryable=True, blame_weight=0.5),
    R.CHECKPOINT_MISSING: Traits("the scheduler's: every rank exited 0 but the final checkpoint never "
                                 "turned READY", retryable=True),
    R.MAINTENANCE: Traits("the scheduler's: a node of the attempt was drained (checkpoint, then stop)",
                          retryable=True, interruption=True, counts_for_mtbf=False),
    R.CONTROL_PLANE: Traits("the scheduler's: most of the cluster went silent together, or the ranks were to "
                            "start while the control plane was away", retryable=True, interruption=True,
                            counts_for_mtbf=False),
    R.UNKNOWN: Traits("a string this version does not know (never produced): fails the job as given"),
}
del R

_BY_CODE = {t.exit_code: reason for reason, t in REASONS.items() if t.exit_code is not None}


def exit_reason(code: int) -> str:
    """The reason a process exit code names (negative = killed by that signal, as subprocess reports):
    ``killed``, ``signal-<n>``, the trainer's own codes, else ``error``."""
    if code < 0:
        return ExitReason.KILLED if -code in _KILLED_BY else f"{SIGNAL_PREFIX}{-code}"
    return _BY_CODE.get(code, ExitReason.ERROR)


def reasons_table() -> str:
    """The Markdown table of every reason, as docs/failures.md shows it (a doc test keeps the two equal)."""
    rows = ["| reason | exit code | means | retried | interruption | blames node |", "|---|---|---|---|---|---|"]
    for reason, t in REASONS.items():
        wire = "`signal-<n>`" if reason is ExitReason.SIGNAL else f"`{reason.value}`"
        code = "" if t.exit_code is None else str(t.exit_code)
        blame = f"yes ({t.blame_weight:g}{'' if t.tenant_bounded else ', uncapped'})" if t.blame_weight else "no"
        retried = "—" if t.exit_code == 0 else "yes" if t.retryable else "no"
        rows.append(f"| {wire} | {code} | {t.description} | {retried} | "
                    f"{'yes' if t.interruption else 'no'} | {blame} |")
    return "\n".join(rows) + "\n"
