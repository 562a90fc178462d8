"""A cgroup per attempt: every process of an attempt's ranks on this node — including one that double-forked
and called ``setsid`` — is in it, limited together (pids, memory, CPU) and killed as a unit when the attempt
ends, so nothing outlives it.

Pure: :func:`detect` reads the layout from the mount table (pure v2 at ``/sys/fs/cgroup``; a hybrid host with
v1 controllers and a controller-less cgroup2 at ``/sys/fs/cgroup/unified``; v1 only), :func:`plan` turns it
into what to create for one attempt (``<agent's own cgroup>/trainyard/<job>.a<attempt>`` in each hierarchy
used), which limit files to write and how to kill it. I/O: :func:`create`, :func:`join` (the exec wrapper
writes its own pid before it drops privileges), :func:`kill` (``cgroup.kill`` where a cgroup2 hierarchy
exists; v1 only: freeze, SIGKILL every pid in ``cgroup.procs``, thaw, until empty) and :func:`remove`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Kind = Literal["v2", "hybrid", "v1", "none"]
ROOT_NAME = "trainyard"
USED_V1 = ("memory", "pids", "cpu", "freezer")
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mounts`` that is a cgroup hierarchy."""

    path: Path
    fstype: str  # cgroup | cgroup2
    options: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Layout:
    """Which cgroup hierarchies this host has, and where."""

    kind: Kind
    unified: Path | None = None  # a cgroup2 mount: cgroup.kill, cgroup.procs (and the limits, on pure v2)
    v1: Mapping[str, Path] = field(default_factory=dict)  # controller -> its v1 mount


@dataclass(frozen=True)
class Limits:
    """What an attempt may use on this node (None: no limit)."""

    pids: int | None = None
    memory_bytes: int | None = None
    cpu_cores: float | None = None


@dataclass(frozen=True)
class CgroupPlan:
    """What one attempt's cgroup is made of on this host."""

    name: str
    dirs: tuple[Path, ...] = ()  # the attempt's cgroup in each hierarchy used (parents created too)
    enable: tuple[tuple[Path, str], ...] = ()  # pure v2: subtree_control files to write, parents first
    limits: tuple[tuple[Path, str], ...] = ()  # (file, value)
    kill_file: Path | None = None  # cgroup.kill
    freezer: Path | None = None  # v1 freezer.state (v1 only)
    oom_files: tuple[Path, ...] = ()  # memory.events (v2) or memory.oom_control (v1)

    @property
    def procs(self) -> tuple[Path, ...]:
        """The ``cgroup.procs`` files a process writes its pid to, to join the attempt."""
        return tuple(d / "cgroup.procs" for d in self.dirs)


# ----------------------------------------------------------------------------- pure


def parse_mounts(text: str) -> list[Mount]:
    """The cgroup hierarchies in a ``/proc/self/mounts`` text."""
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            found.append(Mount(Path(parts[1].replace("\\040", " ")), parts[2], frozenset(parts[3].split(","))))
    return found


