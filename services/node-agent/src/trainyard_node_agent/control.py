"""What stops the ranks here, or asks them to: a revocation, a checkpoint request (preemption, pause, a
drain), a forgery the spool relay found, a hang, a lost device lease. Each decides from the rank table and
applies a trigger to the rank's supervisor (:func:`supervision.transition` says what it does); none of them
kills a process itself.

Checkpoint on request (design.md §6): the request is written to the attempt directory
(``checkpoint-request.json``: it outlives this agent and a signal sent too early) and signalled (SIGUSR1 to
each rank's process group); until its deadline the hang watchdog leaves the ranks alone. Duplicates are
no-ops, and so is anything with an epoch older than the ranks'.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

from trainyard_contract.events import (
    AllocationRevoked,
    CheckpointRequested,
    SecurityViolation,
)
from trainyard_contract.storage import ArtifactLayout, atomic_write_bytes
from trainyard_runtime.service import ServiceRuntime

from trainyard_node_agent import ranks as rp
from trainyard_node_agent.attempt_files import checkpoint_request_file
from trainyard_node_agent.clock import Clock, wall_datetime
from trainyard_node_agent.leases import lease_holders
from trainyard_node_agent.lifecycle import Background, Lifecycle
from trainyard_node_agent.rank_table import RankTable
from trainyard_node_agent.relay import Refusal
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.supervision import RankState, Trigger, transition
from trainyard_node_agent.supervisor import RankSupervisor
from trainyard_node_agent.watchdog import RankProgress, find_hangs

log = logging.getLogger(__name__)


class RankControl:
    """The handlers and watchdogs that stop ranks (revocation, checkpoint request, violation, hang, lease)."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, table: RankTable, *,
                 node_layout: ArtifactLayout, lifecycle: Lifecycle, background: Background, clock: Clock) -> None:
        self.runtime, self.settings, self.table = runtime, settings, table
        self.node_layout, self.lifecycle, self.background, self.clock = node_layout, lifecycle, background, clock
        # fault-tolerant allocations launched here (kept by ReplicaRestarts): a hang stops only the late replicas
        self.replicated: set[str] = set()

    # ------------------------------------------------------------------ handlers
    async def on_allocation_revoked(self, event: AllocationRevoked) -> None:
        targets = self.table.of_allocation(event.allocation_id)
        if not targets:
            return
        if event.epoch < targets[0].rank.epoch:
            log.warning("ignoring revocation of %s with stale epoch %d < %d", event.allocation_id,
                        event.epoch, targets[0].rank.epoch)
            return
        log.info("revoking allocation %s (%s): stopping %d rank(s)", event.allocation_id, event.reason,
                 sum(s.rank.running for s in targets))
        for supervisor in targets:
            self.revoke(supervisor, event.reason)

    async def on_checkpoint_requested(self, event: CheckpointRequested) -> None:
        """Ask this allocation's ranks here to checkpoint and stop: request file, then SIGUSR1."""
        targets = [s for s in self.table.of_allocation(event.allocation_id) if s.rank.running]
        if not targets:
            return
        if event.epoch < targets[0].rank.epoch:
            log.warning("ignoring checkpoint request for %s with stale epoch %d < %d", event.allocation_id,
                        event.epoch, targets[0].rank.epoch)
            return
        fresh = [s for s in targets if transition(s.rank.state, Trigger.CHECKPOINT_REQUESTED, running=True).actions]
        if not fresh:
            log.info("checkpoint request for %s already delivered; ignoring the duplicate", event.allocation_id)
            return
        first = fresh[0].rank
        request_file = checkpoint_request_file(self.node_layout, first.tenant, first.job_id, first.attempt)
        atomic_write_bytes(request_file, event.to_bytes())
        log.info("checkpoint requested for %d rank(s) of %s (%s%s)", len(fresh), event.allocation_id, event.reason,
                 f", for {event.requested_by}" if event.requested_by else "")
        now = self.clock.monotonic()
        grace = (event.deadline.timestamp() - self.clock.wall()) if event.deadline else self.settings.hang_timeout_s
        for supervisor in fresh:
            rank = supervisor.rank
            rank.checkpoint_deadline = now + max(grace, 0.0)
            rank.liveness = rank.liveness.restarted(now)  # a fresh hang window once the deadline has passed
            supervisor.apply(Trigger.CHECKPOINT_REQUESTED)

    def revoke(self, supervisor: RankSupervisor, why: str) -> None:
        stop = supervisor.apply(Trigger.REVOKED, why)
        if stop is not None:
            self.background.spawn(stop)

    async def violation(self, rank: rp.RankProcess, refusal: Refusal) -> None:
        """A rank claimed what a rank may not (the spool relay found a forgery): report SecurityViolation (the
        scheduler fails the job, no retries) and stop every rank of its allocation here, which then exit with
        reason ``security``."""
        log.error("SECURITY: rank %d of job %s (tenant %s) attempt %d: %s; stopping its ranks on this node",
                  rank.rank, rank.job_id, rank.tenant, rank.attempt, refusal.reason)
        first = rank.state is not RankState.VIOLATED
        for other in self.table.of_allocation(rank.allocation_id):
            other.apply(Trigger.VIOLATION, refusal.reason if other.rank is rank
                        else f"rank {rank.rank} of this job was stopped: {refusal.reason}")
        if not first:
            return
        await self.runtime.outbox.put(SecurityViolation(
            job_id=rank.job_id, tenant=rank.tenant, attempt=rank.attempt, allocation_id=rank.allocation_id,
            epoch=rank.epoch, node_id=self.settings.node_id, rank=rank.rank, detail=refusal.reason,
            refused_event_type=refusal.event_type,
        ), traceparent=rank.traceparent)

    # ------------------------------------------------------------------ watchdogs
    async def check_hangs(self) -> None:
        """Stop every rank here of an attempt that made no progress within the hang timeout."""
        if not self.lifecycle.serving:
            return
        supervisors = self.table.looked_after()
        for supervisor in supervisors:  # judge what the files say now, not what a busy watcher last saw
            supervisor.note_progress()
        now = self.clock.monotonic()
        progress = [RankProgress(r.allocation_id, r.rank, r.pid, now - r.liveness.at, r.progressed,
                                 rp.proc_state(r.pid),
                                 saving_on_request=r.checkpoint_deadline is not None and now < r.checkpoint_deadline,
                                 output_counts=r.code_archive is not None)
                    for r in (s.rank for s in supervisors)]
        for hung in find_hangs(progress, timeout_s=self.settings.hang_timeout_s,
                               first_step_timeout_s=self.settings.first_step_timeout_s):
            replicated = hung.allocation_id in self.replicated  # a fault-tolerant attempt: only the late replicas
            targets = [s for s in supervisors if s.rank.allocation_id == hung.allocation_id
                       and (not replicated or s.rank.rank in hung.ranks)]
            log.error("allocation %s is hung (%s): killing its %d rank(s) here", hung.allocation_id, hung.detail,
                      len(targets))
            for supervisor in targets:
                supervisor.apply(Trigger.HUNG, hung.detail)

    async def check_leases(self) -> None:
        """Stop running ranks whose allocation no longer holds their device lease."""
        running = self.table.looked_after()
        if not running:
            return
        holders = await lease_holders(self.runtime.redis, self.settings.node_id,
                                      sorted({s.rank.device_index for s in running}))
        for supervisor in running:
            rank = supervisor.rank
            holder: dict[str, Any] | None = holders.get(rank.device_index)
            if holder is None or holder.get("allocationId") != rank.allocation_id:
                now_held = f"is leased to {holder.get('allocationId')}" if holder else "is no longer leased"
                why = (f"device {self.settings.node_id}:{rank.device_index} {now_held}: allocation "
                       f"{rank.allocation_id} was released (its revocation did not reach this agent)")
                log.warning("stopping rank %s: %s", rank.key, why)
                self.revoke(supervisor, why)

    # ------------------------------------------------------------------ a planned stop
    async def drain(self) -> None:
        """A planned stop: ask every running allocation here to checkpoint and stop (the pause protocol: the
        ranks agree on a step, save it, exit 7), then wait up to ``drain_timeout_s`` for them to end."""
        timeout = self.settings.drain_timeout_s
        live = [s.rank for s in self.table.looked_after()]
        if timeout <= 0 or not live:
            return
        deadline = wall_datetime(self.clock) + timedelta(seconds=timeout)
        for allocation_id in sorted({r.allocation_id for r in live}):
            first = next(r for r in live if r.allocation_id == allocation_id)
            await self.on_checkpoint_requested(CheckpointRequested(
                job_id=first.job_id, attempt=first.attempt, allocation_id=allocation_id, epoch=first.epoch,
                reason=f"drain: node agent {self.settings.node_id} is stopping", deadline=deadline))
        log.info("draining: %d rank(s) asked to checkpoint and stop; waiting up to %.0fs", len(live), timeout)
        watchers = [r.watcher for r in live if r.watcher]
        if watchers:
            await asyncio.wait(watchers, timeout=timeout)
        left = [r for r in self.table.records() if r.running]
        log.info("drained: %d rank(s) stopped at a checkpoint%s", len(live) - len(left),
                 f"; {len(left)} still running are stopped now" if left else "")
