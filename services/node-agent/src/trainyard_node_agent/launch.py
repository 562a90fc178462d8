"""A GangAllocated on this node: admission, then the launch of this node's ranks of it.

Admission (fencing, design.md §5): the decision is :func:`admission.judge`, pure; around it this module reads
what it judges (the highest epoch seen for the job, kept in Redis so it survives restarts; the device leases)
and records what it decided (a refusal in the node's recent-refusals list; the allocation id in the set of
those launched here, so each is launched at most once; the new highest epoch).

The launch: the allocation file, the rendezvous port (the node hosting rank 0 checks it is free), the job's
code tree (pinned in the code cache while its ranks start) and environment (``code.environment``: pinned in the
environment cache, built first if this node has not got it), then each rank (:class:`RankStarter`) inside the
attempt's open scope (:meth:`Attempts.launching`). A rank that cannot start reports its exit.

A job with an environment is launched off the allocation consumer (a build may take minutes: other jobs'
allocations to this node go on meanwhile); after its environment is ready the allocation is judged again (it
may have been revoked, or its leases released, while it was built).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from trainyard_contract.codetree import CodeTreeError
from trainyard_contract.errors import ConfigError
from trainyard_contract.events import GangAllocated, NodeAssignment
from trainyard_contract.exitcodes import CONFIG, PORT_IN_USE
from trainyard_contract.spec import Code
from trainyard_contract.storage import ArtifactLayout, atomic_write_bytes
from trainyard_contract.tracing import current_traceparent

from trainyard_node_agent.admission import (
    Launch,
    Refuse,
    hosted_ports,
    judge,
    port_taken,
)
from trainyard_node_agent.attempts import Attempts
from trainyard_node_agent.clock import Clock
from trainyard_node_agent.codecache import CodeCache, CodeTree
from trainyard_node_agent.confinement import Confinement
from trainyard_node_agent.envprep import EnvironmentPreparer, Prepared
from trainyard_node_agent.leases import lease_holders
from trainyard_node_agent.lifecycle import Background, Lifecycle
from trainyard_node_agent.rank_network import port_in_use
from trainyard_node_agent.rank_start import RankStarter
from trainyard_node_agent.rank_table import RankTable
from trainyard_node_agent.replicas import ReplicaRestarts
from trainyard_node_agent.settings import NodeAgentSettings

log = logging.getLogger(__name__)
REFUSALS_KEPT = 100


class AllocationLauncher:
    """The GangAllocated handler: admit (fenced), then launch this node's ranks of the allocation."""

    def __init__(self, redis: Any, settings: NodeAgentSettings, keys: Any, *, node_layout: ArtifactLayout,
                 backend: str, sandbox: Confinement, code_cache: CodeCache, environments: EnvironmentPreparer,
                 table: RankTable, attempts: Attempts, starter: RankStarter, lifecycle: Lifecycle,
                 background: Background, clock: Clock) -> None:
        self.redis, self.settings, self.keys, self.node_layout = redis, settings, keys, node_layout
        self.backend, self.sandbox, self.code_cache, self.environments = backend, sandbox, code_cache, environments
        self.table, self.attempts, self.starter = table, attempts, starter
        self.lifecycle, self.background, self.clock = lifecycle, background, clock
        self.replicas: ReplicaRestarts | None = None  # set by the agent: fault-tolerant attempts' part

    async def on_gang_allocated(self, event: GangAllocated) -> None:
        node = self.settings.node_id
        share = next((n for n in event.nodes if n.node_id == node), None)
        if share is None:
            return
        if self.lifecycle.closing:
            # Our last heartbeat said "unhealthy": the scheduler fails this attempt as lost and
            # places it elsewhere; holding the message would only delay the shutdown.
            log.warning("not launching allocation %s: the node agent is stopping", event.allocation_id)
            return
        raw_epoch = await self.redis.hget(self.keys.epochs, event.job_id)
        holders = await lease_holders(self.redis, node, [s.device_index for s in share.ranks])
        decision = judge(event, node, highest_epoch=int(raw_epoch) if raw_epoch else None, lease_holders=holders)
        if isinstance(decision, Refuse):
            await self._refuse(event, decision.reason)
            return
        assert isinstance(decision, Launch)
        if not await self.redis.sadd(self.keys.launched, event.allocation_id):
            log.info("allocation %s was launched here before; not launching it again", event.allocation_id)
            return
        if raw_epoch is None or event.epoch > int(raw_epoch):
            await self.redis.hset(self.keys.epochs, event.job_id, event.epoch)
        if event.spec.code is not None and event.spec.code.environment is not None:
            self.background.spawn(self._launch_logged(event, decision))
        else:
            await self.launch(event, decision)

    async def _launch_logged(self, event: GangAllocated, decision: Launch) -> None:
        try:
            await self.launch(event, decision)
        except Exception:
            log.exception("launching allocation %s of job %s failed", event.allocation_id, event.job_id)

    async def _refuse(self, event: GangAllocated, reason: str) -> None:
        log.warning("refusing allocation %s of job %s (epoch %d): %s", event.allocation_id, event.job_id,
                    event.epoch, reason)
        entry = json.dumps({"allocationId": event.allocation_id, "jobId": event.job_id, "epoch": event.epoch,
                            "attempt": event.attempt, "reason": reason, "at": self.clock.wall()})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self.keys.refused, entry)
            pipe.ltrim(self.keys.refused, 0, REFUSALS_KEPT - 1)
            await pipe.execute()

    async def launch(self, event: GangAllocated, decision: Launch, *, generation: int = 0,
                     only_rank: int | None = None) -> None:
        """Start this node's ranks of the allocation: the built-in trainer (``rank_command``), or the job's
        own code (``spec.code``: its verified tree from the code cache, its entrypoint, cold).

        ``only_rank`` / ``generation``: a fault-tolerant attempt's replaced replica, started again alone into the
        running allocation (:mod:`~trainyard_node_agent.replicas`: fenced there)."""
        share = decision.share
        traceparent = current_traceparent()
        attempt_dir = self.node_layout.attempt_dir(event.tenant, event.job_id, event.attempt)
        allocation_file = attempt_dir / f"allocation.{self.settings.node_id}.json"
        if only_rank is None:
            atomic_write_bytes(allocation_file, event.to_bytes())
            for what, port in hosted_ports(event, share):  # a squatter fails nothing: an interruption, other ports
                if why := await asyncio.to_thread(port_in_use, port):
                    await self._refuse_all(event, share, traceparent, 127, PORT_IN_USE,
                                           port_taken(event, self.settings.node_id, why, what=what, port=port))
                    return
            if self.replicas is not None:
                await self.replicas.remember(event)
                await self.replicas.lighthouses.ensure(event, share)
        code = event.spec.code
        tree = await self._prepare_code(event, share, code, traceparent) if code is not None else None
        if code is not None and tree is None:
            return
        env = None
        if code is not None and code.environment is not None and tree is not None:
            env = await self._prepare_environment(event, share, code, tree, traceparent)
            if env is None:
                self.code_cache.release(tree.hex)
                return
        async with self.attempts.launching(event.job_id, event.attempt):  # closed after when no rank of it started
            try:
                for slot in share.ranks:
                    if only_rank is None or slot.rank == only_rank:
                        await self.starter.start(event, share, slot, allocation_file, traceparent, tree, env,
                                                 generation=generation)
            finally:
                if tree is not None:
                    self.code_cache.release(tree.hex)
                if env is not None:
                    self.environments.release(env)
        await asyncio.to_thread(self.sandbox.detach_shm, event.job_id, event.attempt,
                                [s.rank.exit_file for s in self.table.of_allocation(event.allocation_id)])
        if tree is not None and tree.materialised or env is not None and env.entry.materialised:
            self.background.spawn(self.attempts.collect_code())
        running = "" if code is None else f", code {code.archive} {code.entrypoint}"
        if env is not None:
            running += f", environment {env.environment}"
        if code is not None and code.image:
            running += f", image {code.image}"
        if generation:
            running += f", replica generation {generation}"
        log.info("launched ranks %s of job %s attempt %d (allocation %s, epoch %d, backend %s%s)",
                 [s.rank for s in share.ranks if only_rank is None or s.rank == only_rank], event.job_id,
                 event.attempt, event.allocation_id,
                 event.epoch, self.backend, running)

    async def _prepare_code(self, event: GangAllocated, share: NodeAssignment, code: Code,
                            traceparent: str | None) -> CodeTree | None:
        """The verified tree of the job's code (pinned); None when it cannot be had (every rank here is
        reported: ``config`` for the job's fault, ``error`` for this node's)."""
        try:
            tree = await self.code_cache.acquire(event.tenant, code)
        except CodeTreeError as exc:
            log.error("not running job %s attempt %d: its code cannot be used: %s", event.job_id, event.attempt, exc)
            exit_code, reason, detail = CONFIG, "config", str(exc)
        except OSError as exc:  # this node's trouble (disk full, …): retried, elsewhere if it persists
            log.error("cannot prepare the code of job %s attempt %d here: %r", event.job_id, event.attempt, exc)
            exit_code, reason, detail = 127, "error", f"cannot prepare the code tree on this node: {exc}"
        else:
            if code.image:  # see deploy/k8s/README.md: ranks run in the agent's container, not in code.image
                log.warning("job %s names the image %s for its ranks; this node agent runs them as its own "
                            "processes, in its own image", event.job_id, code.image)
            return tree
        await self._refuse_all(event, share, traceparent, exit_code, reason, detail)
        return None

    async def _prepare_environment(self, event: GangAllocated, share: NodeAssignment, code: Code, tree: CodeTree,
                                   traceparent: str | None) -> Prepared | None:
        """The job's environment (pinned), still for an allocation that is ours; None when it cannot be had or
        the allocation went while it was built (every rank here is reported, as for the code tree)."""
        assert code.environment is not None
        try:
            env = await self.environments.prepare(event, code.environment, tree)
        except ConfigError as exc:
            log.error("not running job %s attempt %d: its environment cannot be built: %s", event.job_id,
                      event.attempt, exc)
            await self._refuse_all(event, share, traceparent, CONFIG, "config", f"code.environment: {exc}")
            return None
        except OSError as exc:  # this node's trouble (the index unreachable, disk full, …): retried
            log.error("cannot build the environment of job %s attempt %d here: %r", event.job_id, event.attempt, exc)
            await self._refuse_all(event, share, traceparent, 127, "error",
                                   f"cannot build the job's environment on this node: {exc}")
            return None
        raw_epoch = await self.redis.hget(self.keys.epochs, event.job_id)
        holders = await lease_holders(self.redis, self.settings.node_id, [s.device_index for s in share.ranks])
        again = judge(event, self.settings.node_id, highest_epoch=int(raw_epoch) if raw_epoch else None,
                      lease_holders=holders)
        if isinstance(again, Refuse):  # revoked or released while it was built: nothing to start any more
            self.environments.release(env)
            await self._refuse(event, f"after preparing its environment: {again.reason}")
            return None
        return env

    async def _refuse_all(self, event: GangAllocated, share: NodeAssignment, traceparent: str | None,
                          exit_code: int, reason: str, detail: str) -> None:
        """No rank of ``share`` starts: each reports why (its WorkerExited)."""
        for slot in share.ranks:
            record = self.starter.record(event, slot, traceparent, code=event.spec.code)
            await self.attempts.supervisor(record).report_exit(exit_code, reason, detail)
