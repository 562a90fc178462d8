"""Starting one rank of an allocation: 1. its record and, for user code, its paths 2. its environment
(:func:`admission.rank_env`) 3. its process, in its sandbox (:mod:`confinement`) — cold under the launcher, or
in a warm interpreter for the built-in trainer (:class:`WarmPool`) 4. its supervisor takes over. What keeps a
rank from starting is its exit (a WorkerExited with the reason), never a silent skip.

The starter owns the warm pool: it takes interpreters from it and tops it up when the node is quiet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from trainyard_contract.events import (
    GangAllocated,
    NodeAssignment,
    RankAssignment,
    WorkerStarted,
)
from trainyard_contract.exitcodes import CONFIG
from trainyard_contract.spec import Code
from trainyard_contract.spool import SpoolReader
from trainyard_contract.storage import ArtifactLayout, path_to_uri
from trainyard_runtime.service import ServiceRuntime

from trainyard_node_agent import ranks as rp
from trainyard_node_agent.admission import cpu_thread_share, rank_env
from trainyard_node_agent.announcements import Announcements
from trainyard_node_agent.attempt_files import checkpoint_request_file, exit_file_for
from trainyard_node_agent.attempts import Attempts
from trainyard_node_agent.clock import Clock
from trainyard_node_agent.codecache import CodeTree, RankPaths, rank_paths
from trainyard_node_agent.confinement import Confined, Confinement
from trainyard_node_agent.envprep import Prepared
from trainyard_node_agent.lifecycle import Lifecycle
from trainyard_node_agent.rank_table import RankTable
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.supervision import Trigger
from trainyard_node_agent.supervisor import RankSupervisor
from trainyard_node_agent.warmpool import WarmPool

log = logging.getLogger(__name__)

StartedHow = tuple[Literal["warm", "cold"], str]  # WorkerStarted.start and .start_detail


class RankStarter:
    """Starts a rank's process in its sandbox and hands it to its supervisor; keeps the warm pool."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, *, layout: ArtifactLayout,
                 node_layout: ArtifactLayout, base_env: Mapping[str, str], backend: str, sandbox: Confinement,
                 pool: WarmPool | None, table: RankTable, attempts: Attempts, announcements: Announcements,
                 lifecycle: Lifecycle, clock: Clock) -> None:
        self.runtime, self.settings, self.layout, self.node_layout = runtime, settings, layout, node_layout
        self.base_env, self.backend, self.sandbox, self.pool = base_env, backend, sandbox, pool
        self.table, self.attempts, self.announcements = table, attempts, announcements
        self.lifecycle, self.clock = lifecycle, clock
        self._usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def record(self, event: GangAllocated, slot: RankAssignment, traceparent: str | None, *,
               code: Code | None, environment: str | None = None, generation: int = 0) -> rp.RankProcess:
        """The rank's record: who it is and where its files lie on this node (a replaced replica's newcomer, of
        ``generation`` n, has files of its own: ``….g<n>…``)."""
        def own(path: Path) -> Path:
            return path.with_name(f"{path.stem}.g{generation}{path.suffix}") if generation else path

        events_file = own(self.node_layout.rank_events(event.tenant, event.job_id, event.attempt, slot.rank))
        return rp.RankProcess(
            job_id=event.job_id, tenant=event.tenant, attempt=event.attempt,
            allocation_id=event.allocation_id, epoch=event.epoch, rank=slot.rank, local_rank=slot.local_rank,
            pid=0, log_path=self.node_layout.rank_log(event.tenant, event.job_id, event.attempt, slot.rank, generation),
            spool=SpoolReader(events_file), traceparent=traceparent,
            exit_file=own(exit_file_for(self.node_layout, event.tenant, event.job_id, event.attempt, slot.rank)),
            device_index=slot.device_index, code_archive=code.archive if code is not None else None,
            environment=environment,
            start_manifest_uri=event.start_checkpoint.manifest_uri if event.start_checkpoint else None,
            generation=generation,
        )

    async def start(self, event: GangAllocated, share: NodeAssignment, slot: RankAssignment,
                    allocation_file: Path, traceparent: str | None, tree: CodeTree | None,
                    prepared: Prepared | None = None, *, generation: int = 0) -> None:
        """Start one rank: 1. its record and, for user code, its paths 2. its environment 3. its process, in its
        sandbox 4. its supervisor takes over (:meth:`_started`). What keeps it from starting is its exit."""
        code = event.spec.code if tree is not None else None
        supervisor = self.attempts.supervisor(self.record(event, slot, traceparent, code=code,
                                                          environment=prepared.environment if prepared else None,
                                                          generation=generation))
        rank = supervisor.rank
        rank.spool.path.parent.mkdir(parents=True, exist_ok=True)
        paths = None
        if code is not None and tree is not None:
            paths = rank_paths(self.layout, tenant=event.tenant, job_id=event.job_id, attempt=event.attempt,
                               rank=slot.rank, dataset=event.spec.dataset, code_dir=tree.root,
                               working_dir=code.working_dir, node_layout=self.node_layout,
                               env_dir=prepared.entry.root if prepared is not None else None)
            if not paths.cwd.is_dir():
                await supervisor.report_exit(CONFIG, "config",
                                             f"code.workingDir {code.working_dir!r} is not a directory of the "
                                             f"code tree {code.archive}")
                return
            paths.scratch.mkdir(parents=True, exist_ok=True)
        env = self._rank_env(event, share, slot, rank, allocation_file, code, paths)
        clash = self.sandbox.clash(event.job_id, self.table.running_jobs())
        if clash is not None:
            await supervisor.report_exit(127, "error", clash)
            return
        try:
            confined = self._confined(event, slot, rank, paths,
                                      code.entrypoint if code is not None else self.settings.rank_command)
            if code is not None and paths is not None:
                # User code starts cold: warm interpreters hold the built-in trainer already imported.
                rank.process = await rp.spawn(confined.command, env, rank.log_path, rank.exit_file, cwd=paths.cwd)
                how: StartedHow = ("cold", "user code starts in a new interpreter (warm ones hold the built-in trainer)"
                       + (f", in environment {rank.environment}" if rank.environment else ""))
            else:
                rank.process, how = await self._start_process(confined, env, rank.log_path, rank.exit_file)
        except OSError as exc:
            log.error("cannot start rank %d of %s: %r", slot.rank, event.allocation_id, exc)
            await supervisor.report_exit(127, "error", f"cannot start the rank launcher: {exc}")
            return
        await self._started(supervisor, how)

    def _cpu_threads(self, ranks_here: int) -> int | None:
        """Each rank's share of this node's cores, on a CPU node (None elsewhere: torch's default)."""
        if self.settings.device_type != "cpu":
            return None
        return cpu_thread_share(self._usable_cores, ranks_here, pinned=self.settings.cpu_threads_per_rank)

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
            environment=(paths.env_dir, rank.environment) if paths is not None and paths.env_dir is not None
            and rank.environment else None,
            generation=rank.generation,
        )

    def _shard_cache_dir(self, event: GangAllocated, slot: RankAssignment) -> Path:
        """The node's shared shard cache; on a sandboxed node the rank's own, in its scratch directory (a
        cached shard is trusted by its name: ranks of other jobs must not be able to plant one)."""
        if self.sandbox.enforced:
            attempt_dir = self.node_layout.attempt_dir(event.tenant, event.job_id, event.attempt)
            return attempt_dir / "scratch" / f"rank-{slot.rank}" / "shard-cache"
        return self.settings.shard_cache_path

    def _confined(self, event: GangAllocated, slot: RankAssignment, rank: rp.RankProcess, paths: RankPaths | None,
                  command: list[str]) -> Confined:
        """The rank's command in its sandbox (:mod:`confinement`; as it is on a trusted node)."""
        attempt_dir = self.node_layout.attempt_dir(event.tenant, event.job_id, event.attempt)
        return self.sandbox.confine(
            command, event, rank=slot.rank, events_file=rank.spool.path, exit_file=rank.exit_file,
            scratch=paths.scratch if paths is not None else attempt_dir / "scratch" / f"rank-{slot.rank}",
            code_dir=paths.code_dir if paths is not None else None, cwd=paths.cwd if paths is not None else None,
            datasets=paths.datasets if paths is not None else (), env_dir=paths.env_dir if paths is not None else None)

    async def _start_process(self, confined: Confined, env: Mapping[str, str], log_path: Path,
                             exit_file: Path) -> tuple[Any, StartedHow]:
        """The built-in trainer: in a warm interpreter when one is ready (which enters the rank's sandbox on a
        sandboxed node), else the confined command cold under the launcher; the process, and how it started."""
        warm = self.pool.take() if self.pool is not None else None
        why = "no warm interpreter was ready" if self.pool is not None else "this node keeps no warm interpreters"
        if warm is not None:
            rp.clear_exit_files(exit_file)
            try:
                await WarmPool.launch(warm, env=env, log_path=log_path, exit_file=exit_file, sandbox=confined.plan)
                return warm, ("warm", "forked from an interpreter that had imported torch and the trainer")
            except (OSError, ConnectionError) as exc:
                log.warning("a warm interpreter failed to take the rank (%r); starting it cold", exc)
                with contextlib.suppress(ProcessLookupError):
                    warm.kill()
                why = f"the warm interpreter failed to take it ({exc})"
        return await rp.spawn(confined.command, env, log_path, exit_file), ("cold", why)

    async def _started(self, supervisor: RankSupervisor, how: StartedHow | None = None) -> None:
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
        self.table.add(supervisor)
        await self.table.persist(rank, force_local=True)
        started = WorkerStarted(job_id=rank.job_id, attempt=rank.attempt, allocation_id=rank.allocation_id,
                                epoch=rank.epoch, node_id=self.settings.node_id, rank=rank.rank, pid=rank.pid,
                                log_uri=path_to_uri(rank.log_path), start=how[0] if how else None,
                                start_detail=how[1] if how else None, generation=rank.generation)
        await self.runtime.outbox.put(started, traceparent=rank.traceparent)
        await self.announcements.track(started, "started", rank, rank.traceparent)
        self.attempts.watch(supervisor)
        self.table.mark_changed()

    async def refill_pool(self) -> None:
        """Top the warm pool up, but not while a rank of this node is still starting (it would
        compete for the CPU with the very start-up the pool is meant to shorten), nor within
        ``warm_refill_quiet_s`` of a rank starting or ending (importing torch costs seconds of CPU: a
        burst of short jobs would pay it per job; real failures are far apart)."""
        if self.pool is None or not self.lifecycle.serving:
            return
        if any(r.running and not (r.liveness.reported or r.liveness.printed) for r in self.table.records()):
            return
        if self.clock.monotonic() - self.table.changed_at < self.settings.warm_refill_quiet_s:
            return  # ranks came or went just now (a burst of short jobs, a restart): import once it is quiet
        self.pool.fill()
