"""The node agent: heartbeats this node's inventory, launches the ranks a GangAllocated
assigns to it, relays their event spools, watches them (exits, hangs, lost leases), reports how
they ended, and stops them when the allocation is revoked or the agent itself stops.

Fencing: an allocation is launched only if its epoch is not older than the highest this
node has seen for the job (kept in Redis, so it survives restarts) and every device it
names is leased to it right now; each allocation id is launched at most once. While ranks
run, their devices must stay leased to their allocation: a rank whose lease is gone (the
scheduler ended the attempt and the AllocationRevoked never arrived) is stopped.

Checkpoint on request (preemption, pause): a CheckpointRequested for an allocation with ranks
running here, and an epoch not older than theirs, is written to the attempt directory
(``checkpoint-request.json``: it outlives this agent and a signal sent too early) and signalled
(SIGUSR1 to each rank's process group; the launcher ignores it, the trainer sets a flag). The
ranks agree at the next step boundary, save that step, and exit 7, reported as ``preempted``.
Until the request's deadline the hang watchdog leaves them alone. Duplicates are no-ops.
A planned stop (SIGTERM) uses the same protocol: the agent heartbeats ``draining`` and its boot id
(the scheduler drains the node until a new incarnation heartbeats), asks its own ranks to
checkpoint and stop, and waits up to ``drain_timeout_s`` before stopping what still runs.

Failure handling:

* a rank's exit is classified (:mod:`classify`: nan, oom, nccl, hang, exit code, …);
* hang: an attempt whose rank here wrote no event for ``hang_timeout_s`` (for user code: no event
  and no output to its log, :mod:`watchdog`) has all its ranks here killed at once (SIGKILL works
  on stopped processes too) and reported as ``hang``;
* control-plane outage: ranks run in their own session under a launcher that records their
  exit status, so a restarted agent *adopts* ranks that still run (pid + start time checked
  against reuse) instead of killing them, relays their spools from the persisted offsets, and
  reads their exit status from the launcher's exit file. The rank table lives in Redis and in
  a node-local file (used when Redis is down at start-up). While the broker or Redis is away,
  events wait in the spools and the outbox, heartbeats resume when they return.

Each rank has its :class:`~trainyard_node_agent.supervisor.RankSupervisor`: it applies the rank's
lifecycle (decided by :func:`supervision.transition`), relays its spool while it runs
(:class:`~trainyard_node_agent.spool_relay.SpoolRelay`) and reports how it ended. The agent keeps the
handlers, the launch, the node-wide loops (heartbeat, hangs, leases, warm pool) and the rank table.
Time comes from an injected :class:`~trainyard_node_agent.clock.Clock`; what fails while Redis or
the broker is away is retried by :func:`backoff.retry`; announcements are confirmed by
:class:`~trainyard_node_agent.announcements.Announcements`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from trainyard_contract.codetree import CodeTreeError, archive_hex
from trainyard_contract.events import (
    ALLOCATIONS,
    AllocationRevoked,
    CheckpointRequested,
    DeviceInfo,
    GangAllocated,
    NodeAssignment,
    NodeDrained,
    NodeHeartbeat,
    NodeUndrained,
    RankAssignment,
    SecurityViolation,
    WorkerStarted,
)
from trainyard_contract.exitcodes import CONFIG, PORT_IN_USE
from trainyard_runtime.service import ServiceRuntime
from trainyard_contract.spec import Code
from trainyard_contract.spool import SpoolReader
from trainyard_contract.storage import ArtifactLayout, atomic_write_bytes, path_to_uri
from trainyard_runtime.store import Keys
from trainyard_contract.tracing import current_traceparent

from trainyard_node_agent import backoff, kube
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.admission import (
    Launch,
    Refuse,
    cpu_thread_share,
    hosts_rendezvous,
    interpreter_env,
    judge,
    pick_backend,
    port_taken,
    rank_env,
)
from trainyard_node_agent.announcements import Announcements
from trainyard_node_agent.clock import SYSTEM_CLOCK, Clock, wall_datetime
from trainyard_node_agent.codecache import CodeCache, CodeTree, RankPaths, rank_paths
from trainyard_node_agent.confinement import Confined, Confinement, scrubbed
from trainyard_node_agent.localstate import LocalState, merge_tables
from trainyard_node_agent.log_shipper import LogShipper
from trainyard_node_agent.rank_network import RankNetwork, port_in_use
from trainyard_node_agent.relay import Refusal
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.spool_relay import SpoolRelay
from trainyard_node_agent.supervision import RankState, Trigger, transition, watched
from trainyard_node_agent.supervisor import RankSupervisor, SupervisorContext
from trainyard_node_agent.warmpool import WarmPool, auto_size, mem_available_bytes
from trainyard_node_agent.watchdog import RankProgress, find_hangs

log = logging.getLogger(__name__)
_REFUSALS_KEPT = 100
CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"  # in the attempt directory; read by trainyard_trainer


class AgentKeys:
    """Redis keys a node agent owns, per node."""

    def __init__(self, node_id: str) -> None:
        base = Keys.agent(node_id)
        self.epochs = f"{base}:epochs"  # job id -> highest epoch seen
        self.launched = f"{base}:launched"  # allocation ids ever launched here
        self.ranks = f"{base}:ranks"  # "<allocation>/<rank>" -> RankProcess.persisted()
        self.refused = f"{base}:refused"  # recent refusals, newest first (JSON)
        self.unconfirmed = f"{base}:unconfirmed"  # event id -> Announcement not yet seen applied (JSON)


def exit_file_for(layout: ArtifactLayout, tenant: str, job_id: str, attempt: int, rank: int) -> Path:
    """``<attempt dir>/exit/rank-<r>.json``: where the launcher records how the rank ended."""
    return layout.attempt_dir(tenant, job_id, attempt) / "exit" / f"rank-{rank}.json"


def checkpoint_request_file(layout: ArtifactLayout, tenant: str, job_id: str, attempt: int) -> Path:
    """``<attempt dir>/checkpoint-request.json``: the CheckpointRequested the ranks of the attempt read."""
    return layout.attempt_dir(tenant, job_id, attempt) / CHECKPOINT_REQUEST_FILE


class NodeAgent:
    """Wires the handlers, the heartbeat and the watchdogs onto a :class:`ServiceRuntime`."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, *,
                 base_env: Mapping[str, str], clock: Clock = SYSTEM_CLOCK) -> None:
        self.runtime = runtime
        self.settings = settings
        self.clock = clock
        self.redis = runtime.redis
        self.keys = AgentKeys(settings.node_id)
        self.layout = ArtifactLayout(settings.artifact_root)  # checkpoints, datasets: maybe an object store
        self.node_layout = ArtifactLayout(settings.local_root)  # attempts' own files (logs, spools), on this node
        # no broker/Redis addresses or credentials reach a rank, except those the operator passes on by name
        self.base_env = scrubbed(base_env) | {k: base_env[k] for k in settings.rank_pass_env if k in base_env}
        self.sandbox = Confinement(settings, self.layout, self.node_layout)
        # what sandboxed ranks may not connect to (the control plane): nftables rules on the job uid range
        self.rank_network = RankNetwork(settings.node_id, settings.node_rank_blocked, enforced=self.sandbox.enforced,
                                        first_uid=settings.sandbox_first_uid, uid_count=settings.sandbox_uid_count,
                                        scope=str(settings.agent_state_path.parent.resolve()),
                                        own_ports=[settings.metrics_port])
        self.backend = pick_backend(settings.backend, settings.device_type,
                                    has_nvidia_smi=shutil.which("nvidia-smi") is not None)
        self.group = f"{settings.group_prefix}.node-agent.{settings.node_id}"
        self.boot_id = uuid.uuid4().hex
        self.ranks: dict[str, RankSupervisor] = {}  # rank key -> the supervisor of a rank launched or adopted here
        # attempts whose ranks here are being launched: their scope stays open even while none of them is on the
        # table yet (a rank that ended at once must not close it under the ranks still to start)
        self._launching: set[tuple[str, int]] = set()
        self.local = LocalState(settings.agent_state_path)
        self._seq = 0
        self._closing = False
        self._serving = False
        self._background: set[asyncio.Task[None]] = set()
        self._unreported: dict[str, rp.RankProcess] = {}  # ended while no agent watched them
        self.announcements = Announcements(runtime, settings, self.keys.unconfirmed, clock)
        self._announced = self.announcements.pending  # published, not yet seen applied
        self._ranks_changed_at = float("-inf")  # monotonic time a rank last started or ended here
        self.spool_relay = SpoolRelay(runtime.bus, layout=self.layout, group=self.group,
                                      announcements=self.announcements, persist=self._persist,
                                      violation=self._violation, closing=lambda: self._closing, clock=clock)
        shipper = LogShipper(self.layout, clock, interval_s=settings.log_ship_interval_s) if self.layout.remote else None
        self._context = SupervisorContext(settings, clock, self.spool_relay, runtime.outbox, self.announcements,
                                          closing=lambda: self._closing, logs=shipper)
        self.kube = kube.KubeNodeWatch(settings.kube_api_url, settings.kube_node_name,
                                       token_file=settings.kube_token_file, ca_file=settings.kube_ca_file) \
            if settings.kube_node_name else None
        self.warm_ranks = settings.warm_ranks if settings.warm_ranks is not None else \
            auto_size(settings.device_count, mem_available_bytes())
        self.pool = WarmPool(
            self.warm_ranks, settings.warm_module,
            # one thread while importing: the rank's own share is set when it starts (TRAINYARD_CPU_THREADS)
            interpreter_env(self.base_env, cpu_threads=1 if settings.device_type == "cpu" else None,
                            extra=settings.rank_env),
            settings.agent_state_path.parent / "warm.log",
        ) if self.warm_ranks > 0 else None
        self._usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.code_cache = CodeCache(settings.code_cache_path, self.layout, max_bytes=settings.code_cache_max_bytes)

    def _cpu_threads(self, ranks_here: int) -> int | None:
        """Each rank's share of this node's cores, on a CPU node (None elsewhere: torch's default)."""
        if self.settings.device_type != "cpu":
            return None
        return cpu_thread_share(self._usable_cores, ranks_here, pinned=self.settings.cpu_threads_per_rank)

    def install(self) -> None:
        """The rank network rules (ConfigError: refuse to start), then subscribe (a group of its own: every agent
        sees every allocation), heartbeat, watchdogs."""
        self.rank_network.install()
        self.runtime.bus.subscribe(
            ALLOCATIONS,
            {GangAllocated: self.on_gang_allocated, AllocationRevoked: self.on_allocation_revoked,
             CheckpointRequested: self.on_checkpoint_requested},
            group=self.group, deduper_factory=self.runtime.deduper,
        )
        self.runtime.add_loop("heartbeat", self.heartbeat, self.settings.heartbeat_s)
        self.runtime.add_loop("hang-watchdog", self.check_hangs,
                              min(1.0, self.settings.hang_timeout_s / 4, self.settings.first_step_timeout_s / 4))
        self.runtime.add_loop("lease-check", self.check_leases, self.settings.lease_check_s)
        self.runtime.add_loop("local-state", self._flush_local_state, 1.0)
        self.runtime.add_loop("confirmations", self.announcements.confirm, self.settings.confirm_interval_s)
        if self.pool is not None:
            self.runtime.add_loop("warm-pool", self.refill_pool, 0.5)
        if self.kube is not None:
            self.runtime.add_loop("kubernetes-cordon", self.follow_cordon, self.settings.kube_poll_s)

    async def follow_cordon(self) -> None:
        """A cordoned (or `kubectl drain`-ed) Kubernetes node is drained; uncordoned, its drain ends."""
        assert self.kube is not None
        cordoned = await self.kube.cordoned()
        raw = await self.redis.hget(Keys.node_drain, self.settings.node_id)
        action = kube.cordon_action(cordoned, json.loads(raw) if raw else None)
        node = self.settings.node_id
        if action == "drain":
            log.warning("Kubernetes node %s is cordoned: draining it", self.kube.node_name)
            await self.runtime.bus.publish(NodeDrained(
                node_id=node, by=kube.KUBERNETES, reason=f"Kubernetes node {self.kube.node_name} cordoned (drain)"))
        elif action == "undrain":
            log.warning("Kubernetes node %s is schedulable again: its drain ends", self.kube.node_name)
            await self.runtime.bus.publish(NodeUndrained(
                node_id=node, by=kube.KUBERNETES, reason=f"Kubernetes node {self.kube.node_name} uncordoned"))

    async def prepare(self) -> None:
        """Before ``runtime.start()`` (Redis and the broker may still be down): adopt the ranks an
        earlier incarnation of this agent left running; note the ones that ended meanwhile."""
        local = self.local.load()
        shared: dict[str, Any] | None = None
        try:
            raw = await asyncio.wait_for(self.redis.hgetall(self.keys.ranks), 5.0)
            shared = {k: json.loads(v) for k, v in raw.items()}
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("Redis is unreachable at start-up (%r): using the local rank table %s",
                        exc, self.local.path)
        await self.announcements.load()
        for key, entry in merge_tables(*(t for t in (shared, local) if t is not None)).items():
            if entry.get("boot") == self.boot_id:
                continue
            rank = rp.RankProcess.from_persisted(entry)
            running = rank.pgid > 1 and rp.same_process(rank.pgid, rank.start_ticks) and rp.alive(rank.pgid, rank.pgid)
            if shared is not None and key not in shared and not running:
                continue  # reported and forgotten already; only the local copy lagged behind
            if running:
                supervisor = self._supervisor(rank)
                supervisor.apply(Trigger.ADOPTED)
                supervisor.restart_hang_window()
                self.ranks[key] = supervisor
                log.warning("adopting rank %d of job %s attempt %d (pid %d), still running since the last agent",
                            rank.rank, rank.job_id, rank.attempt, rank.pid)
            else:
                self._unreported[key] = rank
        # what ended while no agent watched it may have left processes: its attempt's cgroup goes (not adopted ones)
        await asyncio.to_thread(self.sandbox.sweep, {(s.rank.job_id, s.rank.attempt) for s in self.ranks.values()})
        self._save_local(force=True)

    async def start(self) -> None:
        """After ``runtime.start()``: watch the adopted ranks; report the ones that ended unwatched."""
        for supervisor in self.ranks.values():  # waiting for Redis and the broker was not the ranks' fault
            supervisor.restart_hang_window()
        self._serving = True
        log.info("%d warm interpreter(s) for the built-in trainer's ranks (%s)", self.warm_ranks,
                 "TRAINYARD_WARM_RANKS" if self.settings.warm_ranks is not None else
                 "one per device, at most an eighth of the available memory at 512 MiB each")
        if self.pool is not None:
            self.pool.fill()  # the first; the warm-pool loop starts the rest, one at a time
        for supervisor in list(self.ranks.values()):
            rank = supervisor.rank
            if rank.adopted and rank.watcher is None:
                await self._persist(rank)
                rank.watcher = asyncio.create_task(self._watch(supervisor), name=f"rank-{rank.key}")
        for key, rank in list(self._unreported.items()):
            await self._report_unwatched(key, rank)
        self._in_background(self._collect_code())  # what an earlier incarnation quarantined and no rank uses

    async def aclose(self) -> None:
        """Drain (ask the ranks to checkpoint and stop, up to ``drain_timeout_s``), then stop every rank still
        running (SIGTERM, then SIGKILL after the grace), report the exits, flush.

        An agent that never finished starting leaves the ranks alone: the next one adopts them.
        """
        if self._closing:
            return
        self._closing = True
        if not self._serving:
            self._save_local(force=True)
            log.info("node agent %s stopped before serving; its ranks keep running", self.settings.node_id)
            return
        try:  # tell the scheduler first, so nothing new is placed here
            await self.heartbeat()
        except Exception as exc:  # noqa: BLE001 - best effort; the heartbeat timeout says the same
            log.warning("could not send the final heartbeat: %r", exc)
        await self._drain_ranks()
        stops = [s.apply(Trigger.AGENT_STOPPING, "the node agent stopped")
                 for s in list(self.ranks.values()) if s.rank.running]
        if stops:
            log.info("stopping %d rank(s) before shutdown", len(stops))
        await asyncio.gather(*(stop for stop in stops if stop is not None))
        watchers = [r.watcher for r in self._records() if r.watcher]
        if watchers:
            await asyncio.wait(watchers, timeout=15.0)
        for task in self._background:
            task.cancel()
        await self._flush_outbox(timeout_s=5.0)
        if self.pool is not None:
            await self.pool.aclose()
        if self.kube is not None:
            await self.kube.aclose()
        self.code_cache.close()
        self._save_local(force=True)
        self.rank_network.remove()  # its ranks are stopped (an agent that leaves them running keeps the rules)
        log.info("node agent %s stopped", self.settings.node_id)

    async def _drain_ranks(self) -> None:
        """A planned stop: ask every running allocation here to checkpoint and stop (the pause protocol: the
        ranks agree on a step, save it, exit 7), then wait up to ``drain_timeout_s`` for them to end."""
        timeout = self.settings.drain_timeout_s
        live = [s.rank for s in self._looked_after()]
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
        left = [r for r in self._records() if r.running]
        log.info("drained: %d rank(s) stopped at a checkpoint%s", len(live) - len(left),
                 f"; {len(left)} still running are stopped now" if left else "")

    # ------------------------------------------------------------------ heartbeat
    def heartbeat_event(self) -> NodeHeartbeat:
        s = self.settings
        self._seq += 1
        return NodeHeartbeat(
            node_id=s.node_id, host=s.host, rack=s.rack, nvlink_domain=s.nvlink_domain,
            network_tier=s.network_tier,
            devices=[DeviceInfo(index=i, type=s.device_type, memory_bytes=s.device_memory_bytes)
                     for i in range(s.device_count)],
            running_allocations=sorted({r.allocation_id for r in self._records() if r.running}),
            healthy=not self._closing,
            seq=self._seq,
            draining=self._closing,
            boot_id=self.boot_id,
            sandbox=s.node_sandbox,
            warm_interpreters=self.warm_ranks,
        )

    async def heartbeat(self) -> None:
        await self.runtime.bus.publish(self.heartbeat_event())

    # ------------------------------------------------------------------ allocations
    async def on_gang_allocated(self, event: GangAllocated) -> None:
        node = self.settings.node_id
        share = next((n for n in event.nodes if n.node_id == node), None)
        if share is None:
            return
        if self._closing:
            # Our last heartbeat said "unhealthy": the scheduler fails this attempt as lost and
            # places it elsewhere; holding the message would only delay the shutdown.
            log.warning("not launching allocation %s: the node agent is stopping", event.allocation_id)
            return
        raw_epoch = await self.redis.hget(self.keys.epochs, event.job_id)
        holders = await self._lease_holders([s.device_index for s in share.ranks])
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
        await self._launch(event, decision)

    async def on_allocation_revoked(self, event: AllocationRevoked) -> None:
        targets = self._of_allocation(event.allocation_id)
        if not targets:
            return
        if event.epoch < targets[0].rank.epoch:
            log.warning("ignoring revocation of %s with stale epoch %d < %d", event.allocation_id,
                        event.epoch, targets[0].rank.epoch)
            return
        log.info("revoking allocation %s (%s): stopping %d rank(s)", event.allocation_id, event.reason,
                 sum(s.rank.running for s in targets))
        for supervisor in targets:
            self._revoke(supervisor, event.reason)

    async def on_checkpoint_requested(self, event: CheckpointRequested) -> None:
        """Ask this allocation's ranks here to checkpoint and stop: request file, then SIGUSR1."""
        targets = [s for s in self._of_allocation(event.allocation_id) if s.rank.running]
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

    def _revoke(self, supervisor: RankSupervisor, why: str) -> None:
        stop = supervisor.apply(Trigger.REVOKED, why)
        if stop is not None:
            self._in_background(stop)

    async def _violation(self, rank: rp.RankProcess, refusal: Refusal) -> None:
        """A rank claimed what a rank may not (the spool relay found a forgery): report SecurityViolation (the
        scheduler fails the job, no retries) and stop every rank of its allocation here, which then exit with
        reason ``security``."""
        log.error("SECURITY: rank %d of job %s (tenant %s) attempt %d: %s; stopping its ranks on this node",
                  rank.rank, rank.job_id, rank.tenant, rank.attempt, refusal.reason)
        first = rank.state is not RankState.VIOLATED
        for other in self._of_allocation(rank.allocation_id):
            other.apply(Trigger.VIOLATION, refusal.reason if other.rank is rank
                        else f"rank {rank.rank} of this job was stopped: {refusal.reason}")
        if not first:
            return
        await self.runtime.outbox.put(SecurityViolation(
            job_id=rank.job_id, tenant=rank.tenant, attempt=rank.attempt, allocation_id=rank.allocation_id,
            epoch=rank.epoch, node_id=self.settings.node_id, rank=rank.rank, detail=refusal.reason,
            refused_event_type=refusal.event_type,
        ), traceparent=rank.traceparent)

    async def refill_pool(self) -> None:
        """Top the warm pool up, but not while a rank of this node is still starting (it would
        compete for the CPU with the very start-up the pool is meant to shorten), nor within
        ``warm_refill_quiet_s`` of a rank starting or ending (importing torch costs seconds of CPU: a
        burst of short jobs would pay it per job; real failures are far apart)."""
        if self.pool is None or not self._serving:
            return
        if any(r.running and not (r.liveness.reported or r.liveness.printed) for r in self._records()):
            return
        if self.clock.monotonic() - self._ranks_changed_at < self.settings.warm_refill_quiet_s:
            return  # ranks came or went just now (a burst of short jobs, a restart): import once it is quiet
        self.pool.fill()

    async def _lease_holders(self, indices: list[int]) -> dict[int, dict[str, Any] | None]:
        keys = [Keys.lease(self.settings.node_id, i) for i in indices]
        raws = await self.redis.mget(keys) if keys else []
        return {i: (json.loads(raw) if raw else None) for i, raw in zip(indices, raws, strict=True)}

    async def _refuse(self, event: GangAllocated, reason: str) -> None:
        log.warning("refusing allocation %s of job %s (epoch %d): %s", event.allocation_id, event.job_id,
                    event.epoch, reason)
        entry = json.dumps({"allocationId": event.allocation_id, "jobId": event.job_id, "epoch": event.epoch,
                            "attempt": event.attempt, "reason": reason, "at": self.clock.wall()})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self.keys.refused, entry)
            pipe.ltrim(self.keys.refused, 0, _REFUSALS_KEPT - 1)
            await pipe.execute()


    async def _launch(self, event: GangAllocated, decision: Launch) -> None:
        """Start this node's ranks of the allocation: the built-in trainer (``rank_command``), or the job's
        own code (``spec.code``: its verified tree from the code cache, its entrypoint, cold)."""
        share = decision.share
        traceparent = current_traceparent()
        attempt_dir = self.node_layout.attempt_dir(event.tenant, event.job_id, event.attempt)
        allocation_file = attempt_dir / f"allocation.{self.settings.node_id}.json"
        atomic_write_bytes(allocation_file, event.to_bytes())
        if hosts_rendezvous(share) and (why := await asyncio.to_thread(port_in_use, event.master_port)):
            await self._refuse_all(event, share, traceparent, 127, PORT_IN_USE,
                                   port_taken(event, self.settings.node_id, why))
            return
        code = event.spec.code
        tree = await self._prepare_code(event, share, code, traceparent) if code is not None else None
        if code is not None and tree is None:
            return
        self._launching.add((event.job_id, event.attempt))
        try:
            for slot in share.ranks:
                await self._launch_rank(event, share, slot, allocation_file, traceparent, tree)
        finally:
            self._launching.discard((event.job_id, event.attempt))
            if tree is not None:
                self.code_cache.release(tree.hex)
            await self._maybe_close_attempt(event.job_id, event.attempt)  # when no rank of it started
        await asyncio.to_thread(self.sandbox.detach_shm, event.job_id, event.attempt,
                                [s.rank.exit_file for s in self._of_allocation(event.allocation_id)])
        if tree is not None and tree.materialised:
            self._in_background(self._collect_code())
        running = "" if code is None else f", code {code.archive} {code.entrypoint}"
        if code is not None and code.image:
            running += f", image {code.image}"
        log.info("launched ranks %s of job %s attempt %d (allocation %s, epoch %d, backend %s%s)",
                 [s.rank for s in share.ranks], event.job_id, event.attempt, event.allocation_id,
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

    async def _refuse_all(self, event: GangAllocated, share: NodeAssignment, traceparent: str | None,
                          exit_code: int, reason: str, detail: str) -> None:
        """No rank of ``share`` starts: each reports why (its WorkerExited)."""
        for slot in share.ranks:
            record = self._rank_record(event, slot, traceparent, code=event.spec.code)
            await self._supervisor(record).report_exit(exit_code, reason, detail)

    def _rank_record(self, event: GangAllocated, slot: RankAssignment, traceparent: str | None, *,
                     code: Code | None) -> rp.RankProcess:
        events_file = self.node_layout.rank_events(event.tenant, event.job_id, event.attempt, slot.rank)
        return rp.RankProcess(
            job_id=event.job_id, tenant=event.tenant, attempt=event.attempt,
            allocation_id=event.allocation_id, epoch=event.epoch, rank=slot.rank, local_rank=slot.local_rank,
            pid=0, log_path=self.node_layout.rank_log(event.tenant, event.job_id, event.attempt, slot.rank),
            spool=SpoolReader(events_file), traceparent=traceparent,
            exit_file=exit_file_for(self.node_layout, event.tenant, event.job_id, event.attempt, slot.rank),
            device_index=slot.device_index, code_archive=code.archive if code is not None else None,
            start_manifest_uri=event.start_checkpoint.manifest_uri if event.start_checkpoint else None,
        )

    async def _launch_rank(self, event: GangAllocated, share: NodeAssignment, slot: RankAssignment,
                           allocation_file: Path, traceparent: str | None, tree: CodeTree | None) -> None:
        """Start one rank: 1. its record and, for user code, its paths 2. its environment 3. its process, in its
        sandbox 4. its supervisor takes over (:meth:`_started`). What keeps it from starting is its exit."""
        code = event.spec.code if tree is not None else None
        supervisor = self._supervisor(self._rank_record(event, slot, traceparent, code=code))
        rank = supervisor.rank
        rank.spool.path.parent.mkdir(parents=True, exist_ok=True)
        paths = None
        if code is not None and tree is not None:
            paths = rank_paths(self.layout, tenant=event.tenant, job_id=event.job_id, attempt=event.attempt,
                               rank=slot.rank, dataset=event.spec.dataset, code_dir=tree.root,
                               working_dir=code.working_dir, node_layout=self.node_layout)
            if not paths.cwd.is_dir():
                await supervisor.report_exit(CONFIG, "config",
                                             f"code.workingDir {code.working_dir!r} is not a directory of the "
                                             f"code tree {code.archive}")
                return
            paths.scratch.mkdir(parents=True, exist_ok=True)
        env = self._rank_env(event, share, slot, rank, allocation_file, code, paths)
        clash = self.sandbox.clash(event.job_id, sorted({r.job_id for r in self._records() if r.running}))
        if clash is not None:
            await supervisor.report_exit(127, "error", clash)
            return
        try:
            confined = self._confined(event, slot, rank, paths,
                                      code.entrypoint if code is not None else self.settings.rank_command)
            if code is not None and paths is not None:
                # User code starts cold: warm interpreters hold the built-in trainer already imported.
                rank.process = await rp.spawn(confined.command, env, rank.log_path, rank.exit_file, cwd=paths.cwd)
            else:
                rank.process = await self._start_rank(confined, env, rank.log_path, rank.exit_file)
        except OSError as exc:
            log.error("cannot start rank %d of %s: %r", slot.rank, event.allocation_id, exc)
            await supervisor.report_exit(127, "error", f"cannot start the rank launcher: {exc}")
            return
        await self._started(supervisor)

    def _rank_env(self, event: GangAllocated, share: NodeAssignment, slot: RankAssignment, rank: rp.RankProcess,
                  allocation_file: Path, code: Code | None, paths: RankPaths | None) -> dict[str, str]:
        """The rank's environment (:func:`admission.rank_env`), with its paths on this node."""
        return rank_env(
            event, share, slot, base_env=self.base_env, backend=self.backend,
            artifact_root=self.layout.root, allocation_file=allocation_file, events_file=rank.spool.path,
            traceparent=rank.traceparent, cpu_threads=self._cpu_threads(len(share.ranks)),
            extra=self.settings.rank_env,
            checkpoint_request_file=checkpoint_request_file(self.node_layout, event.tenant, event.job_id,
                                                            event.attempt),
            node_state_dir=self.node_layout.root, shard_cache_dir=self._shard_cache_dir(event, slot),
            shard_cache_bounds=(self.settings.shard_cache_max_gb, self.settings.shard_cache_min_free_gb),
            exit_note_file=rank.note_file,
            code_env=code.env if code is not None else None,
            code_dir=paths.code_dir if paths is not None else None,
            scratch_dir=paths.scratch if paths is not None else None,
            interpreter_dir=Path(sys.executable).parent if code is not None else None,
        )

    def _shard_cache_dir(self, event: GangAllocated, slot: RankAssignment) -> Path:
        """The node's shared shard cache; on a sandboxed node the rank's own, in its scratch directory (a
        cached shard is trusted by its name: ranks of other jobs must not be able to plant one)."""
        if self.sandbox.enforced:
            attempt_dir = self.node_layout.attempt_dir(event.tenant, event.job_id, event.attempt)
            return attempt_dir / "scratch" / f"rank-{slot.rank}" / "shard-cache"
        return self.settings.shard_cache_path

    async def _started(self, supervisor: RankSupervisor) -> None:
        """A rank's process runs: note who it is, put it in the rank table, announce WorkerStarted, watch it."""
        rank = supervisor.rank
        assert rank.process is not None
        supervisor.apply(Trigger.LAUNCHED)
        rank.pgid = rank.process.pid
        rank.start_ticks = rp.start_ticks(rank.pgid)
        rank.oom_files = self.sandbox.oom_files(rank.job_id, rank.attempt)
        rank.oom_kills_at_start = rp.oom_kills(rank.pgid, rank.oom_files)
        rank.pid = await rp.rank_pid(rank.exit_file, rank.process, clock=self.clock) or rank.pgid
        supervisor.restart_hang_window()
        self.ranks[rank.key] = supervisor
        await self._persist(rank, force_local=True)
        started = WorkerStarted(job_id=rank.job_id, attempt=rank.attempt, allocation_id=rank.allocation_id,
                                epoch=rank.epoch, node_id=self.settings.node_id, rank=rank.rank, pid=rank.pid,
                                log_uri=path_to_uri(rank.log_path))
        await self.runtime.outbox.put(started, traceparent=rank.traceparent)
        await self.announcements.track(started, "started", rank, rank.traceparent)
        rank.watcher = asyncio.create_task(self._watch(supervisor), name=f"rank-{rank.key}")
        self._ranks_changed_at = self.clock.monotonic()

    def _confined(self, event: GangAllocated, slot: RankAssignment, rank: rp.RankProcess, paths: RankPaths | None,
                  command: list[str]) -> Confined:
        """The rank's command in its sandbox (:mod:`confinement`; as it is on a trusted node)."""
        attempt_dir = self.node_layout.attempt_dir(event.tenant, event.job_id, event.attempt)
        return self.sandbox.confine(
            command, event, rank=slot.rank, events_file=rank.spool.path, exit_file=rank.exit_file,
            scratch=paths.scratch if paths is not None else attempt_dir / "scratch" / f"rank-{slot.rank}",
            code_dir=paths.code_dir if paths is not None else None, cwd=paths.cwd if paths is not None else None,
            datasets=paths.datasets if paths is not None else ())

    async def _start_rank(self, confined: Confined, env: Mapping[str, str], log_path: Path, exit_file: Path) -> Any:
        """The built-in trainer: in a warm interpreter when one is ready (which enters the rank's sandbox on a
        sandboxed node), else the confined command cold under the launcher."""
        warm = self.pool.take() if self.pool is not None else None
        if warm is not None:
            rp.clear_exit_files(exit_file)
            try:
                await WarmPool.launch(warm, env=env, log_path=log_path, exit_file=exit_file, sandbox=confined.plan)
                return warm
            except (OSError, ConnectionError) as exc:
                log.warning("a warm interpreter failed to take the rank (%r); starting it cold", exc)
                with contextlib.suppress(ProcessLookupError):
                    warm.kill()
        return await rp.spawn(confined.command, env, log_path, exit_file)

    async def _collect_code(self) -> None:
        """Delete quarantined code trees no live rank runs; evict least recently used trees past the cache
        limit (never one a live rank runs). After a code tree was materialised, and after a rank of user code
        ended."""
        in_use = {archive_hex(r.code_archive) for r in self._records() if r.code_archive and r.running}
        try:
            await self.code_cache.acollect(in_use)
        except OSError as exc:
            log.warning("collecting the code cache %s: %r", self.code_cache.root, exc)

    # ------------------------------------------------------------------ watchdogs
    async def check_hangs(self) -> None:
        """Stop every rank here of an attempt that made no progress within the hang timeout."""
        if not self._serving:
            return
        supervisors = self._looked_after()
        for supervisor in supervisors:  # judge what the files say now, not what a busy watcher last saw
            supervisor.note_progress()
        looked_after = [s.rank for s in supervisors]
        now = self.clock.monotonic()
        progress = [RankProgress(r.allocation_id, r.rank, r.pid, now - r.liveness.at, r.progressed,
                                 rp.proc_state(r.pid),
                                 saving_on_request=r.checkpoint_deadline is not None and now < r.checkpoint_deadline,
                                 output_counts=r.code_archive is not None)
                    for r in looked_after]
        for hung in find_hangs(progress, timeout_s=self.settings.hang_timeout_s,
                               first_step_timeout_s=self.settings.first_step_timeout_s):
            targets = [s for s in supervisors if s.rank.allocation_id == hung.allocation_id]
            log.error("allocation %s is hung (%s): killing its %d rank(s) here", hung.allocation_id, hung.detail,
                      len(targets))
            for supervisor in targets:
                supervisor.apply(Trigger.HUNG, hung.detail)

    async def check_leases(self) -> None:
        """Stop running ranks whose allocation no longer holds their device lease."""
        running = self._looked_after()
        if not running:
            return
        holders = await self._lease_holders(sorted({s.rank.device_index for s in running}))
        for supervisor in running:
            rank = supervisor.rank
            holder = holders.get(rank.device_index)
            if holder is None or holder.get("allocationId") != rank.allocation_id:
                now_held = f"is leased to {holder.get('allocationId')}" if holder else "is no longer leased"
                why = (f"device {self.settings.node_id}:{rank.device_index} {now_held}: allocation "
                       f"{rank.allocation_id} was released (its revocation did not reach this agent)")
                log.warning("stopping rank %s: %s", rank.key, why)
                self._revoke(supervisor, why)

    # ------------------------------------------------------------------ persistence and restarts
    async def _persist(self, rank: rp.RankProcess, *, force_local: bool = False) -> None:
        """Record the rank (and its spool offset) in Redis and in the node-local table."""
        try:
            await self.redis.hset(self.keys.ranks, rank.key, json.dumps(rank.persisted(self.boot_id)))
        except (RedisError, OSError) as exc:
            log.debug("could not record rank %s in Redis: %r (the local table has it)", rank.key, exc)
        self._save_local(force=force_local)

    async def _forget(self, rank: rp.RankProcess) -> None:
        self._unreported.pop(rank.key, None)
        self.spool_relay.forget(rank.key)
        try:
            await self.redis.hdel(self.keys.ranks, rank.key)
        except (RedisError, OSError) as exc:  # a later agent reports it again: a harmless duplicate
            log.warning("could not remove rank %s from Redis: %r", rank.key, exc)
        self.ranks.pop(rank.key, None)
        self._save_local(force=True)

    def _save_local(self, *, force: bool = False) -> None:
        ranks = {**self._unreported, **{key: s.rank for key, s in self.ranks.items()}}
        table = {key: rank.persisted(self.boot_id) for key, rank in ranks.items()}
        self.local.save(table, force=force)

    async def _flush_local_state(self) -> None:
        if self.local.dirty:
            self._save_local(force=True)

    async def _report_unwatched(self, key: str, rank: rp.RankProcess) -> None:
        """A rank that ended while no agent watched it: its supervisor reports it, then it is forgotten."""
        await self._supervisor(rank).report_unwatched()
        await self._forget(rank)

    # ------------------------------------------------------------------ the rank table
    def _supervisor(self, rank: rp.RankProcess) -> RankSupervisor:
        return RankSupervisor(rank, self._context)

    async def _watch(self, supervisor: RankSupervisor) -> None:
        """Run the rank's supervisor until its exit is reported, then take the rank off the table."""
        rank = supervisor.rank
        try:
            await supervisor.run()
            await self._forget(rank)
            if rank.code_archive:
                await self._collect_code()
        except Exception:  # noqa: BLE001 - a watcher must not vanish silently
            log.exception("watching rank %s failed", rank.key)
        finally:
            self.ranks.pop(rank.key, None)
            self._ranks_changed_at = self.clock.monotonic()
            await self._maybe_close_attempt(rank.job_id, rank.attempt)

    async def _maybe_close_attempt(self, job_id: str, attempt: int) -> None:
        """Once no rank of the attempt runs here any more, kill what it left and remove its cgroup and /dev/shm."""
        if (job_id, attempt) not in self._launching and \
                not any(r.job_id == job_id and r.attempt == attempt for r in self._records()):
            try:
                await asyncio.to_thread(self.sandbox.close_attempt, job_id, attempt)
            except OSError as exc:
                log.error("closing attempt %d of %s: %r", attempt, job_id, exc)

    def _records(self) -> list[rp.RankProcess]:
        return [s.rank for s in self.ranks.values()]

    def _of_allocation(self, allocation_id: str) -> list[RankSupervisor]:
        return [s for s in self.ranks.values() if s.rank.allocation_id == allocation_id]

    def _looked_after(self) -> list[RankSupervisor]:
        """The running ranks the hang watchdog, the lease check and a drain look after."""
        return [s for s in self.ranks.values() if s.rank.running and watched(s.rank.state)]

    # ------------------------------------------------------------------ helpers
    def _in_background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _flush_outbox(self, timeout_s: float) -> None:
        """Publish what the outbox holds, for up to ``timeout_s`` (best effort: the outbox is durable)."""
        deadline = self.clock.monotonic() + timeout_s

        async def relay_all() -> None:
            while self.clock.monotonic() < deadline and await self.runtime.outbox.pending():
                await self.runtime.outbox.relay_once(self.runtime.bus)

        await backoff.retry(relay_all, policy=backoff.SHUTDOWN_FLUSH, give_up=backoff.past(deadline, self.clock),
                            clock=self.clock, what="flushing the outbox before shutdown")
