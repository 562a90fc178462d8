"""Checkpoint on request, then stop: what a rank does with a CheckpointRequested (preemption, pause).

The node agent delivers a request two ways: ``SIGUSR1`` to the rank's process group (the launcher
ignores it; the handler here only sets a flag) and a request file in the attempt directory (it
survives an agent restart and covers a signal sent before the handler was installed). At each
step boundary the ranks agree, in the one small all-reduce MAX of the step (:func:`boundary_flags`),
on ``[due, requested, save not done, save failed]``; when anyone was asked, every rank saves at
that same global step (unless that step is already saved), waits until its shard is durable and
its ShardWritten spooled, and leaves with :class:`StoppedOnRequest` (exit 7, reason preempted).
The decisions are pure (:func:`plan_boundary`); :class:`CheckpointRequest` is the I/O.
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

from trainyard_common.errors import TrainyardError

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
    """What all ranks agreed at a step boundary (the element-wise MAX of :func:`boundary_flags`)."""

    due: bool  # a save is due by the schedule on some rank
    requested: bool  # some rank was asked to checkpoint and stop
    save_done: bool  # the pending asynchronous save (if any) has finished on every rank
    save_failed: bool  # it failed on some rank


def boundary_flags(*, due: bool, requested: bool, pending: bool, not_done: bool, failed: bool) -> list[int]:
    """This rank's contribution to the step's all-reduce MAX (``pending``: a save is in flight)."""
    return [int(due), int(requested), int(pending and not_done), int(pending and failed)]


def agreed(flags: list[int]) -> Boundary:
    """The reduced flags as a :class:`Boundary`; MAX makes any rank's "yes" everyone's."""
    due, requested, not_done, failed = (int(v) for v in flags)
    return Boundary(due=due > 0, requested=requested > 0, save_done=not_done == 0, save_failed=failed > 0)


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
