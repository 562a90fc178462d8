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

The agent is a few parts wired here, each with one concern (design.md §10): the :class:`RankTable`
(supervisors, durable copies), :class:`Recovery` (adoption at start-up), the :class:`AllocationLauncher`
(admission I/O around :func:`admission.judge`, then the launch) and its :class:`RankStarter` (one rank into
its sandbox), :class:`Attempts` (each rank watched by its :class:`~trainyard_node_agent.supervisor.RankSupervisor`
until its exit is reported, then the attempt's containment closed), :class:`RankControl` (revocation,
checkpoint requests, violations, hangs, lost leases, the drain) and the :class:`Heartbeat`. A rank's lifecycle
is decided by :func:`supervision.transition`; its spool is relayed by the
:class:`~trainyard_node_agent.spool_relay.SpoolRelay`. Time comes from an injected
:class:`~trainyard_node_agent.clock.Clock`; what fails while Redis or the broker is away is retried by
:func:`backoff.retry`; announcements are confirmed by :class:`~trainyard_node_agent.announcements.Announcements`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from collections.abc import Mapping

from trainyard_contract.events import (
    ALLOCATIONS,
    AllocationRevoked,
    CheckpointRequested,
    GangAllocated,
    ReplicaReplaced,
)
from trainyard_contract.storage import ArtifactLayout
from trainyard_runtime.service import ServiceRuntime
from trainyard_runtime.store import Keys

from trainyard_node_agent import backoff, kube
from trainyard_node_agent.admission import interpreter_env, pick_backend
from trainyard_node_agent.announcements import Announcements
from trainyard_node_agent.attempt_files import (
    CHECKPOINT_REQUEST_FILE,
    checkpoint_request_file,
    exit_file_for,
)
from trainyard_node_agent.attempts import Attempts
from trainyard_node_agent.clock import SYSTEM_CLOCK, Clock
from trainyard_node_agent.codecache import CodeCache
from trainyard_node_agent.envcache import EnvCache, base_environment, installer
from trainyard_node_agent.envprep import EnvironmentPreparer
from trainyard_node_agent.confinement import Confinement, scrubbed
from trainyard_node_agent.control import RankControl
from trainyard_node_agent.heartbeat import CordonFollower, Heartbeat
from trainyard_node_agent.launch import AllocationLauncher
from trainyard_node_agent.lifecycle import Background, Lifecycle
from trainyard_node_agent.localstate import LocalState
from trainyard_node_agent.log_shipper import LogShipper
from trainyard_node_agent.rank_network import RankNetwork
from trainyard_node_agent.rank_start import RankStarter
from trainyard_node_agent.rank_table import RankTable
from trainyard_node_agent.recovery import Recovery
from trainyard_node_agent.replicas import Lighthouses, ReplicaRestarts
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.spool_relay import SpoolRelay
from trainyard_node_agent.supervision import Trigger
from trainyard_node_agent.supervisor import RankSupervisor, SupervisorContext
from trainyard_node_agent.warmpool import WarmPool, auto_size, mem_available_bytes

__all__ = ["CHECKPOINT_REQUEST_FILE", "AgentKeys", "NodeAgent", "checkpoint_request_file", "exit_file_for"]

log = logging.getLogger(__name__)


class AgentKeys:
    """Redis keys a node agent owns, per node."""

    def __init__(self, node_id: str) -> None:
        base = Keys.agent(node_id)
        self.epochs = f"{base}:epochs"  # job id -> highest epoch seen
        self.launched = f"{base}:launched"  # allocation ids ever launched here
        self.ranks = f"{base}:ranks"  # "<allocation>/<rank>" -> RankProcess.persisted()
        self.refused = f"{base}:refused"  # recent refusals, newest first (JSON)
        self.unconfirmed = f"{base}:unconfirmed"  # event id -> Announcement not yet seen applied (JSON)
        self.gangs = f"{base}:gangs"  # allocation id -> the fault-tolerant GangAllocated launched here (JSON)


