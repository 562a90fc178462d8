"""Checkpoint on request, then stop: what a rank does with a CheckpointRequested (preemption, pause).

The node agent delivers a request two ways: ``SIGUSR1`` to the rank's process group (the launcher
ignores it; the handler here only sets a flag) and a request file in the attempt directory (it
survives an agent restart and covers a signal sent before the handler was installed).

The step boundary's agreement is pipelined, so that it never holds training up: at the boundary
of step N every rank *sends* its flags (:func:`boundary_flags`: a save due by its clock, asked to
stop, which pending save it has finished, which failed) in a small all-reduce MAX that runs while
step N+1 computes, and at the boundary of N+1 every rank *collects* the same answer and decides
on it (:func:`plan_boundary`). What needs no agreement is decided at once and alike on every
rank: ``everySteps`` and ``maxSteps``. So a request is acted on one step after a rank saw it:
every rank saves that same global step (unless it is already saved), waits until its shard is
durable and its ShardWritten spooled, and leaves with :class:`StoppedOnRequest` (exit 7, reason
preempted). A save is named by its serial in the flags, so a late "done" can only ever complete
the save it was sent about. The decisions are pure; :class:`CheckpointRequest` is the I/O.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from trainyard_contract.errors import TrainyardError

log = logging.getLogger("trainyard")

CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"  # in the attempt directory; written by the node agent
REQUEST_SIGNAL = signal.SIGUSR1


class StoppedOnRequest(TrainyardError):
    """The ranks checkpointed at ``global_step`` because they were asked to, and stopped (exit 7).

    Not a failure: the attempt ends so its devices can go to someone else (or the job pauses);
    the next attempt resumes from this checkpoint.
    """

    retryable = True

    def __init__(self, global_step: int, *, saved: bool) -> None:
        how = "checkpointed" if saved else "already checkpointed"
        super().__init__(f"checkpoint requested: {how} at step {global_step} and stopped")
        self.global_step = global_step
        self.saved = saved


# ----------------------------------------------------------------------------- pure decisions


@dataclass(frozen=True)
class Boundary:
    """What all ranks agreed from the flags they sent at the previous step boundary (the
    element-wise MAX of :func:`boundary_flags`)."""

    due: bool  # a time-based save (everyMinutes) is due by some rank's clock
    requested: bool  # some rank was asked to checkpoint and stop
    done_save: int  # the serial of the pending save every rank had finished (0: none)
    failed_save: int  # the serial of a pending save that failed on some rank (0: none)

    def completes(self, serial: int) -> bool:
        """Whether the pending save ``serial`` is finished everywhere (complete or fail it now)."""
        return serial > 0 and self.done_save == serial

    def failed(self, serial: int) -> bool:
        return serial > 0 and self.failed_save == serial


NOTHING_AGREED = Boundary(due=False, requested=False, done_save=0, failed_save=0)  # before the first boundary


def boundary_flags(*, due: bool, requested: bool, pending_save: int, done: bool, failed: bool) -> list[int]:
    """This rank's contribution to the boundary's all-reduce MAX. ``pending_save``: the serial of the
    save in flight here (0: none), ``done``/``failed``: its write finished / failed on this rank.

    MAX makes any rank's "yes" everyone's; a save counts as done only when done on every rank, so
    its serial goes in negated (the MAX of ``-serial_done`` is minus the minimum over ranks)."""
    if pending_save <= 0:
        return [int(due), int(requested), 0, 0]
    return [int(due), int(requested), -(pending_save if done else 0), pending_save if failed else 0]


def agreed(flags: list[int]) -> Boundary:
    """The reduced flags as a :class:`Boundary`."""
    due, requested, minus_done, failed = (int(v) for v in flags)
    return Boundary(due=due > 0, requested=requested > 0, done_save=-minus_done, failed_save=failed)


@dataclass(frozen=True)
class StepPlan:
    save: bool  # start a save of this step
    stop: bool  # wait until it is durable, then stop with StoppedOnRequest


def plan_boundary(*, step: int, max_steps: int, due: bool, requested: bool, last_saved_step: int | None) -> StepPlan:
    """Save and/or stop after ``step``. A request at ``maxSteps`` is moot (the run ends anyway, with
    its final save); a request at a step already saved (restored, or saved just now) stops at once."""
    already = last_saved_step == step
    if step >= max_steps:
        return StepPlan(save=not already, stop=False)
    return StepPlan(save=(due or requested) and not already, stop=requested)


# ----------------------------------------------------------------------------- the request, on one rank


def request_matches(payload: dict[str, Any], *, allocation_id: str, epoch: int) -> str | None:
    """Why a request file does not apply to this rank (None when it does). Pure."""
    their_allocation = payload.get("allocationId")
    if their_allocation != allocation_id:
        return f"it is for allocation {their_allocation!r}, this rank belongs to {allocation_id!r}"
    try:
        their_epoch = int(payload.get("epoch", -1))
    except (TypeError, ValueError):
        return f"its epoch {payload.get('epoch')!r} is not a number"
    if their_epoch < epoch:
        return f"its epoch {their_epoch} is older than this allocation's {epoch}"
    return None


class CheckpointRequest:
    """The flag a ``SIGUSR1`` sets, and the request file; :meth:`requested` is asked once per step.

    ``install()`` / ``close()`` (idempotent) or ``with``. The handler does nothing but set a flag:
    it may run between any two bytecodes of the training loop.
    """

    def __init__(self, request_file: Path, *, allocation_id: str, epoch: int) -> None:
        self.request_file = request_file
        self.allocation_id = allocation_id
        self.epoch = epoch
        self._signalled = threading.Event()
        self._from_file = False
        self._ignored_file_mtime: float | None = None
        self._previous: Any = None
        self._installed = False

    def install(self) -> CheckpointRequest:
        if threading.current_thread() is threading.main_thread() and not self._installed:
            self._previous = signal.signal(REQUEST_SIGNAL, self._on_signal)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            signal.signal(REQUEST_SIGNAL, self._previous if self._previous is not None else signal.SIG_IGN)
            self._installed = False

    def __enter__(self) -> CheckpointRequest:
        return self.install()

    def __exit__(self, *_: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled.set()

    @property
    def signalled(self) -> bool:
        return self._signalled.is_set()

    def requested(self) -> bool:
        """Whether this rank has been asked to checkpoint and stop (signal or request file)."""
        return self.signalled or self._file_requests()

    def _file_requests(self) -> bool:
        if self._from_file:
            return True
        try:
            stat = self.request_file.stat()
        except OSError:
            return False
        if stat.st_mtime == self._ignored_file_mtime:
            return False
        try:
            payload = json.loads(self.request_file.read_text())
            why_not = request_matches(payload, allocation_id=self.allocation_id, epoch=self.epoch) \
                if isinstance(payload, dict) else "it is not a JSON object"
        except (OSError, ValueError) as exc:
            why_not = f"it cannot be read: {exc}"
        if why_not is not None:
            log.warning("ignoring checkpoint request file %s: %s", self.request_file, why_not)
            self._ignored_file_mtime = stat.st_mtime
            return False
        log.info("checkpoint requested (%s): %s", self.request_file, payload.get("reason"))
        self._from_file = True
        return True