def parse_own(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as hierarchy key -> path: ``""`` for cgroup2, else each v1 controller."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if parts[0] == "0" and controllers == "":
            own[""] = path
        for controller in filter(None, controllers.split(",")):
            own[controller] = path
    return own


def detect(mounts: Iterable[Mount]) -> Layout:
    """The layout the mount table describes. Pure."""
    mounts = list(mounts)
    v1 = {c: m.path for m in mounts if m.fstype == "cgroup" for c in USED_V1 if c in m.options}
    unified = next((m.path for m in mounts if m.fstype == "cgroup2"), None)
    if v1:
        return Layout("hybrid" if unified is not None else "v1", unified, v1)
    return Layout("v2", unified, {}) if unified is not None else Layout("none")


def agent_root(node_id: str, state_dir: Path) -> str:
    """``trainyard/<node>-<hash of its state directory>``: one agent's attempts, apart from another agent's
    on the same host (tests run several)."""
    tag = hashlib.sha256(str(state_dir).encode()).hexdigest()[:8]
    return f"{ROOT_NAME}/{re.sub(r'[^A-Za-z0-9_-]', '_', node_id)[:64]}-{tag}"


def attempt_name(job_id: str, attempt: int) -> str:
    """``<job>.a<attempt>``, the job id made safe for a directory name (a hash added when it had to change)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", job_id)[:100]
    if safe != job_id:
        safe += "-" + hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return f"{safe}.a{attempt}"


def base_dirs(layout: Layout, own: Mapping[str, str], root: str = ROOT_NAME) -> dict[str, Path]:
    """Hierarchy key (``""`` for cgroup2) -> the agent's directory (``root``) under its own cgroup."""
    bases: dict[str, Path] = {}
    if layout.unified is not None:
        bases[""] = layout.unified / own.get("", "/").lstrip("/") / root
    for controller, mount in layout.v1.items():
        bases[controller] = mount / own.get(controller, "/").lstrip("/") / root
    return bases


def plan(layout: Layout, own: Mapping[str, str], name: str, limits: Limits, root: str = ROOT_NAME) -> CgroupPlan:
    """What to create, write and kill for the attempt ``name`` (under ``root``, below the agent's own cgroup). Pure."""
    bases = base_dirs(layout, own, root)
    if layout.kind == "none":
        return CgroupPlan(name)
    if layout.kind == "v2":
        top = bases[""]
        here = top / name
        wanted = [c for c, v in (("memory", True), ("pids", limits.pids), ("cpu", limits.cpu_cores)) if v]
        own_dir = layout.unified / own.get("", "/").lstrip("/")  # type: ignore[operator]  # v2: unified is set
        chain = [own_dir, *(own_dir / Path(*Path(root).parts[:i]) for i in range(1, len(Path(root).parts) + 1))]
        # one controller per write: one the host lacks (cpu) must not keep the others off
        enable = tuple((d / "cgroup.subtree_control", f"+{c}") for d in chain for c in wanted)
        values = _limit_values(limits, v2=True)
        return CgroupPlan(name, (here,), enable if wanted else (),
                          tuple((here / f, v) for f, v in values), here / "cgroup.kill", None,
                          (here / "memory.events",))
    dirs: list[Path] = []
    if "" in bases:
        dirs.append(bases[""] / name)
    used = {"memory": True, "pids": True, "cpu": limits.cpu_cores is not None, "freezer": layout.unified is None}
    v1_dirs = {c: bases[c] / name for c in layout.v1 if used[c]}
    dirs += v1_dirs.values()
    files = {"pids.max": "pids", "memory.limit_in_bytes": "memory", "cpu.cfs_period_us": "cpu",
             "cpu.cfs_quota_us": "cpu"}
    limit_files = tuple((v1_dirs[files[f]] / f, v) for f, v in _limit_values(limits, v2=False)
                        if files[f] in v1_dirs)
    return CgroupPlan(
        name, tuple(dict.fromkeys(dirs)), (), limit_files,
        bases[""] / name / "cgroup.kill" if "" in bases else None,
        v1_dirs["freezer"] / "freezer.state" if "freezer" in v1_dirs else None,
        (v1_dirs["memory"] / "memory.oom_control",) if "memory" in v1_dirs else (),
    )


def _limit_values(limits: Limits, *, v2: bool) -> list[tuple[str, str]]:
    values: list[tuple[str, str]] = []
    if limits.pids is not None:
        values.append(("pids.max", str(limits.pids)))
    if limits.memory_bytes is not None:
        values.append(("memory.max" if v2 else "memory.limit_in_bytes", str(limits.memory_bytes)))
    if limits.cpu_cores is not None:
        quota = max(int(limits.cpu_cores * CPU_PERIOD_US), 1000)
        values += [("cpu.max", f"{quota} {CPU_PERIOD_US}")] if v2 else \
            [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(quota))]
    return values


