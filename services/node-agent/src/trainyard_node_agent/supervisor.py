"""One rank's supervisor: applies its lifecycle (:func:`supervision.transition`) to its process, relays its
spool while it runs, and once it ended drains the spool, reports how it ended (WorkerExited) and kills what
it left in its process group.

Order: a rank's spool is drained completely before its WorkerExited is staged, so a final ShardWritten or
StepMetrics never arrives after the exit that follows it.

The files a rank can write (its exit note, its spool, its log, the exit file beside them) are read off the
event loop and only as small regular files (:mod:`trainyard_contract.rankfiles`): a FIFO, a symlink to
``/dev/zero`` or a 20 GB note never stops the agent's heartbeats; the exit is reported with the refusal
in its detail (``exit note refused: not a regular file (a FIFO)``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from trainyard_contract.events import WorkerExited
from trainyard_runtime.outbox import Outbox

from trainyard_node_agent import backoff
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.announcements import Announcements
from trainyard_node_agent.classify import ExitFacts, classify_exit
from trainyard_node_agent.clock import Clock
from trainyard_node_agent.log_shipper import LogShipper
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.spool_relay import SpoolRelay
from trainyard_node_agent.supervision import Action, Trigger, exit_causes, transition
from trainyard_node_agent.watchdog import Liveness, observe

log = logging.getLogger(__name__)
LOST_EXIT_CODE = -9


def baseline(rank: rp.RankProcess, now: float) -> Liveness:
    """A fresh hang window from ``now``, measured from the rank's files as they are (launch, adoption)."""
    return Liveness(now, spool_bytes=rp.file_size(rank.spool.path), log_bytes=rp.file_size(rank.log_path),
                    reported=rank.liveness.reported, printed=rank.liveness.printed)


def noted_step(rank: rp.RankProcess) -> tuple[int | None, str | None]:
    """(the step WorkerExited reports, why the exit note was refused or None). The step is the trainer's exit
    note (its last step, the failing one after a NaN, the one it checkpointed at when asked to stop), else the
    last StepMetrics relayed. Call it off the event loop."""
    noted, refused = rp.read_note(rank.note_file)
    return (noted if noted is not None else rank.last_step), refused


def _with(detail: str | None, *more: str | None) -> str | None:
    parts = [p for p in (detail, *more) if p]
    return "; ".join(parts) if parts else None


@dataclass(frozen=True)
class SupervisorContext:
    """What the supervisors of this node's ranks share."""

    settings: NodeAgentSettings
    clock: Clock
    relay: SpoolRelay
    outbox: Outbox
    announcements: Announcements
    closing: Callable[[], bool]  # the agent is stopping: retries give up sooner
    logs: LogShipper | None = None  # an object-store root: rank logs are shipped there as they grow


