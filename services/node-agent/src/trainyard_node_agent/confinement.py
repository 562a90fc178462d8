"""The agent's side of the rank sandbox (:mod:`sandbox`): decide at start-up whether ranks can be
confined here (refuse to start when ``enforce`` cannot be had), and before each launch give the rank's
files to the job's user and wrap its command in the exec wrapper.

An attempt is contained as a whole (:class:`AttemptScopes`): before its first rank here starts, the agent
makes its cgroup (:mod:`cgroups`: pids, memory and CPU limits) and its private ``/dev/shm`` (a size-limited
tmpfs under the agent's state directory, the job's uid's alone, bound on ``/dev/shm`` in each of its ranks'
sandboxes, and taken off the host once they all are: it then lives in their namespaces only); when its last
rank here has ended the agent kills the cgroup (nothing a rank left behind, a
``setsid`` double-fork included, survives), removes it and unmounts the tmpfs. At start-up it does the same
to every attempt it no longer looks after (never to one whose ranks it adopted)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainyard_contract.errors import ConfigError
from trainyard_contract.events import GangAllocated
from trainyard_contract.hfdir import HfDirError, resolve_start
from trainyard_contract.storage import ArtifactLayout, uri_to_path

from trainyard_node_agent import cgroups, launcher
from trainyard_node_agent import sandbox as sb
from trainyard_node_agent.settings import NodeAgentSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Confined:
    """A rank's command, wrapped (or as it was, on a trusted node), the uid it runs as (None: the agent's) and
    its sandbox plan as JSON (None on a trusted node): a warm interpreter enters it itself (:mod:`warm`)."""

    command: list[str]
    uid: int | None
    plan: str | None = None


class Confinement:
    """Ranks confined per ``settings.node_sandbox``; see :mod:`sandbox`."""

    def __init__(self, settings: NodeAgentSettings, layout: ArtifactLayout,
                 node_layout: ArtifactLayout | None = None) -> None:
        self.mode = settings.node_sandbox
        self.first_uid, self.uid_count = settings.sandbox_first_uid, settings.sandbox_uid_count
        self.layout = layout
        self.node_layout = node_layout or layout  # the attempts' own files (the artifact root when local)
        local = [self.node_layout.root, settings.code_cache_path, settings.env_cache_path,
                 settings.agent_state_path.parent,
                 settings.shard_cache_path, *([] if layout.remote else [layout.root]),
                 *(p.expanduser() for p in settings.sandbox_hide)]
        platform = tuple(dict.fromkeys(p.resolve() for p in local))
        # the anchors the rank's own paths are opened from (never through a link below them), as configured too
        self.platform = tuple(dict.fromkeys((*platform, *(Path(p) for p in local if Path(p).is_absolute()))))
        self.hidden = tuple(dict.fromkeys((*platform, *sb.host_hidden())))
        # the import path may lie under the agent user's home (a checkout there): bound back, read-only;
        # never anything of the platform's own paths
        self.runtime = sb.runtime_paths(platform)
        self.scopes = AttemptScopes(settings) if self.enforced else None

    @property
    def enforced(self) -> bool:
        return self.mode == sb.ENFORCE

    def close_attempt(self, job_id: str, attempt: int) -> None:
        """The attempt's last rank here has ended: kill what is left of it, remove its cgroup and /dev/shm."""
        if self.scopes is not None:
            self.scopes.close(job_id, attempt)

    def detach_shm(self, job_id: str, attempt: int, exit_files: Collection[Path]) -> None:
        """Once every rank of the attempt here is in its sandbox (its wrapper wrote its pid file, after binding
        /dev/shm), take the attempt's tmpfs off the host: it lives on in the ranks' mount namespaces only, and
        goes with the last of them, even if this agent is killed."""
        pid_files = [Path(launcher.pid_file_for(str(f))) for f in exit_files]
        if self.scopes is not None and pid_files and all(p.exists() for p in pid_files):
            self.scopes.detach_shm(job_id, attempt)

    def sweep(self, live: Collection[tuple[str, int]]) -> None:
        """At start-up: close every attempt scope left here except those of ``live`` (job, attempt) pairs."""
        if self.scopes is not None:
            self.scopes.sweep(live)

    def oom_files(self, job_id: str, attempt: int) -> tuple[Path, ...]:
        """Where the attempt cgroup counts its OOM kills (none on a trusted node)."""
        return () if self.scopes is None else self.scopes.plan(job_id, attempt).oom_files

    def check(self) -> None:
        """At start-up: ConfigError when ``enforce`` cannot be had here; a loud warning on a trusted node."""
        if not self.enforced:
            log.warning("TRAINYARD_NODE_SANDBOX=trusted-single-tenant: no cgroup per attempt, PID namespace, private "
                        "/dev/shm or seccomp filter either: a process a rank leaves behind may outlive its job")
            log.warning("TRAINYARD_NODE_SANDBOX=trusted-single-tenant: ranks run UNSANDBOXED as the agent's user "
                        "(uid %d): every rank can read and overwrite every tenant's checkpoints, datasets and "
                        "code under %s and signal any other rank on this node. Use this only for a node that runs "
                        "one tenant's trusted code", os.geteuid(), self.layout.root)
            return
        if self.layout.remote:
            raise ConfigError(
                f"TRAINYARD_NODE_SANDBOX=enforce with the object-store artifact root {self.layout.root}: ranks "
                "write their checkpoints to the store with credentials a sandbox cannot scope to the job's own "
                "prefix, so it would not keep tenants apart. For a node that only ever runs one tenant's trusted "
                "code, set TRAINYARD_NODE_SANDBOX=trusted-single-tenant (see docs/production.md, Object storage)")
        why = sb.check_host(first_uid=self.first_uid)
        if why is not None:
            raise ConfigError(
                f"TRAINYARD_NODE_SANDBOX=enforce, but ranks cannot be sandboxed on this host: {why}. Run the node "
                "agent as root (it needs to create mount namespaces and switch ranks to their job's user: "
                "CAP_SYS_ADMIN, CAP_SETUID, CAP_SETGID, CAP_CHOWN), or, for a node that only ever runs one "
                "tenant's trusted code, set TRAINYARD_NODE_SANDBOX=trusted-single-tenant (ranks then see every "
                "tenant's files: see docs/sandbox.md)")
        assert self.scopes is not None
        why = self.scopes.check()
        if why is not None:
            raise ConfigError(
                f"TRAINYARD_NODE_SANDBOX=enforce, but attempts cannot be contained on this host: {why}. The node "
                "agent must be able to create cgroups under its own (a writable /sys/fs/cgroup: root, or a delegated "
                "subtree) and mount tmpfs; or, for a node that only ever runs one tenant's trusted code, set "
                "TRAINYARD_NODE_SANDBOX=trusted-single-tenant")
        log.info("ranks are sandboxed (TRAINYARD_NODE_SANDBOX=enforce): each job's ranks run as their own uid in "
                 "[%d, %d) and see only their own paths under %s; each attempt in its own cgroup (%s: %s), each "
                 "rank in its own PID namespace under a seccomp filter, each attempt's ranks with a private "
                 "/dev/shm of %d MiB", self.first_uid, self.first_uid + self.uid_count, self.layout.root,
                 self.scopes.layout.kind, self.scopes.describe(), self.scopes.shm_bytes // 2**20)

    def uid_of(self, job_id: str) -> int:
        return sb.job_uid(job_id, first=self.first_uid, count=self.uid_count)

    def clash(self, job_id: str, live_jobs: Sequence[str]) -> str | None:
        """Why ``job_id`` cannot be launched next to the jobs running here (a shared uid), or None."""
        if not self.enforced:
            return None
        uid = self.uid_of(job_id)
        other = sb.uid_clash(job_id, uid, {j: self.uid_of(j) for j in live_jobs})
        return None if other is None else (
            f"job {job_id} would run as uid {uid}, which job {other} running on this node has "
            "(a hash collision in TRAINYARD_SANDBOX_FIRST_UID/UID_COUNT): not running them side by side")

    def confine(self, command: Sequence[str], event: GangAllocated, *, rank: int, events_file: Path,
                exit_file: Path, scratch: Path, code_dir: Path | None = None, cwd: Path | None = None,
                datasets: Sequence[Path] = (), env_dir: Path | None = None) -> Confined:
        """Prepare the rank's files for its user and wrap ``command`` (as it is on a trusted node)."""
        if not self.enforced:
            return Confined(list(command), None, None)
        uid = self.uid_of(event.job_id)
        start = uri_to_path(event.start_checkpoint.manifest_uri).parent if event.start_checkpoint else None
        weights = start_weights(self.layout, event)
        view = sb.RankView(
            attempt_dir=self.node_layout.attempt_dir(event.tenant, event.job_id, event.attempt),
            checkpoints=self.layout.checkpoints_dir(event.tenant, event.job_id), scratch=scratch,
            datasets=tuple(datasets) or (dataset_dir(self.layout, event.spec.dataset),), code_dir=code_dir,
            env_dir=env_dir, cwd=cwd, start_checkpoint=start, start_weights=weights,
            calibration=self.node_layout.root.joinpath(*sb.CALIBRATION),
            runtime=self.runtime,
        )
        sb.apply_ownership(sb.ownership(view, events_file=events_file, exit_dir=exit_file.parent, uid=uid, gid=uid))
        plan = sb.plan_rank(view, uid=uid, gid=uid, hidden=self.hidden, anchors=self.platform,
                            start_error_file=Path(launcher.start_error_file_for(str(exit_file))))
        assert self.scopes is not None
        cgroup, shm = self.scopes.open(event.job_id, event.attempt, uid)
        plan = dataclasses.replace(plan, cgroup_procs=tuple(str(p) for p in cgroup.procs), shm=str(shm),
                                   pid_file=launcher.pid_file_for(str(exit_file)))
        log.debug("rank %d of %s confined as uid %d: %s", rank, event.allocation_id, uid, plan.to_json())
        return Confined(sb.wrap(command, plan), uid, plan.to_json())


def start_weights(layout: ArtifactLayout, event: GangAllocated) -> Path | None:
    """The ``initFrom.huggingFace`` directory the ranks may read (symlinks resolved), or None: none named,
    or it resolves outside the job's tenant prefix (not bound: the trainer then fails saying so)."""
    init = event.spec.init_from
    if init is None or init.hugging_face is None or layout.remote:  # an object store: nothing to bind
        return None
    try:
        found = resolve_start(layout, event.tenant, init.hugging_face)
        assert isinstance(found, Path)  # a directory root
        return found
    except HfDirError as exc:
        log.warning("not showing job %s's ranks its initFrom.huggingFace directory: %s", event.job_id, exc)
        return None


def dataset_dir(layout: ArtifactLayout, dataset: str) -> Path:
    """The spec's dataset (qualified: a tenant's under its prefix, else the platform's)."""
    return layout.dataset_ref_dir(dataset)


def scrubbed(base_env: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment without what a rank must not inherit (logged by name, never by value)."""
    env, removed = sb.scrub_env(base_env)
    if removed:
        log.info("not passing %d secret-looking variable(s) of the agent's environment on to ranks: %s",
                 len(removed), ", ".join(removed))
    return env


class AttemptScopes:
    """Each attempt's cgroup and private /dev/shm on this node (see the module's docstring). Blocking I/O:
    call :meth:`close` and :meth:`sweep` off the event loop."""

    def __init__(self, settings: NodeAgentSettings) -> None:
        self.layout, self.own = cgroups.host_layout()
        self.limits = cgroups.Limits(pids=settings.attempt_pids_max, memory_bytes=settings.attempt_memory_bytes,
                                     cpu_cores=settings.attempt_cpu_cores)
        self.shm_root = settings.agent_state_path.parent / "shm"
        self.root = cgroups.agent_root(settings.node_id, self.shm_root.resolve())
        self.shm_bytes = settings.attempt_shm_bytes
        self._lock = threading.Lock()  # close() runs in a worker thread

    def describe(self) -> str:
        limits = [f"pids.max {self.limits.pids}" if self.limits.pids else "",
                  f"memory {self.limits.memory_bytes // 2**20} MiB" if self.limits.memory_bytes else "",
                  f"{self.limits.cpu_cores} cores" if self.limits.cpu_cores else ""]
        return ", ".join(x for x in limits if x) or "no limits"

    def plan(self, job_id: str, attempt: int) -> cgroups.CgroupPlan:
        return cgroups.plan(self.layout, self.own, cgroups.attempt_name(job_id, attempt), self.limits, self.root)

    def shm_dir(self, job_id: str, attempt: int) -> Path:
        return self.shm_root / cgroups.attempt_name(job_id, attempt)

    def check(self) -> str | None:
        """None when attempts can be contained here, else why not (a throwaway scope made and removed)."""
        if self.layout.kind == "none":
            return "no cgroup hierarchy is mounted"
        if self.layout.unified is None and "freezer" not in self.layout.v1:
            return "neither cgroup2 (cgroup.kill) nor the v1 freezer is mounted: an attempt could not be killed whole"
        try:
            self.open("trainyard-check", os.getpid(), 65534)
        except OSError as exc:
            return f"cannot make an attempt's cgroup or /dev/shm: {exc}"
        finally:
            self.close("trainyard-check", os.getpid())
        return None

    def open(self, job_id: str, attempt: int, uid: int) -> tuple[cgroups.CgroupPlan, Path]:
        """Make (once) the attempt's cgroup and its /dev/shm owned by ``uid``; raises OSError when it cannot."""
        plan = self.plan(job_id, attempt)
        shm = self.shm_dir(job_id, attempt)
        with self._lock:
            for problem in cgroups.create(plan):
                log.warning("attempt %d of %s: %s", attempt, job_id, problem)
            if not os.path.ismount(shm):
                self.shm_root.mkdir(parents=True, exist_ok=True, mode=0o700)
                shm.mkdir(mode=0o700, exist_ok=True)
                sb._Libc().mount("tmpfs", str(shm), "tmpfs", sb.MS_NOSUID | sb.MS_NODEV | sb.MS_NOEXEC,
                                 f"size={self.shm_bytes},mode=0700,uid={uid},gid={uid}")
        return plan, shm

    def close(self, job_id: str, attempt: int) -> None:
        """Kill everything in the attempt's cgroup, remove it, unmount and remove its /dev/shm."""
        plan = self.plan(job_id, attempt)
        with self._lock:
            if not cgroups.kill(plan):
                log.error("attempt %d of %s: processes still in its cgroup after SIGKILL: %s", attempt, job_id,
                          sorted(cgroups.members(plan)))
            left = sorted(cgroups.members(plan))
            if not left:
                cgroups.remove(plan)
            self._unmount(self.shm_dir(job_id, attempt))

    def detach_shm(self, job_id: str, attempt: int) -> None:
        with self._lock:
            self._unmount(self.shm_dir(job_id, attempt))

    def _unmount(self, shm: Path) -> None:
        with contextlib.suppress(OSError):
            while os.path.ismount(shm):
                sb._Libc().umount(str(shm), MNT_DETACH)
        with contextlib.suppress(FileNotFoundError):
            try:
                shm.rmdir()
            except OSError as exc:
                log.warning("cannot remove the attempt's /dev/shm %s: %s", shm, exc)

    def sweep(self, live: Collection[tuple[str, int]]) -> None:
        """Close every scope found here that belongs to none of ``live`` (attempts whose ranks were adopted)."""
        keep = {cgroups.attempt_name(job, attempt) for job, attempt in live}
        found = cgroups.existing(self.layout, self.own, self.root)
        with contextlib.suppress(OSError):
            found |= {e.name for e in os.scandir(self.shm_root) if e.is_dir(follow_symlinks=False)}
        for name in sorted(found - keep):
            log.warning("closing the scope of attempt %s, which no rank here belongs to any more (left by an "
                        "earlier agent): killing what is left in it", name)
            plan = cgroups.plan(self.layout, self.own, name, self.limits, self.root)
            with self._lock:
                cgroups.kill(plan)
                cgroups.remove(plan)
                self._unmount(self.shm_root / name)


MNT_DETACH = 2