# ----------------------------------------------------------------------------- I/O


def host_layout() -> tuple[Layout, dict[str, str]]:
    """This host's layout and the agent's own cgroups (from ``/proc/self``)."""
    try:
        mounts = Path("/proc/self/mounts").read_text()
        own = Path("/proc/self/cgroup").read_text()
    except OSError:
        return Layout("none"), {}
    return detect(parse_mounts(mounts)), parse_own(own)


def create(p: CgroupPlan) -> list[str]:
    """Create the attempt's cgroup and write its limits; what could not be done (a limit this host does not
    allow here), for a log line. Raises OSError when the cgroup itself cannot be made."""
    problems = []
    for d in p.dirs:
        d.mkdir(parents=True, exist_ok=True)
    for path, value in p.enable:
        try:
            path.write_text(value)
        except OSError as exc:  # e.g. EBUSY: the agent's own cgroup holds processes (no delegated subtree)
            problems.append(f"cannot enable {value} in {path}: {exc.strerror}")
    for path, value in p.limits:
        try:
            path.write_text(value)
        except OSError as exc:
            problems.append(f"cannot set {path.name}={value}: {exc.strerror}")
    return problems


def join(procs: Iterable[str | Path], pid: int = 0) -> None:
    """Move ``pid`` (0: the caller) into each of the attempt's ``cgroup.procs``."""
    for path in procs:
        with open(path, "w", encoding="ascii") as fh:
            fh.write(str(pid or os.getpid()))


def members(p: CgroupPlan) -> set[int]:
    """The pids in the attempt's cgroup (every hierarchy)."""
    pids: set[int] = set()
    for procs in p.procs:
        with contextlib.suppress(OSError):
            pids.update(int(x) for x in procs.read_text().split())
    return pids


def kill(p: CgroupPlan, *, timeout_s: float = 10.0) -> bool:
    """SIGKILL everything in the attempt's cgroup; True once it is empty."""
    deadline = time.monotonic() + timeout_s
    while members(p):
        if p.kill_file is not None and p.kill_file.parent.exists():
            with contextlib.suppress(OSError):
                p.kill_file.write_text("1")
        else:
            _kill_frozen(p)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_frozen(p: CgroupPlan) -> None:
    """v1 without cgroup.kill: freeze (nothing forks meanwhile), SIGKILL each pid, thaw (so they die)."""
    frozen = False
    if p.freezer is not None:
        with contextlib.suppress(OSError):
            p.freezer.write_text("FROZEN")
            frozen = True
    for pid in members(p):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if frozen:
        with contextlib.suppress(OSError):
            p.freezer.write_text("THAWED")  # type: ignore[union-attr]  # frozen: it has a freezer


def remove(p: CgroupPlan, *, timeout_s: float = 5.0) -> bool:
    """Remove the attempt's (empty) cgroup directories, and the agent's directory above them once it holds no
    other attempt; True when none of the attempt's is left."""
    deadline = time.monotonic() + timeout_s
    left = [d for d in p.dirs if d.exists()]
    while left:
        for d in list(left):
            try:
                d.rmdir()
                left.remove(d)
            except FileNotFoundError:
                left.remove(d)
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("cannot remove the cgroup %s: %s", d, exc.strerror)
                    return False
        if left:
            time.sleep(0.02)
    for d in p.dirs:
        with contextlib.suppress(OSError):  # another attempt in it (EBUSY, ENOTEMPTY): it stays
            d.parent.rmdir()
    return True


def existing(layout: Layout, own: Mapping[str, str], root: str = ROOT_NAME) -> set[str]:
    """The attempt cgroups under the agent's directory (for the sweep at start-up)."""
    names: set[str] = set()
    for base in base_dirs(layout, own, root).values():
        with contextlib.suppress(OSError):
            names.update(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False))
    return names