class NodeAgent:
    """Wires the parts (handlers, heartbeat, watchdogs) onto a :class:`ServiceRuntime`, and runs the agent's own
    lifecycle: prepare (adopt) → start (serve) → aclose (drain, stop what still runs, flush)."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, *,
                 base_env: Mapping[str, str], clock: Clock = SYSTEM_CLOCK) -> None:
        self.runtime, self.settings, self.clock = runtime, settings, clock
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
        self.lifecycle, self.background = Lifecycle(), Background()
        self.table = RankTable(runtime.redis, self.keys.ranks, LocalState(settings.agent_state_path),
                               boot_id=self.boot_id, clock=clock)
        self.announcements = Announcements(runtime, settings, self.keys.unconfirmed, clock)
        self.control = RankControl(runtime, settings, self.table, node_layout=self.node_layout,
                                   lifecycle=self.lifecycle, background=self.background, clock=clock)

        def closing() -> bool:
            return self.lifecycle.closing

        self.spool_relay = SpoolRelay(runtime.bus, layout=self.layout, group=self.group,
                                      announcements=self.announcements, persist=self.table.persist,
                                      violation=self.control.violation, closing=closing, clock=clock)
        shipper = (LogShipper(self.layout, clock, interval_s=settings.log_ship_interval_s) if self.layout.remote
                   else None)
        context = SupervisorContext(settings, clock, self.spool_relay, runtime.outbox, self.announcements,
                                    closing=closing, logs=shipper)
        self.code_cache = CodeCache(settings.code_cache_path, self.layout, max_bytes=settings.code_cache_max_bytes)
        self.env_cache = EnvCache(settings.env_cache_path, max_bytes=settings.env_cache_max_bytes,
                                  installer=installer(settings), base=base_environment())
        self.attempts = Attempts(self.table, context, sandbox=self.sandbox, spool_relay=self.spool_relay,
                                 code_cache=self.code_cache, env_cache=self.env_cache)
        self.warm_ranks = settings.warm_ranks if settings.warm_ranks is not None else \
            auto_size(settings.device_count, mem_available_bytes())
        self.pool = self._warm_pool()
        self.starter = RankStarter(runtime, settings, layout=self.layout, node_layout=self.node_layout,
                                   base_env=self.base_env, backend=self.backend, sandbox=self.sandbox, pool=self.pool,
                                   table=self.table, attempts=self.attempts, announcements=self.announcements,
                                   lifecycle=self.lifecycle, clock=clock)
        self.launcher = AllocationLauncher(runtime.redis, settings, self.keys, node_layout=self.node_layout,
                                           backend=self.backend, sandbox=self.sandbox, code_cache=self.code_cache,
                                           environments=EnvironmentPreparer(
                                               self.env_cache, lambda e: runtime.outbox.put(e),
                                               node_id=settings.node_id),
                                           table=self.table, attempts=self.attempts, starter=self.starter,
                                           lifecycle=self.lifecycle, background=self.background, clock=clock)
        self.lighthouses = Lighthouses(runtime.redis, settings.node_id, log_dir=settings.agent_state_path.parent,
                                       clock=clock)
        self.replicas = ReplicaRestarts(runtime.redis, settings.node_id, self.keys, launcher=self.launcher,
                                        lighthouses=self.lighthouses, table=self.table, clock=clock,
                                        replicated=self.control.replicated)
        self.launcher.replicas = self.replicas
        self.recovery = Recovery(runtime.redis, self.table, self.attempts, announcements=self.announcements,
                                 sandbox=self.sandbox, boot_id=self.boot_id)
        self.heartbeat = Heartbeat(runtime, settings, self.table, lifecycle=self.lifecycle, boot_id=self.boot_id,
                                   warm_interpreters=self.warm_ranks)
        self.cordon = CordonFollower(runtime, settings.node_id, kube.KubeNodeWatch(
            settings.kube_api_url, settings.kube_node_name, token_file=settings.kube_token_file,
            ca_file=settings.kube_ca_file)) if settings.kube_node_name else None

    def _warm_pool(self) -> WarmPool | None:
        if self.warm_ranks <= 0:
            return None
        s = self.settings
        # one thread while importing: the rank's own share is set when it starts (TRAINYARD_CPU_THREADS)
        env = interpreter_env(self.base_env, cpu_threads=1 if s.device_type == "cpu" else None, extra=s.rank_env)
        return WarmPool(self.warm_ranks, s.warm_module, env, s.agent_state_path.parent / "warm.log")

    @property
    def ranks(self) -> dict[str, RankSupervisor]:
        """Rank key → the supervisor of a rank launched or adopted here (the rank table)."""
        return self.table.ranks

    def install(self) -> None:
        """The rank network rules (ConfigError: refuse to start), then subscribe (a group of its own: every agent
        sees every allocation), heartbeat, watchdogs."""
        self.rank_network.install()
        self.runtime.bus.subscribe(
            ALLOCATIONS,
            {GangAllocated: self.launcher.on_gang_allocated, AllocationRevoked: self.control.on_allocation_revoked,
             CheckpointRequested: self.control.on_checkpoint_requested,
             ReplicaReplaced: self.replicas.on_replica_replaced},
            group=self.group, deduper_factory=self.runtime.deduper,
        )
        s = self.settings
        self.runtime.add_loop("heartbeat", self.heartbeat.send, s.heartbeat_s)
        self.runtime.add_loop("hang-watchdog", self.control.check_hangs,
                              min(1.0, s.hang_timeout_s / 4, s.first_step_timeout_s / 4))
        self.runtime.add_loop("lease-check", self.control.check_leases, s.lease_check_s)
        self.runtime.add_loop("local-state", self.table.flush_local, 1.0)
        self.runtime.add_loop("confirmations", self.announcements.confirm, s.confirm_interval_s)
        self.runtime.add_loop("lighthouses", self.lighthouses.check, 1.0)
        if self.pool is not None:
            self.runtime.add_loop("warm-pool", self.starter.refill_pool, 0.5)
        if self.cordon is not None:
            self.runtime.add_loop("kubernetes-cordon", self.cordon.follow, s.kube_poll_s)

    async def prepare(self) -> None:
        """Before ``runtime.start()`` (Redis and the broker may still be down): adopt the ranks an
        earlier incarnation of this agent left running; note the ones that ended meanwhile."""
        await self.recovery.adopt()

    async def start(self) -> None:
        """After ``runtime.start()``: watch the adopted ranks; report the ones that ended unwatched."""
        for supervisor in self.table.supervisors():  # waiting for Redis and the broker was not the ranks' fault
            supervisor.restart_hang_window()
        self.lifecycle.serve()
        log.info("%d warm interpreter(s) for the built-in trainer's ranks (%s)", self.warm_ranks,
                 "TRAINYARD_WARM_RANKS" if self.settings.warm_ranks is not None else
                 "one per device, at most an eighth of the available memory at 512 MiB each")
        if self.pool is not None:
            self.pool.fill()  # the first; the warm-pool loop starts the rest, one at a time
        await self.recovery.resume()
        await self.replicas.resume()  # the Lighthouses of fault-tolerant attempts whose rank 0 runs here
        self.background.spawn(self.attempts.collect_code())  # what an earlier incarnation quarantined, unused

    async def aclose(self) -> None:
        """Drain (ask the ranks to checkpoint and stop, up to ``drain_timeout_s``), then stop every rank still
        running (SIGTERM, then SIGKILL after the grace), report the exits, flush.

        An agent that never finished starting leaves the ranks alone: the next one adopts them.
        """
        if not self.lifecycle.close():
            return
        if not self.lifecycle.serving:
            self.table.save_local(force=True)
            log.info("node agent %s stopped before serving; its ranks keep running", self.settings.node_id)
            return
        try:  # tell the scheduler first, so nothing new is placed here
            await self.heartbeat.send()
        except Exception as exc:  # noqa: BLE001 - best effort; the heartbeat timeout says the same
            log.warning("could not send the final heartbeat: %r", exc)
        await self.control.drain()
        await self._stop_ranks()
        await self.lighthouses.aclose()
        self.background.cancel()
        await self._flush_outbox(timeout_s=5.0)
        if self.pool is not None:
            await self.pool.aclose()
        if self.cordon is not None:
            await self.cordon.aclose()
        self.code_cache.close()
        self.env_cache.close()
        self.table.save_local(force=True)
        self.rank_network.remove()  # its ranks are stopped (an agent that leaves them running keeps the rules)
        log.info("node agent %s stopped", self.settings.node_id)

    async def _stop_ranks(self) -> None:
        """What the drain left running: stopped (SIGTERM, SIGKILL after the grace), its exits reported."""
        stops = [s.apply(Trigger.AGENT_STOPPING, "the node agent stopped")
                 for s in self.table.supervisors() if s.rank.running]
        if stops:
            log.info("stopping %d rank(s) before shutdown", len(stops))
        await asyncio.gather(*(stop for stop in stops if stop is not None))
        watchers = [r.watcher for r in self.table.records() if r.watcher]
        if watchers:
            await asyncio.wait(watchers, timeout=15.0)

    async def _flush_outbox(self, timeout_s: float) -> None:
        """Publish what the outbox holds, for up to ``timeout_s`` (best effort: the outbox is durable)."""
        deadline = self.clock.monotonic() + timeout_s

        async def relay_all() -> None:
            while self.clock.monotonic() < deadline and await self.runtime.outbox.pending():
                await self.runtime.outbox.relay_once(self.runtime.bus)

        await backoff.retry(relay_all, policy=backoff.SHUTDOWN_FLUSH, give_up=backoff.past(deadline, self.clock),
                            clock=self.clock, what="flushing the outbox before shutdown")
