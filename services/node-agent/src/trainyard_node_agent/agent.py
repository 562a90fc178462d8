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

Order: a rank's spool is drained completely before its WorkerExited is staged, so a
final ShardWritten or StepMetrics never arrives after the exit that follows it.

Where each rank is in its life (running, checkpointing, revoked, hung, …) is decided by
:func:`supervision.transition`; the agent only applies the step (:meth:`NodeAgent._supervise`).
Time comes from an injected :class:`~trainyard_node_agent.clock.Clock`; what fails while Redis or
the broker is away is retried by :func:`backoff.retry`; announcements are confirmed by
:class:`~trainyard_node_agent.announcements.Announcements`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Coroutine, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from prometheus_client import Counter
from redis.exceptions import RedisError

from trainyard_common.codetree import CodeTreeError, archive_hex
from trainyard_common.events import (
    ALLOCATIONS,
    CHECKPOINTS,
    AllocationRevoked,
    CheckpointRequested,
    DeadLetter,
    DeviceInfo,
    GangAllocated,
    NodeDrained,
    NodeHeartbeat,
    NodeAssignment,
    NodeUndrained,
    RankAssignment,
    SecurityViolation,
    ShardWritten,
    StepMetrics,
    WorkerExited,
    WorkerStarted,
)
from trainyard_common.exitcodes import CONFIG
from trainyard_common.service import ServiceRuntime
from trainyard_common.spec import Code
from trainyard_common.spool import SpoolReader
from trainyard_common.storage import ArtifactLayout, atomic_write_bytes, path_to_uri, uri_to_path
from trainyard_common.store import Keys
from trainyard_common.tracing import current_traceparent

from trainyard_node_agent import backoff, kube
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.admission import (
    Launch,
    Refuse,
    cpu_thread_share,
    interpreter_env,
    judge,
    pick_backend,
    rank_env,
)
from trainyard_node_agent.announcements import Announcements
from trainyard_node_agent.classify import ExitFacts, classify_exit
from trainyard_node_agent.clock import SYSTEM_CLOCK, Clock, wall_datetime
from trainyard_node_agent.codecache import CodeCache, CodeTree, RankPaths, rank_paths
from trainyard_node_agent.confinement import Confined, Confinement, scrubbed
from trainyard_node_agent.confirmation import Announcement
from trainyard_node_agent.localstate import LocalState, merge_tables
from trainyard_node_agent.relay import RankIdentity, Refusal, check_line
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.supervision import Action, RankState, Trigger, exit_causes, transition, watched
from trainyard_node_agent.warmpool import WarmPool, auto_size, mem_available_bytes
from trainyard_node_agent.watchdog import Liveness, RankProgress, find_hangs, observe

log = logging.getLogger(__name__)
_REFUSALS_KEPT = 100
LOST_EXIT_CODE = -9
CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"  # in the attempt directory; read by trainyard_trainer
RELAY_REFUSED = Counter("trainyard_node_agent_spool_refused_total",
                        "spool lines not relayed: kind=violation (a claim a rank may not make: the job fails) "
                        "or malformed (unreadable; dead-lettered)", ["kind"])


class AgentKeys:
    """Redis keys a node agent owns, per node."""

    def __init__(self, node_id: str) -> None:
        base = f"ty:agent:{node_id}"
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


def _event_id(record: Mapping[str, Any]) -> str | None:
    payload = record.get("payload")
    return str(payload["eventId"]) if isinstance(payload, dict) and "eventId" in payload else None


def baseline(rank: rp.RankProcess, now: float) -> Liveness:
    """A fresh hang window from ``now``, measured from the rank's files as they are (launch, adoption)."""
    return Liveness(now, spool_bytes=rp.file_size(rank.spool.path), log_bytes=rp.file_size(rank.log_path),
                    reported=rank.liveness.reported, printed=rank.liveness.printed)


