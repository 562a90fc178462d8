"""A job write and what follows it: the transaction (:mod:`jobtx`), then leases released, the pass woken, nodes blamed.

Every change the scheduler makes to a job goes through :meth:`JobWriter.mutate` (design.md §3.7): the handlers',
the pass's (waits, preemptions, drains) and the reconcile's. The decision inside is a pure function of
:mod:`trainyard_scheduler.transitions`; what this module adds is the I/O a written outcome asks for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from trainyard_contract.devices import Device
from trainyard_contract.errors import FencingError, StaleLeaderError

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.fencing import FencedLeases
from trainyard_scheduler.jobtx import Decide, JobTransactions
from trainyard_scheduler.node_health import NodeHealth

log = logging.getLogger(__name__)

WakeAt = Callable[[datetime | None], None]


class JobWriter:
    """One job transaction plus its consequences; shared by every part of the scheduler that changes a job."""

    def __init__(self, jobs: JobTransactions, leases: FencedLeases, nodes: NodeHealth, policy: tr.RetryPolicy, *,
                 wake_at: WakeAt) -> None:
        self.jobs, self.leases, self.nodes, self.policy = jobs, leases, nodes, policy
        self._wake_at = wake_at

    async def mutate(self, job_id: str, decide: Decide, *, need_checkpoints: bool = False,
                     label: str = "update", fence: int | None = None) -> tr.Outcome | None:
        """One job transaction (:meth:`JobTransactions.apply`), then what follows a written change: leases
        released, the pass woken, nodes blamed. None if the job is unknown.

        ``fence``: the leader epoch this write is made under; StaleLeaderError once another scheduler has taken over.
        """
        applied = await self.jobs.apply(job_id, decide, need_checkpoints=need_checkpoints, label=label, fence=fence)
        if applied is None:
            return None
        before, outcome = applied
        if not outcome.changed:
            return outcome
        if outcome.release is not None:
            a = outcome.release
            devices = [Device(n, int(i)) for n, i in (d.rsplit(":", 1) for d in a.devices)]
            await self.release(a.allocation_id, a.epoch, devices)
        if tr.is_pending(outcome.job) and not tr.is_pending(before):  # requeued or resumed: place it ASAP
            self._wake_at(tr.retry_not_before(outcome.job, self.policy))
        elif outcome.release is not None:  # devices came free for whoever waits
            self._wake_at(None)
        for node_id, reason in outcome.blame:
            weight = self.nodes.reputation.weight(reason)
            if weight > 0:  # what the job's ranks said of themselves counts against the tenant's cap; silence does not
                bounded = self.nodes.reputation.tenant_bounded(reason)
                await self.nodes.blame_node(node_id, reason, weight, tenant=outcome.job.tenant if bounded else None)
        return outcome

    async def release(self, allocation_id: str, epoch: int, devices: list[Device], *,
                      fence: int | None = None) -> None:
        """Release an allocation's leases; a refusal is logged, except a stale leader's under ``fence`` (raised:
        the pass ends and the tick stands by)."""
        devices = [Device(d.node_id, int(d.index)) for d in devices]
        try:
            await self.leases.release(allocation_id, epoch, devices, leader_epoch=fence)
        except StaleLeaderError:
            if fence is not None:
                raise
            log.warning("release of %s refused: a newer leader took over", allocation_id)
        except FencingError as exc:
            log.warning("release of %s refused: %s", allocation_id, exc)