class RankSupervisor:
    """Supervises one rank (launched, adopted, or a record that never started and only has an exit to report)."""

    def __init__(self, rank: rp.RankProcess, context: SupervisorContext) -> None:
        self.rank = rank
        self.context = context

    def apply(self, trigger: Trigger, detail: str | None = None) -> Coroutine[Any, Any, None] | None:
        """Move the rank on (:func:`supervision.transition`) and signal its process group as the step says. A
        graceful stop takes a while: it is returned (a coroutine) for the caller to await or run in the background."""
        rank = self.rank
        step = transition(rank.state, trigger, running=rank.running)
        if step.state is not rank.state and detail is not None:
            rank.stop_detail = detail
        rank.state = step.state
        stop = None
        for action in step.actions:
            if action is Action.KILL:
                rp.signal_group(rank.pgid, signal.SIGKILL)
            elif action is Action.SIGNAL_CHECKPOINT:
                delivered = rp.signal_group(rank.pgid, signal.SIGUSR1)
                log.info("asked rank %s to checkpoint and stop: %s", rank.key,
                         "signalled" if delivered else "request file only (the process group is gone)")
            elif action is Action.TERMINATE:
                stop = rp.stop(rank, self.context.settings.kill_grace_s, clock=self.context.clock)
        return stop

    def restart_hang_window(self) -> None:
        """Judge the rank's progress from now on (after a launch, an adoption, a wait that was not its fault)."""
        self.rank.liveness = baseline(self.rank, self.context.clock.monotonic())

    async def run(self) -> None:
        """Relay the spool while the rank runs; after it ends, drain it, report how it ended, and kill whatever
        the rank left in its process group."""
        while True:
            ended = await self._wait_a_little()
            self.note_progress()
            await self.context.relay.relay(self.rank, quiet=True)
            if self.context.logs is not None:
                await self.context.logs.ship(self.rank)
            if ended:
                break
        spool_refused = await self.context.relay.drain(self.rank)
        await self._ship_the_rest_of_the_log()
        code, reason, detail = await asyncio.to_thread(self.how_it_ended)
        await self.report_exit(code, reason, _with(detail, spool_refused))
        rp.signal_group(self.rank.pgid, signal.SIGKILL)

    async def report_unwatched(self) -> None:
        """A rank that ended while no agent watched it: relay the rest of its spool, report its exit
        (from the launcher's exit file; ``lost`` without one)."""
        spool_refused = await self.context.relay.drain(self.rank)
        await self._ship_the_rest_of_the_log()
        code, reason, detail = await asyncio.to_thread(self.how_it_ended)
        if reason != "lost":
            detail = (detail + "; " if detail else "") + "it ended while its node agent was down"
        await self.report_exit(code, reason, _with(detail, spool_refused))

    async def _ship_the_rest_of_the_log(self) -> None:
        """All of an ended rank's log to the object store, before its exit is reported (one try: a failure
        is logged, and the node keeps the file)."""
        if self.context.logs is not None:
            await self.context.logs.ship(self.rank, final=True)

    async def _wait_a_little(self) -> bool:
        """Up to one spool poll; True once the rank has ended."""
        rank, poll_s = self.rank, self.context.settings.spool_poll_s
        if rank.process is not None:
            return await rp.wait_exited(rank.process, poll_s)
        await self.context.clock.sleep(poll_s)
        if not rp.same_process(rank.pgid, rank.start_ticks):
            rank.gone = True
        return rank.gone

    def note_progress(self) -> None:
        """Measure the rank's spool (and, for user code, its log) and let the watchdog judge the growth."""
        rank = self.rank
        rank.liveness = observe(rank.liveness, spool_bytes=rp.file_size(rank.spool.path),
                                log_bytes=rp.file_size(rank.log_path) if rank.code_archive else None,
                                now=self.context.clock.monotonic())

    def how_it_ended(self) -> tuple[int, str, str | None]:
        """(exit code, reason, detail) from the exit file, the process and the log. It reads files the rank
        could have replaced (bounded, never blocking): call it off the event loop."""
        rank = self.rank
        recorded, exit_refused = rp.read_exit(rank.exit_file)
        causes = exit_causes(rank.state, rank.stop_detail)
        lost = None
        if recorded is not None:
            code = recorded
        elif rank.process is not None and rank.process.returncode is not None:
            code = rank.process.returncode
        else:
            code = LOST_EXIT_CODE
            if not causes.stopped_by_agent:
                lost = "the rank ended while this node agent was not its parent, and no exit status was recorded"
        now_ooms = rp.oom_kills(None, rank.oom_files) if rank.oom_kills_at_start is not None else None
        ooms = max((now_ooms or 0) - (rank.oom_kills_at_start or 0), 0) if now_ooms is not None else 0
        reason, detail = classify_exit(ExitFacts(
            exit_code=code, log_tail=rp.log_tail(rank.log_path) if code != 0 else "",
            revoked=causes.revoked, hang=causes.hang, lost=lost, oom_kills=ooms,
            user_code=rank.code_archive is not None, progressed=rank.progressed,
            start_error=rp.read_start_error(rank.exit_file) if code != 0 else None, violation=causes.violation,
        ))
        return code, reason, _with(detail if detail is not None else causes.fallback_detail, exit_refused)

    async def report_exit(self, code: int, reason: str, detail: str | None) -> None:
        """Stage WorkerExited in the outbox (retried while Redis is away) and wait for it to be seen applied."""
        rank, context = self.rank, self.context
        step, note_refused = await asyncio.to_thread(noted_step, rank)  # the note is the rank's file
        if note_refused:
            log.warning("rank %s: %s", rank.key, note_refused)
        event = WorkerExited(
            job_id=rank.job_id, attempt=rank.attempt, allocation_id=rank.allocation_id, epoch=rank.epoch,
            node_id=context.settings.node_id, rank=rank.rank, exit_code=code, reason=reason,
            detail=_with(detail, note_refused), global_step=step, saved_step=rank.saved_step,
            generation=rank.generation,
        )
        if not await backoff.retry(  # Redis away: the exit must still be reported
                lambda: context.outbox.put(event, traceparent=rank.traceparent),
                policy=backoff.INFRASTRUCTURE, clock=context.clock, what=f"recording the exit of {rank.key}",
                give_up=backoff.closing_and_capped(context.closing, backoff.INFRASTRUCTURE)):
            return
        await context.announcements.track(event, "exited", rank, rank.traceparent)
        log.info("rank %d of %s exited with %d (%s%s)", rank.rank, rank.allocation_id, code, reason,
                 f": {detail}" if detail else "")