def last_step_of(rank: rp.RankProcess) -> int | None:
    """The step WorkerExited reports: the trainer's exit note (its last step, the failing one after a
    NaN, the one it checkpointed at when asked to stop), else the last StepMetrics relayed."""
    noted = rp.read_note_step(rank.note_file)
    return noted if noted is not None else rank.last_step


class NodeAgent:
    """Wires the handlers, the heartbeat and the watchdogs onto a :class:`ServiceRuntime`."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, *,
                 base_env: Mapping[str, str], clock: Clock = SYSTEM_CLOCK) -> None:
        self.runtime = runtime
        self.settings = settings
        self.clock = clock
        self.redis = runtime.redis
        self.keys = AgentKeys(settings.node_id)
        self.layout = ArtifactLayout(settings.artifact_root)
        self.base_env = scrubbed(base_env)  # no broker/Redis addresses or credentials reach a rank
        self.sandbox = Confinement(settings, self.layout)
        self.backend = pick_backend(settings.backend, settings.device_type,
                                    has_nvidia_smi=shutil.which("nvidia-smi") is not None)
        self.group = f"{settings.group_prefix}.node-agent.{settings.node_id}"
        self.boot_id = uuid.uuid4().hex
        self.ranks: dict[str, rp.RankProcess] = {}
        self.local = LocalState(settings.agent_state_path)
        self._seq = 0
        self._closing = False
        self._serving = False
        self._background: set[asyncio.Task[None]] = set()
        self._unreported: dict[str, rp.RankProcess] = {}  # ended while no agent watched them
        self.announcements = Announcements(runtime, settings, self.keys.unconfirmed, clock)
        self._announced = self.announcements.pending  # published, not yet seen applied
        self._ranks_changed_at = float("-inf")  # monotonic time a rank last started or ended here
        self._sent_ahead: dict[str, set[str]] = {}  # rank key -> event ids relayed ahead of a held-up line
        self._relay_failing: set[str] = set()  # rank keys whose spool the broker refuses now (logged once)
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
        """Subscribe (a group of its own: every agent sees every allocation), heartbeat, watchdogs."""
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
                self._supervise(rank, Trigger.ADOPTED)
                rank.liveness = baseline(rank, self.clock.monotonic())
                self.ranks[key] = rank
                log.warning("adopting rank %d of job %s attempt %d (pid %d), still running since the last agent",
                            rank.rank, rank.job_id, rank.attempt, rank.pid)
            else:
                self._unreported[key] = rank
        self._save_local(force=True)

    async def start(self) -> None:
        """After ``runtime.start()``: watch the adopted ranks; report the ones that ended unwatched."""
        for rank in self.ranks.values():  # waiting for Redis and the broker was not the ranks' fault
            rank.liveness = baseline(rank, self.clock.monotonic())
        self._serving = True
        log.info("%d warm interpreter(s) for the built-in trainer's ranks (%s)", self.warm_ranks,
                 "TRAINYARD_WARM_RANKS" if self.settings.warm_ranks is not None else
                 "one per device, at most an eighth of the available memory at 512 MiB each")
        if self.pool is not None:
            self.pool.fill()  # the first; the warm-pool loop starts the rest, one at a time
        for rank in list(self.ranks.values()):
            if rank.adopted and rank.watcher is None:
                await self._persist(rank)
                rank.watcher = asyncio.create_task(self._watch(rank), name=f"rank-{rank.key}")
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
        stops = [self._supervise(r, Trigger.AGENT_STOPPING, "the node agent stopped")
                 for r in list(self.ranks.values()) if r.running]
        if stops:
            log.info("stopping %d rank(s) before shutdown", len(stops))
        await asyncio.gather(*(s for s in stops if s is not None))
        watchers = [r.watcher for r in list(self.ranks.values()) if r.watcher]
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
        log.info("node agent %s stopped", self.settings.node_id)

    async def _drain_ranks(self) -> None:
        """A planned stop: ask every running allocation here to checkpoint and stop (the pause protocol: the
        ranks agree on a step, save it, exit 7), then wait up to ``drain_timeout_s`` for them to end."""
        timeout = self.settings.drain_timeout_s
        live = [r for r in self.ranks.values() if r.running and watched(r.state)]
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
        left = [r for r in self.ranks.values() if r.running]
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
            running_allocations=sorted({r.allocation_id for r in self.ranks.values() if r.running}),
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
        targets = [r for r in self.ranks.values() if r.allocation_id == event.allocation_id]
        if not targets:
            return
        if event.epoch < targets[0].epoch:
            log.warning("ignoring revocation of %s with stale epoch %d < %d", event.allocation_id,
                        event.epoch, targets[0].epoch)
            return
        log.info("revoking allocation %s (%s): stopping %d rank(s)", event.allocation_id, event.reason,
                 sum(r.running for r in targets))
        for rank in targets:
            self._revoke(rank, event.reason)

    async def on_checkpoint_requested(self, event: CheckpointRequested) -> None:
        """Ask this allocation's ranks here to checkpoint and stop: request file, then SIGUSR1."""
        targets = [r for r in self.ranks.values() if r.allocation_id == event.allocation_id and r.running]
        if not targets:
            return
        if event.epoch < targets[0].epoch:
            log.warning("ignoring checkpoint request for %s with stale epoch %d < %d", event.allocation_id,
                        event.epoch, targets[0].epoch)
            return
        fresh = [r for r in targets if transition(r.state, Trigger.CHECKPOINT_REQUESTED, running=True).actions]
        if not fresh:
            log.info("checkpoint request for %s already delivered; ignoring the duplicate", event.allocation_id)
            return
        first = fresh[0]
        request_file = checkpoint_request_file(self.layout, first.tenant, first.job_id, first.attempt)
        atomic_write_bytes(request_file, event.to_bytes())
        log.info("checkpoint requested for %d rank(s) of %s (%s%s)", len(fresh), event.allocation_id, event.reason,
                 f", for {event.requested_by}" if event.requested_by else "")
        now = self.clock.monotonic()
        grace = (event.deadline.timestamp() - self.clock.wall()) if event.deadline else self.settings.hang_timeout_s
        for rank in fresh:
            rank.checkpoint_deadline = now + max(grace, 0.0)
            rank.liveness = rank.liveness.restarted(now)  # a fresh hang window once the deadline has passed
            self._supervise(rank, Trigger.CHECKPOINT_REQUESTED)

    def _revoke(self, rank: rp.RankProcess, why: str) -> None:
        stop = self._supervise(rank, Trigger.REVOKED, why)
        if stop is not None:
            self._in_background(stop)

    def _supervise(self, rank: rp.RankProcess, trigger: Trigger,
                   detail: str | None = None) -> Coroutine[Any, Any, None] | None:
        """Move the rank on (:func:`supervision.transition`) and signal its process group as the step says. A
        graceful stop takes a while: it is returned (a coroutine) for the caller to await or run in the background."""
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
                stop = rp.stop(rank, self.settings.kill_grace_s, clock=self.clock)
        return stop

    async def refill_pool(self) -> None:
        """Top the warm pool up, but not while a rank of this node is still starting (it would
        compete for the CPU with the very start-up the pool is meant to shorten), nor within
        ``warm_refill_quiet_s`` of a rank starting or ending (importing torch costs seconds of CPU: a
        burst of short jobs would pay it per job; real failures are far apart)."""
        if self.pool is None or not self._serving:
            return
        if any(r.running and not (r.liveness.reported or r.liveness.printed) for r in self.ranks.values()):
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
        attempt_dir = self.layout.attempt_dir(event.tenant, event.job_id, event.attempt)
        allocation_file = attempt_dir / f"allocation.{self.settings.node_id}.json"
        atomic_write_bytes(allocation_file, event.to_bytes())
        code = event.spec.code
        tree = await self._prepare_code(event, share, code, traceparent) if code is not None else None
        if code is not None and tree is None:
            return
        try:
            for slot in share.ranks:
                await self._launch_rank(event, share, slot, allocation_file, traceparent, tree)
        finally:
            if tree is not None:
                self.code_cache.release(tree.hex)
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
        for slot in share.ranks:
            await self._report_exit(self._rank_record(event, slot, traceparent, code=code), exit_code, reason, detail)
        return None

    def _rank_record(self, event: GangAllocated, slot: RankAssignment, traceparent: str | None, *,
                     code: Code | None) -> rp.RankProcess:
        events_file = self.layout.rank_events(event.tenant, event.job_id, event.attempt, slot.rank)
        return rp.RankProcess(
            job_id=event.job_id, tenant=event.tenant, attempt=event.attempt,
            allocation_id=event.allocation_id, epoch=event.epoch, rank=slot.rank, local_rank=slot.local_rank,
            pid=0, log_path=self.layout.rank_log(event.tenant, event.job_id, event.attempt, slot.rank),
            spool=SpoolReader(events_file), traceparent=traceparent,
            exit_file=exit_file_for(self.layout, event.tenant, event.job_id, event.attempt, slot.rank),
            device_index=slot.device_index, code_archive=code.archive if code is not None else None,
            start_manifest_uri=event.start_checkpoint.manifest_uri if event.start_checkpoint else None,
        )

    async def _launch_rank(self, event: GangAllocated, share: NodeAssignment, slot: RankAssignment,
                           allocation_file: Path, traceparent: str | None, tree: CodeTree | None) -> None:
        code = event.spec.code if tree is not None else None
        rank = self._rank_record(event, slot, traceparent, code=code)
        rank.spool.path.parent.mkdir(parents=True, exist_ok=True)
        paths = None
        if code is not None and tree is not None:
            paths = rank_paths(self.layout, tenant=event.tenant, job_id=event.job_id, attempt=event.attempt,
                               rank=slot.rank, dataset=event.spec.dataset, code_dir=tree.root,
                               working_dir=code.working_dir)
            if not paths.cwd.is_dir():
                await self._report_exit(rank, CONFIG, "config",
                                        f"code.workingDir {code.working_dir!r} is not a directory of the code "
                                        f"tree {code.archive}")
                return
            paths.scratch.mkdir(parents=True, exist_ok=True)
        env = rank_env(
            event, share, slot, base_env=self.base_env, backend=self.backend,
            artifact_root=self.layout.root, allocation_file=allocation_file, events_file=rank.spool.path,
            traceparent=traceparent, cpu_threads=self._cpu_threads(len(share.ranks)), extra=self.settings.rank_env,
            checkpoint_request_file=checkpoint_request_file(self.layout, event.tenant, event.job_id,
                                                            event.attempt),
            exit_note_file=rank.note_file,
            code_env=code.env if code is not None else None,
            code_dir=paths.code_dir if paths is not None else None,
            scratch_dir=paths.scratch if paths is not None else None,
            interpreter_dir=Path(sys.executable).parent if code is not None else None,
        )
        clash = self.sandbox.clash(event.job_id, sorted({r.job_id for r in self.ranks.values() if r.running}))
        if clash is not None:
            await self._report_exit(rank, 127, "error", clash)
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
            await self._report_exit(rank, 127, "error", f"cannot start the rank launcher: {exc}")
            return
        self._supervise(rank, Trigger.LAUNCHED)
        rank.pgid = rank.process.pid
        rank.start_ticks = rp.start_ticks(rank.pgid)
        rank.oom_kills_at_start = rp.oom_kills(rank.pgid)
        rank.pid = await rp.rank_pid(rank.exit_file, rank.process, clock=self.clock) or rank.pgid
        rank.liveness = baseline(rank, self.clock.monotonic())
        self.ranks[rank.key] = rank
        await self._persist(rank, force_local=True)
        started = WorkerStarted(job_id=event.job_id, attempt=event.attempt, allocation_id=event.allocation_id,
                                epoch=event.epoch, node_id=self.settings.node_id, rank=slot.rank, pid=rank.pid,
                                log_uri=path_to_uri(rank.log_path))
        await self.runtime.outbox.put(started, traceparent=traceparent)
        await self.announcements.track(started, "started", rank, traceparent)
        rank.watcher = asyncio.create_task(self._watch(rank), name=f"rank-{rank.key}")
        self._ranks_changed_at = self.clock.monotonic()

    def _confined(self, event: GangAllocated, slot: RankAssignment, rank: rp.RankProcess, paths: RankPaths | None,
                  command: list[str]) -> Confined:
        """The rank's command in its sandbox (:mod:`confinement`; as it is on a trusted node)."""
        attempt_dir = self.layout.attempt_dir(event.tenant, event.job_id, event.attempt)
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
        in_use = {archive_hex(r.code_archive) for r in self.ranks.values() if r.code_archive and r.running}
        try:
            await self.code_cache.acollect(in_use)
        except OSError as exc:
            log.warning("collecting the code cache %s: %r", self.code_cache.root, exc)

    # ------------------------------------------------------------------ watching ranks
    async def _watch(self, rank: rp.RankProcess) -> None:
        """Relay the spool while the rank runs; after it ends, drain it, then report how it ended."""
        try:
            while True:
                ended = await self._wait_a_little(rank)
                self._note_progress(rank)
                await self._relay(rank, quiet=True)
                if ended:
                    break
            await self._drain(rank)
            code, reason, detail = self._how_it_ended(rank)
            await self._report_exit(rank, code, reason, detail)
            rp.signal_group(rank.pgid, signal.SIGKILL)  # whatever the rank left in its group
            await self._forget(rank)
            if rank.code_archive:
                await self._collect_code()
        except Exception:  # noqa: BLE001 - a watcher must not vanish silently
            log.exception("watching rank %s failed", rank.key)
        finally:
            self.ranks.pop(rank.key, None)
            self._ranks_changed_at = self.clock.monotonic()

    async def _wait_a_little(self, rank: rp.RankProcess) -> bool:
        """Up to one spool poll; True once the rank has ended."""
        if rank.process is not None:
            return await rp.wait_exited(rank.process, self.settings.spool_poll_s)
        await self.clock.sleep(self.settings.spool_poll_s)
        if not rp.same_process(rank.pgid, rank.start_ticks):
            rank.gone = True
        return rank.gone

    def _note_progress(self, rank: rp.RankProcess) -> None:
        """Measure the rank's spool (and, for user code, its log) and let the watchdog judge the growth."""
        rank.liveness = observe(rank.liveness, spool_bytes=rp.file_size(rank.spool.path),
                                log_bytes=rp.file_size(rank.log_path) if rank.code_archive else None,
                                now=self.clock.monotonic())

    def _how_it_ended(self, rank: rp.RankProcess) -> tuple[int, str, str | None]:
        """(exit code, reason, detail) from the exit file, the process and the log."""
        recorded = rp.read_exit_file(rank.exit_file)
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
        now_ooms = rp.oom_kills(None) if rank.oom_kills_at_start is not None else None
        ooms = max((now_ooms or 0) - (rank.oom_kills_at_start or 0), 0) if now_ooms is not None else 0
        reason, detail = classify_exit(ExitFacts(
            exit_code=code, log_tail=rp.log_tail(rank.log_path) if code != 0 else "",
            revoked=causes.revoked, hang=causes.hang, lost=lost, oom_kills=ooms,
            user_code=rank.code_archive is not None, progressed=rank.progressed,
            start_error=rp.read_start_error(rank.exit_file) if code != 0 else None, violation=causes.violation,
        ))
        return code, reason, detail if detail is not None else causes.fallback_detail

    async def _relay(self, rank: rp.RankProcess, *, quiet: bool = False) -> int:
        """Publish the spool lines written since the last call, in order; returns how many.

        Order only matters within a topic (docs/design.md §4.1). A line the broker refuses holds up
        the lines behind it, except checkpoint reports: those are published ahead of it (once; the
        in-order pass skips them when it gets there), so a partition that refuses StepMetrics for a
        while (seen for 30 s after the embedded broker restarted empty) never keeps a durable
        checkpoint from becoming READY. The saved offset stays at the first unpublished line, so a
        restarted agent publishes the ones sent ahead again (same event ids: deduplicated).
        """
        published = 0
        ahead = self._sent_ahead.setdefault(rank.key, set())
        try:
            for offset, record in rank.spool.read_new():
                event_id = _event_id(record)
                if event_id is not None and event_id in ahead:
                    ahead.discard(event_id)  # published already, ahead of a line that was held up
                else:
                    try:
                        await self._publish_spooled(rank, offset, record)
                    except Exception:
                        if record.get("topic") != CHECKPOINTS:
                            published += await self._relay_checkpoints_ahead(rank, ahead)
                        raise
                rank.spool.offset = offset
                published += 1
            if rank.key in self._relay_failing:
                log.info("relaying the spool of rank %s works again", rank.key)
                self._relay_failing.discard(rank.key)
        except Exception as exc:
            if not quiet:
                raise
            if rank.key not in self._relay_failing:  # once per outage, not once per poll
                log.warning("relaying the spool of rank %s: %r (events wait in the spool; retrying)", rank.key, exc)
            self._relay_failing.add(rank.key)
        if published:
            await self._persist(rank)
        return published

    async def _relay_checkpoints_ahead(self, rank: rp.RankProcess, ahead: set[str]) -> int:
        """Publish the checkpoint reports past the held-up line; returns how many (noted in ``ahead``)."""
        sent = 0
        for offset, record in SpoolReader(rank.spool.path, rank.spool.offset).read_new():
            event_id = _event_id(record)
            if record.get("topic") != CHECKPOINTS or "corrupt" in record or event_id is None or event_id in ahead:
                continue
            try:
                await self._publish_spooled(rank, offset, record)
            except Exception:  # noqa: BLE001 - the checkpoints topic refuses too: everything waits in the spool
                break
            ahead.add(event_id)
            sent += 1
        if sent:
            log.warning("rank %s: published %d checkpoint report(s) ahead of a spool line the broker refuses",
                        rank.key, sent)
        return sent

    def _identity(self, rank: rp.RankProcess) -> RankIdentity:
        return RankIdentity(
            job_id=rank.job_id, tenant=rank.tenant, attempt=rank.attempt, allocation_id=rank.allocation_id,
            epoch=rank.epoch, rank=rank.rank, checkpoints=str(self.layout.checkpoints_dir(rank.tenant, rank.job_id)),
            start_manifest_uri=rank.start_manifest_uri, traceparent=rank.traceparent,
        )

    async def _publish_spooled(self, rank: rp.RankProcess, offset: int, record: dict[str, Any]) -> None:
        """Publish one spool line if the rank may say it (relay.check_line), as the agent renders it;
        else dead-letter it with the reason, and a forgery stops the job (:meth:`_violation`)."""
        checked = check_line(record, self._identity(rank), offset=offset)
        if not isinstance(checked, Refusal) and isinstance(checked.event, ShardWritten):
            checked = self._shard_files_stay_inside(checked.event, rank) or checked
        if isinstance(checked, Refusal):
            RELAY_REFUSED.labels(kind="violation" if checked.violation else "malformed").inc()
            raw = record.get("corrupt") or json.dumps(record)
            await self.runtime.bus.publish(DeadLetter(
                source_topic=f"spool:{rank.spool.path}", partition=rank.rank, offset=offset,
                consumer_group=self.group, raw_b64=base64.b64encode(str(raw).encode()).decode(),
                error=("security: " if checked.violation else "") + checked.reason,
            ), traceparent=rank.traceparent)
            if checked.violation:
                await self._violation(rank, checked)
            return
        event = checked.event
        if isinstance(event, StepMetrics):
            rank.last_step = event.step
        await self.runtime.bus.publish_raw_traced(checked.topic, checked.body, key=checked.key,
                                                  traceparent=checked.traceparent)
        if isinstance(event, ShardWritten):
            rank.saved_step = max(rank.saved_step or 0, event.global_step)
            await self.announcements.remember(Announcement(
                event_id=str(event.event_id), kind="shard", topic=checked.topic, key=checked.key,
                payload=checked.body.decode(), traceparent=checked.traceparent, job_id=rank.job_id,
                attempt=event.attempt, allocation_id=rank.allocation_id, rank=event.rank, step=event.global_step,
                epoch=event.epoch,
            ))

    def _shard_files_stay_inside(self, event: ShardWritten, rank: rp.RankProcess) -> Refusal | None:
        """A shard under the job's prefix by name could still be a symlink out of it: resolve it."""
        prefix = os.path.realpath(self.layout.checkpoints_dir(rank.tenant, rank.job_id))
        for uri in (event.uri, *(f.uri for f in event.extra_files)):
            try:
                real = os.path.realpath(uri_to_path(uri))
            except Exception:  # noqa: BLE001 - an unsupported URI was refused by check_line already
                continue
            if not real.startswith(prefix.rstrip("/") + "/"):
                return Refusal(f"ShardWritten names {uri!r}, which resolves to {real}, outside the job's "
                               f"checkpoint prefix", violation=True, event_type="ShardWritten")
        return None

    async def _violation(self, rank: rp.RankProcess, refusal: Refusal) -> None:
        """A rank claimed what a rank may not: report SecurityViolation (the scheduler fails the job, no
        retries) and stop every rank of its allocation here, which then exit with reason ``security``."""
        log.error("SECURITY: rank %d of job %s (tenant %s) attempt %d: %s; stopping its ranks on this node",
                  rank.rank, rank.job_id, rank.tenant, rank.attempt, refusal.reason)
        first = rank.state is not RankState.VIOLATED
        for other in list(self.ranks.values()):
            if other.allocation_id == rank.allocation_id:
                self._supervise(other, Trigger.VIOLATION, refusal.reason if other is rank
                                else f"rank {rank.rank} of this job was stopped: {refusal.reason}")
        if not first:
            return
        await self.runtime.outbox.put(SecurityViolation(
            job_id=rank.job_id, tenant=rank.tenant, attempt=rank.attempt, allocation_id=rank.allocation_id,
            epoch=rank.epoch, node_id=self.settings.node_id, rank=rank.rank, detail=refusal.reason,
            refused_event_type=refusal.event_type,
        ), traceparent=rank.traceparent)

    async def _drain(self, rank: rp.RankProcess) -> None:
        """Relay until the spool is empty; retry while the broker is away (for 10 s more once closing)."""
        async def relay_all() -> None:
            while await self._relay(rank):
                pass

        if not await backoff.retry(relay_all, policy=backoff.INFRASTRUCTURE, clock=self.clock,
                                   give_up=backoff.ClosingGrace(lambda: self._closing, self.clock, 10.0),
                                   what=f"draining the spool of {rank.key}"):
            log.error("the spool of %s stays unrelayed from offset %d", rank.key, rank.spool.offset)

    async def _report_exit(self, rank: rp.RankProcess, code: int, reason: str, detail: str | None) -> None:
        event = WorkerExited(
            job_id=rank.job_id, attempt=rank.attempt, allocation_id=rank.allocation_id, epoch=rank.epoch,
            node_id=self.settings.node_id, rank=rank.rank, exit_code=code, reason=reason, detail=detail,
            global_step=last_step_of(rank), saved_step=rank.saved_step,
        )
        if not await backoff.retry(  # Redis away: the exit must still be reported
                lambda: self.runtime.outbox.put(event, traceparent=rank.traceparent),
                policy=backoff.INFRASTRUCTURE, clock=self.clock, what=f"recording the exit of {rank.key}",
                give_up=backoff.closing_and_capped(lambda: self._closing, backoff.INFRASTRUCTURE)):
            return
        await self.announcements.track(event, "exited", rank, rank.traceparent)
        log.info("rank %d of %s exited with %d (%s%s)", rank.rank, rank.allocation_id, code, reason,
                 f": {detail}" if detail else "")

    # ------------------------------------------------------------------ watchdogs
    async def check_hangs(self) -> None:
        """Stop every rank here of an attempt that made no progress within the hang timeout."""
        if not self._serving:
            return
        looked_after = [r for r in self.ranks.values() if r.running and watched(r.state)]
        for r in looked_after:  # judge what the files say now, not what a busy watcher last saw
            self._note_progress(r)
        now = self.clock.monotonic()
        progress = [RankProgress(r.allocation_id, r.rank, r.pid, now - r.liveness.at, r.progressed,
                                 rp.proc_state(r.pid),
                                 saving_on_request=r.checkpoint_deadline is not None and now < r.checkpoint_deadline,
                                 output_counts=r.code_archive is not None)
                    for r in looked_after]
        for hung in find_hangs(progress, timeout_s=self.settings.hang_timeout_s,
                               first_step_timeout_s=self.settings.first_step_timeout_s):
            targets = [r for r in looked_after if r.allocation_id == hung.allocation_id]
            log.error("allocation %s is hung (%s): killing its %d rank(s) here", hung.allocation_id, hung.detail,
                      len(targets))
            for rank in targets:
                self._supervise(rank, Trigger.HUNG, hung.detail)

    async def check_leases(self) -> None:
        """Stop running ranks whose allocation no longer holds their device lease."""
        running = [r for r in self.ranks.values() if r.running and watched(r.state)]
        if not running:
            return
        holders = await self._lease_holders(sorted({r.device_index for r in running}))
        for rank in running:
            holder = holders.get(rank.device_index)
            if holder is None or holder.get("allocationId") != rank.allocation_id:
                now_held = f"is leased to {holder.get('allocationId')}" if holder else "is no longer leased"
                why = (f"device {self.settings.node_id}:{rank.device_index} {now_held}: allocation "
                       f"{rank.allocation_id} was released (its revocation did not reach this agent)")
                log.warning("stopping rank %s: %s", rank.key, why)
                self._revoke(rank, why)

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
        self._sent_ahead.pop(rank.key, None)
        self._relay_failing.discard(rank.key)
        try:
            await self.redis.hdel(self.keys.ranks, rank.key)
        except (RedisError, OSError) as exc:  # a later agent reports it again: a harmless duplicate
            log.warning("could not remove rank %s from Redis: %r", rank.key, exc)
        self.ranks.pop(rank.key, None)
        self._save_local(force=True)

    def _save_local(self, *, force: bool = False) -> None:
        table = {k: r.persisted(self.boot_id) for k, r in {**self._unreported, **self.ranks}.items()}
        self.local.save(table, force=force)

    async def _flush_local_state(self) -> None:
        if self.local.dirty:
            self._save_local(force=True)

    async def _report_unwatched(self, key: str, rank: rp.RankProcess) -> None:
        """A rank that ended while no agent watched it: relay the rest of its spool, report its exit
        (from the launcher's exit file; ``lost`` without one)."""
        await self._drain(rank)
        code, reason, detail = self._how_it_ended(rank)
        if reason != "lost":
            detail = (detail + "; " if detail else "") + "it ended while its node agent was down"
        await self._report_exit(rank, code, reason, detail)
        await self._forget(rank)

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
