"""Ranks in a sandbox: each job's ranks run as the job's own unprivileged user, in a mount namespace
that shows them only their own paths.

``TRAINYARD_NODE_SANDBOX`` (``settings.node_sandbox``):

* ``enforce`` (default): every rank, the built-in trainer's and users' code alike, starts under
  :func:`main` (``python -I sandbox.py <plan> -- <command…>``, run by the launcher as its child). As
  root it enters a new mount namespace (propagation private), covers the artifact root, the code
  cache, the agent's state directory and ``/tmp`` with empty tmpfs mounts, binds back at the same
  absolute paths only what the rank may see (so every ``TRAINYARD_*`` path works unchanged), remounts
  the read-only ones read-only (all of them nosuid, nodev), mounts a ``/proc`` that hides other
  users' processes (``hidepid``), then drops to the job's uid/gid (no supplementary groups,
  ``PR_SET_NO_NEW_PRIVS``) and execs the command. The agent refuses to start when this cannot
  be done on the host (:func:`check_host`).
* ``trusted-single-tenant``: ranks run as the agent's user and see the whole artifact root; for a
  node that runs one tenant's trusted code only. Said loudly at start-up and in the heartbeat.

What a rank sees (:func:`plan_rank`, pure): its code tree, its environment (``code.environment``) and datasets
read-only, the start
checkpoint read-only when it belongs to another job (``initFrom``), the Hugging Face directory it
starts from read-only (``initFrom.huggingFace``: resolved by the agent, and only when it resolves
inside the job's tenant prefix; a symlink in it pointing elsewhere dangles), the peak-FLOP/s calibration
cache read-only; its job's checkpoint prefix and its attempt directory writable. Within the attempt
directory file ownership (:func:`ownership`, applied by the agent before the launch, as root) keeps
the agent's own files out of the rank's reach: the directory is root's, group-writable for the job
and sticky (the rank creates files, but cannot replace the allocation file or the checkpoint
request), the spool directory is root's with the rank's spool file pre-created and owned by the
rank (it appends; it cannot swap the file for a symlink the agent would read as root).

A job's uid is deterministic (:func:`job_uid`: a hash of the job id into a configured range), so the
ranks of one job on different nodes share it (their shards land in one checkpoint directory) and
ranks of different jobs on one node differ: they cannot signal, ptrace or read each other
(``/proc/<pid>/mem`` is refused across users and hidden). Two live jobs on one node hashing to the
same uid are refused (:func:`uid_clash`), never run side by side.

The environment a rank inherits from the agent is scrubbed of anything secret-looking
(:func:`scrub_env`): broker and Redis addresses and credentials, tokens, passwords, keys, OTLP
headers, URLs with credentials. That holds in both modes.

An attempt is one unit of processes: the wrapper first joins the attempt's cgroup (made by the agent,
:mod:`cgroups`, killed as a whole when the attempt ends), then enters new mount *and PID* namespaces: it forks
a pid 1 for the namespace (mounts its ``/proc``, reaps orphans, forwards SIGTERM/SIGINT/SIGUSR1/SIGHUP) which
forks the rank (pid 2); both leave the rank's process group (the agent's group signals reach the rank once,
directly), the wrapper writes the rank's host pid for the agent (``--pid-by-child`` of the launcher) and
ends as the rank did (the same signal, or its exit code). When the rank ends, pid 1 ends and the kernel
kills whatever the rank left in its namespace. ``/dev/shm`` is the attempt's own tmpfs (bound from the
agent's), and right before the exec a seccomp filter (:mod:`seccomp`) refuses namespaces, mounts, ptrace,
bpf, keyrings, modules, kexec.

Why not bubblewrap (CONVENTIONS.md prefers it): it is not installed on the hosts this runs on (nor in the
agent's image), so it would be a new system dependency of every node; its ``--seccomp`` takes a compiled
BPF program anyway (the filter here would remain); the agent's ownership model relies on binding paths
opened *before* the covers hide them (``O_PATH`` descriptors: a path swapped after the check is never
followed), which bwrap's path-based ``--bind`` does not do; and the warm-interpreter path must enter the
sandbox in an already running Python process (a fork of an interpreter that imported torch), which an exec
of bwrap cannot. The hand-written part stays small: one unshare, a list of mounts, two forks.

The part run as the exec wrapper uses the standard library only (it runs with ``python -I``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import importlib
import importlib.util
import json
import os
import re
import stat
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Literal

ENFORCE = "enforce"
TRUSTED = "trusted-single-tenant"
SandboxMode = Literal["enforce", "trusted-single-tenant"]
SANDBOX_EXIT = 125  # the sandbox could not be set up (the node's trouble, not the job's)
SANDBOX_FAILURE = "sandbox: cannot set up"  # how the wrapper's log line says so
START_ERROR_EXIT = 127  # the command could not be exec'd inside the sandbox
WRAPPER = Path(__file__).resolve()
CALIBRATION = ("calibration",)  # <artifact root>/calibration: the SDK's peak-FLOP/s cache (read-only here)


# ----------------------------------------------------------------------------- pure: identity


def job_uid(job_id: str, *, first: int, count: int) -> int:
    """The job's uid (and gid): ``first + sha256(job_id) mod count``, the same on every node."""
    digest = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big")
    return first + digest % count


def uid_clash(job_id: str, uid: int, live: Mapping[str, int]) -> str | None:
    """The live job (job id → uid, of ranks running here) that already has ``uid``, if not ``job_id``."""
    return next((other for other, u in sorted(live.items()) if u == uid and other != job_id), None)


# ----------------------------------------------------------------------------- pure: environment

_SECRET_NAME = re.compile(
    r"REDIS|KAFKA|BOOTSTRAP|SASL|BROKER|PASSW|SECRET|TOKEN|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|AUTH|"
    r"COOKIE|SESSION|^AWS_|^AZURE_|^GOOGLE_APPLICATION|^GCP_|^OTEL_EXPORTER_OTLP(?:_\w+)?_HEADERS$|"
    r"^OTEL_EXPORTER_OTLP_HEADERS$|(?:^|_)KEY$|DSN$|DATABASE_URL",
    re.IGNORECASE,
)
_CREDENTIAL_URL = re.compile(r"\w+://[^/\s:@]*:[^/\s@]+@")  # scheme://user:password@host
_SECRET_VALUE = re.compile(r"^(?:redis|rediss|kafka|amqp|postgres(?:ql)?|mysql|mongodb(?:\+srv)?)://",
                           re.IGNORECASE)


def is_secret(name: str, value: str) -> bool:
    """Whether an inherited variable looks like a credential or a control-plane address."""
    return bool(_SECRET_NAME.search(name) or _CREDENTIAL_URL.search(value) or _SECRET_VALUE.match(value))


def scrub_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``env`` without secret-looking variables, and the names removed (sorted)."""
    kept = {k: v for k, v in env.items() if not is_secret(k, v)}
    return kept, sorted(set(env) - set(kept))


# ----------------------------------------------------------------------------- pure: the plan


@dataclass(frozen=True)
class Bind:
    """``path`` of the host bound at the same path inside the sandbox."""

    path: str
    writable: bool = False
    optional: bool = False  # bound only if it exists (a calibration cache not written yet)
    # a trusted directory above ``path`` (the artifact root, the code cache): ``path`` is then opened by walking
    # down from it without following a link, since a rank may have swapped a directory below it (another job's
    # start checkpoint for a link to a third tenant's) between the agent's checks and this bind
    anchor: str | None = None


@dataclass(frozen=True)
class SandboxPlan:
    """Everything the exec wrapper does, as data (JSON on its command line)."""

    uid: int
    gid: int
    cover: tuple[tuple[str, int], ...]  # (path, mode) of the empty tmpfs mounts, outermost first
    binds: tuple[Bind, ...]  # parents before children
    cwd: str
    env: dict[str, str] = field(default_factory=dict)  # set on top of the rank's environment
    hide_processes: bool = True
    start_error_file: str | None = None  # where an exec failure is written for the launcher
    cgroup_procs: tuple[str, ...] = ()  # the attempt's cgroup.procs files: joined first, as root
    shm: str | None = None  # the attempt's private tmpfs (the agent's), bound on /dev/shm
    pid_namespace: bool = True  # the rank is pid 2 of its own PID namespace, under a pid-1 that forwards signals
    pid_file: str | None = None  # where the rank's pid (the host's number) is written for the agent
    seccomp: bool = True  # the filter of :mod:`seccomp`, installed right before the exec

    def to_json(self) -> str:
        return json.dumps({
            "uid": self.uid, "gid": self.gid, "cover": [list(c) for c in self.cover],
            "binds": [[b.path, b.writable, b.optional, b.anchor] for b in self.binds], "cwd": self.cwd,
            "env": self.env,
            "hideProcesses": self.hide_processes, "startErrorFile": self.start_error_file,
            "cgroupProcs": list(self.cgroup_procs), "shm": self.shm, "pidNamespace": self.pid_namespace,
            "pidFile": self.pid_file, "seccomp": self.seccomp,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SandboxPlan:
        raw = json.loads(text)
        return cls(uid=int(raw["uid"]), gid=int(raw["gid"]), cover=tuple((str(p), int(m)) for p, m in raw["cover"]),
                   binds=tuple(Bind(str(b[0]), bool(b[1]), bool(b[2]), b[3] if len(b) > 3 else None)
                               for b in raw["binds"]), cwd=str(raw["cwd"]),
                   env={str(k): str(v) for k, v in raw.get("env", {}).items()},
                   hide_processes=bool(raw.get("hideProcesses", True)), start_error_file=raw.get("startErrorFile"),
                   cgroup_procs=tuple(str(p) for p in raw.get("cgroupProcs", ())), shm=raw.get("shm"),
                   pid_namespace=bool(raw.get("pidNamespace", True)), pid_file=raw.get("pidFile"),
                   seccomp=bool(raw.get("seccomp", True)))


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def anchor_of(path: Path, anchors: Sequence[Path]) -> str | None:
    """The innermost of ``anchors`` that holds ``path`` (as written: never resolved), if any."""
    holding = [a for a in anchors if _under(path, a)]
    return str(max(holding, key=lambda a: len(a.parts))) if holding else None


def outermost(paths: Iterable[Path]) -> list[Path]:
    """The paths not inside another of them, shortest first."""
    unique = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    kept: list[Path] = []
    for p in unique:
        if not any(_under(p, k) for k in kept):
            kept.append(p)
    return kept


@dataclass(frozen=True)
class RankView:
    """What one rank may touch (from :class:`~trainyard_node_agent.codecache.RankPaths` for user code)."""

    attempt_dir: Path  # writable (ownership keeps the agent's files in it out of reach)
    checkpoints: Path  # the job's checkpoint prefix, writable
    scratch: Path  # writable, HOME
    datasets: tuple[Path, ...] = ()  # read-only
    code_dir: Path | None = None  # read-only
    env_dir: Path | None = None  # the job's environment (code.environment) from the environment cache, read-only
    cwd: Path | None = None  # default: scratch
    start_checkpoint: Path | None = None  # read-only when outside the job's prefix (initFrom)
    start_weights: Path | None = None  # a Hugging Face directory (initFrom.huggingFace, resolved), read-only
    calibration: Path | None = None  # read-only, optional
    runtime: tuple[Path, ...] = ()  # the interpreter's prefixes, read-only (bound back if under a cover)


def plan_rank(view: RankView, *, uid: int, gid: int, hidden: Sequence[Path], private_tmp: bool = True,
              start_error_file: Path | None = None, anchors: Sequence[Path] = ()) -> SandboxPlan:
    """The sandbox of one rank: ``hidden`` (artifact root, code cache, agent state) and ``/tmp`` covered,
    the rank's own paths bound back — each opened from the innermost of ``anchors`` (the platform's own
    directories) that holds it without following a link (the interpreter's prefixes are opened as they are)."""
    covered = outermost([*hidden, *([Path("/tmp")] if private_tmp else [])])
    binds: list[Bind] = []
    if view.code_dir is not None:
        binds.append(Bind(str(view.code_dir)))
    if view.env_dir is not None:
        binds.append(Bind(str(view.env_dir)))
    # a dataset or start checkpoint that does not exist fails the rank when it reads it, as it would unconfined
    maybe = [*view.datasets]
    if view.start_checkpoint is not None and not _under(view.start_checkpoint, view.checkpoints):
        maybe.append(view.start_checkpoint)
    if view.start_weights is not None:
        maybe.append(view.start_weights)
    binds += [Bind(str(p), optional=True) for p in maybe]
    if view.calibration is not None:
        binds.append(Bind(str(view.calibration), optional=True))
    binds += [Bind(str(p), writable=True) for p in (view.checkpoints, view.attempt_dir, view.scratch)]
    binds = [replace(b, anchor=anchor_of(Path(b.path), anchors)) for b in binds]
    binds += [Bind(str(p), optional=True) for p in view.runtime]
    # only what the covers hide needs binding back; parents first so a child bind lands on top
    binds = [b for b in binds if any(_under(Path(b.path), c) for c in covered)]
    binds.sort(key=lambda b: (len(Path(b.path).parts), b.path))
    cwd = view.cwd or view.scratch
    return SandboxPlan(
        uid=uid, gid=gid, cover=tuple((str(c), 0o1777 if c == Path("/tmp") else 0o755) for c in covered),
        binds=tuple(dict.fromkeys(binds)), cwd=str(cwd),
        env={"HOME": str(view.scratch), "USER": f"trainyard-{uid}", "LOGNAME": f"trainyard-{uid}",
             "TMPDIR": "/tmp"},
        start_error_file=str(start_error_file) if start_error_file else None,
    )


@dataclass(frozen=True)
class Owned:
    """A path the agent creates (if missing) and gives to ``uid``:``gid`` with ``mode`` before a launch
    (``uid``/``gid`` 0: root's)."""

    path: Path
    directory: bool
    uid: int
    gid: int
    mode: int


def ownership(view: RankView, *, events_file: Path, exit_dir: Path, uid: int, gid: int) -> list[Owned]:
    """Who owns what the rank writes, parents first. Root keeps the attempt directory (group-writable for
    the job, sticky: the rank cannot remove or replace root's files in it), the spool directory and the
    logs; the rank owns its scratch, its checkpoint prefix, its metrics and its spool file."""
    return [
        Owned(view.attempt_dir, True, 0, gid, 0o1775),
        Owned(exit_dir, True, 0, gid, 0o1775),  # the launcher's exit/pid files (root) and the rank's exit note
        Owned(view.attempt_dir / "metrics", True, uid, gid, 0o755),
        Owned(events_file.parent, True, 0, 0, 0o755),
        Owned(events_file, False, uid, gid, 0o644),
        Owned(view.scratch.parent, True, 0, 0, 0o755),
        Owned(view.scratch, True, uid, gid, 0o700),
        Owned(view.checkpoints, True, uid, gid, 0o755),
    ]


# ----------------------------------------------------------------------------- I/O: the agent's side


def apply_ownership(entries: Iterable[Owned]) -> None:
    """Create and chown/chmod each path without following a symlink a rank may have left there."""
    for entry in entries:
        if entry.directory:
            entry.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        else:
            entry.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(entry.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, entry.mode)
        try:
            os.fchown(fd, entry.uid, entry.gid)
            os.fchmod(fd, entry.mode)
        finally:
            os.close(fd)


def wrap(command: Sequence[str], plan: SandboxPlan) -> list[str]:
    """``command`` run under the exec wrapper with ``plan``."""
    return [sys.executable, "-I", str(WRAPPER), plan.to_json(), "--", *command]


def runtime_paths(hidden: Sequence[Path] = (), search_path: Sequence[str] | None = None) -> tuple[Path, ...]:
    """What a rank needs to run at all: the interpreter's prefixes (a venv and the Python it was made from)
    and the directories on the agent's import path (``sys.path``: site-packages, and the sources of
    editable installs, e.g. a checkout under /tmp), read-only. Never a directory that holds a ``hidden``
    path or lies inside one (the agent's working directory, which may hold the state directory)."""
    resolved_hidden = [h.resolve() for h in hidden]
    found: list[Path] = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)]
    for entry in sys.path if search_path is None else search_path:
        if not entry:
            continue  # the working directory
        path = Path(entry).resolve()
        if not path.is_dir() or any(_under(h, path) or _under(path, h) for h in resolved_hidden):
            continue
        found.append(path)
    return tuple(dict.fromkeys(found))


def host_hidden(home: Path | None = None) -> tuple[Path, ...]:
    """What every sandbox hides besides the trainyard paths: the agent user's home (credentials, shell
    history); the interpreter's prefixes under it are bound back read-only."""
    home = (home or Path.home()).resolve()
    return (home,) if home != Path("/") else ()


def check_host(*, first_uid: int, timeout_s: float = 30.0) -> str | None:
    """None when ranks can be sandboxed here, else why not (what the operator reads at start-up).

    Runs the wrapper for real: a throwaway directory covered and bound back read-only, a drop to
    ``first_uid``, and a child that checks it is that user, cannot write there and cannot see root's
    processes."""
    if os.geteuid() != 0:
        return (f"the node agent runs as uid {os.geteuid()}, not root: it cannot enter mount namespaces or "
                "switch ranks to their job's user")
    with tempfile.TemporaryDirectory(prefix="trainyard-sandbox-check-") as tmp:
        root = Path(tmp).resolve()
        (root / "seen").mkdir()
        (root / "hidden").mkdir()
        view = RankView(attempt_dir=root / "seen", checkpoints=root / "seen", scratch=root / "seen",
                        runtime=runtime_paths())
        plan = plan_rank(view, uid=first_uid, gid=first_uid, hidden=(root, *host_hidden()))
        plan = SandboxPlan(**{**plan.__dict__, "binds": tuple(
            Bind(b.path, False, b.optional) for b in plan.binds)})  # the check: read-only
        probe = ("import os, sys\n"
                 f"ok = os.getuid() == {first_uid} and os.getgroups() in ([], [{first_uid}])\n"
                 f"ok = ok and not os.path.exists({str(root / 'hidden')!r}) and os.path.isdir({str(root / 'seen')!r})\n"
                 f"ok = ok and not os.access({str(root / 'seen')!r}, os.W_OK)\n"
                 f"ok = ok and not os.path.exists('/proc/{os.getpid()}')\n"
                 "sys.exit(0 if ok else 3)\n")
        try:
            done = subprocess.run(wrap([sys.executable, "-I", "-c", probe], plan), capture_output=True,
                                  timeout=timeout_s, text=True, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the sandbox self-test could not run: {exc}"
    if done.returncode == 0:
        return None
    detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
    return f"the sandbox self-test failed: {detail[0]}"


# ----------------------------------------------------------------------------- the exec wrapper (root → rank)

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)  # what pid 1 passes on to the rank


class _Libc:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def unshare(self, flags: int) -> None:
        self._check(self.lib.unshare(flags), f"unshare({flags:#x})")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
        def enc(s: str | None) -> bytes | None:
            return s.encode() if s is not None else None

        self._check(self.lib.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
                    f"mount {source or ''} on {target}")

    def umount(self, target: str, flags: int = 0) -> None:
        self._check(self.lib.umount2(target.encode(), flags), f"umount {target}")

    def no_new_privs(self) -> None:
        self._check(self.lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _sibling(name: str) -> ModuleType:
    """A sibling module: imported from the package, or by path when this runs as ``python -I sandbox.py``."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    qualified = f"_trainyard_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


def enter(plan: SandboxPlan) -> None:
    """Build the sandbox of ``plan`` and become its user (must run as root). With a PID namespace this
    returns only in the rank's process; the processes that stay behind to supervise it (the caller, then
    pid 1 of the namespace) exit the way the rank did and never return."""
    libc = _Libc()
    _cgroups = _sibling("cgroups")
    _cgroups.join(plan.cgroup_procs)  # everything from here on, the rank included, is the attempt's
    libc.unshare(CLONE_NEWNS | (CLONE_NEWPID if plan.pid_namespace else 0))
    libc.mount("none", "/", None, MS_REC | MS_PRIVATE, None)  # nothing we mount leaks back to the host
    _mount_view(libc, plan)
    if plan.pid_namespace:
        _fork_into_namespace(libc, plan)  # returns in the rank only
    else:
        _mount_proc(libc, plan)
    os.chdir(plan.cwd)
    os.setgroups([])
    os.setresgid(plan.gid, plan.gid, plan.gid)
    os.setresuid(plan.uid, plan.uid, plan.uid)
    libc.no_new_privs()
    if os.getuid() != plan.uid or os.geteuid() != plan.uid:  # pragma: no cover - the kernel said yes above
        raise OSError(errno.EPERM, "the drop to the job's user did not take")
    if plan.seccomp:
        _sibling("seccomp").install()


NEVER_FOLLOWED = "(a rank's path is never followed): refused"
"""In a refusal of :func:`open_bind_source`: the rank's inputs were tampered with (``classify``: ``security``)."""


def open_bind_source(bind: Bind) -> int:
    """An ``O_PATH`` handle of what ``bind`` names: walked down from its anchor one component at a time with
    ``O_NOFOLLOW`` (each a directory, the last a directory or a regular file), or opened as it is without one.
    OSError naming the link for a component that is a symbolic link; FileNotFoundError when one is missing."""
    if bind.anchor is None:
        return os.open(bind.path, os.O_PATH | os.O_CLOEXEC)
    relative = os.path.relpath(bind.path, bind.anchor)
    parts = [] if relative == "." else relative.split(os.sep)
    if ".." in parts:
        raise OSError(errno.EPERM, f"{bind.path} is not under {bind.anchor} {NEVER_FOLLOWED}")
    fd = os.open(bind.anchor, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for index, part in enumerate(parts):
            child = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
            mode = os.fstat(fd).st_mode
            last = index == len(parts) - 1
            if not (stat.S_ISDIR(mode) or (last and stat.S_ISREG(mode))):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory or a regular file"
                raise OSError(errno.ELOOP, f"{bind.path}: {part!r} is {kind} {NEVER_FOLLOWED}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mount_view(libc: _Libc, plan: SandboxPlan) -> None:
    """Covers, the rank's paths bound back, the attempt's own /dev/shm."""
    sources: list[tuple[Bind, int]] = []
    for bind in plan.binds:  # opened before the covers hide them
        try:
            sources.append((bind, open_bind_source(bind)))
        except FileNotFoundError:
            if not bind.optional:
                raise
    shm = os.open(plan.shm, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW) if plan.shm else None
    for path, mode in plan.cover:
        os.makedirs(path, exist_ok=True)
        libc.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o}")
    for bind, fd in sources:
        is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
        if is_dir:
            os.makedirs(bind.path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(bind.path), exist_ok=True)
            if not os.path.exists(bind.path):
                os.close(os.open(bind.path, os.O_WRONLY | os.O_CREAT, 0o644))
        libc.mount(f"/proc/self/fd/{fd}", bind.path, None, MS_BIND, None)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if bind.writable else MS_RDONLY)
        libc.mount(None, bind.path, None, flags, None)
        os.close(fd)
    if shm is not None:
        os.makedirs("/dev/shm", exist_ok=True)
        libc.mount(f"/proc/self/fd/{shm}", "/dev/shm", None, MS_BIND, None)
        libc.mount(None, "/dev/shm", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        os.close(shm)


def _mount_proc(libc: _Libc, plan: SandboxPlan) -> None:
    if not plan.hide_processes and not plan.pid_namespace:
        return
    options = "hidepid=invisible" if plan.hide_processes else None
    try:
        libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, options)
    except OSError as exc:
        if exc.errno != errno.EINVAL or options is None:
            raise
        libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")


def _fork_into_namespace(libc: _Libc, plan: SandboxPlan) -> None:
    """caller (outside, root) → pid 1 of the new namespace (mounts its /proc, reaps, forwards signals) → the
    rank (pid 2; returns). Both supervisors leave the rank's process group once it is forked, so the agent's
    signals to the group reach the rank once, directly; one sent to either of them is forwarded. When the
    rank ends, pid 1 ends and the kernel kills whatever the rank left in its namespace."""
    # pid 1 mounts the namespace's /proc over the one this process shares with it: the host's is kept open
    host_proc = os.open("/proc", os.O_PATH | os.O_DIRECTORY)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # until each process has its handlers
    status_r, status_w = os.pipe()
    init = os.fork()
    if init:
        os.close(status_w)
        _exit_like(_supervise_outside(init, status_r, plan, held, host_proc))
    os.close(status_r)
    os.close(host_proc)  # never the rank's
    try:
        _mount_proc(libc, plan)
    except OSError as exc:
        print(f"{SANDBOX_FAILURE} the rank's sandbox: {exc}", file=sys.stderr, flush=True)
        os.write(status_w, f"status {SANDBOX_EXIT << 8}\n".encode())
        os._exit(SANDBOX_EXIT)
    rank = os.fork()
    if rank == 0:
        os.close(status_w)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # the exec keeps the mask: the rank gets its signals
        return
    _exit_like(_supervise_inside(rank, status_w, held))


def _forward_to(pid: int) -> None:
    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # out of the rank's process group: see _fork_into_namespace


def _supervise_inside(rank: int, status_w: int, held: set[int | signal.Signals]) -> int:
    """Pid 1: forward signals, reap every orphan, and once the rank ends, hand its wait status outside."""
    try:
        _forward_to(rank)
        os.write(status_w, b"forked\n")
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        while True:
            pid, status = os.wait()
            if pid == rank:
                os.write(status_w, f"status {status}\n".encode())
                return status
    except BaseException:  # noqa: BLE001 - never fall back into the caller (the rank's code path)
        return 255 << 8


def _supervise_outside(init: int, status_r: int, plan: SandboxPlan, held: set[int | signal.Signals],
                       host_proc: int) -> int:
    """The caller, outside the namespace: note the rank's pid for the agent, forward signals, wait, and
    return the rank's wait status (pid 1's own when the rank's never came)."""
    try:
        _forward_to(init)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        received = b""
        noted = False
        while chunk := os.read(status_r, 4096):
            received += chunk
            if not noted and b"forked\n" in received:
                noted = True
                _note_rank_pid(plan, init, host_proc)
        _, init_status = os.waitpid(init, 0)
        for line in received.decode(errors="replace").splitlines():
            if line.startswith("status "):
                return int(line.split()[1])
        return init_status
    except BaseException:  # noqa: BLE001 - never fall back into the caller (the rank's code path)
        return 255 << 8


def _note_rank_pid(plan: SandboxPlan, init: int, host_proc: int) -> None:
    """The rank's pid, as this (the host's) namespace numbers it, where the agent reads it."""
    if not plan.pid_file:
        return
    try:
        fd = os.open(f"{init}/task/{init}/children", os.O_RDONLY, dir_fd=host_proc)
        with open(fd, encoding="ascii") as fh:
            children = fh.read().split()
    except OSError:
        children = []
    pid = children[0] if children else str(init)
    tmp = f"{plan.pid_file}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "w", encoding="ascii") as fh:
            fh.write(pid)
        os.replace(tmp, plan.pid_file)


def _exit_like(status: int) -> None:
    """End this process the way a wait status says (the same signal, or the same exit code)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught, nor reset
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 255)


def wrapped_pid_file(command: Sequence[str]) -> str | None:
    """Where the wrapper in ``command`` (see :func:`wrap`) writes the rank's pid itself, or None."""
    if len(command) < 4 or command[1:3] != ["-I", str(WRAPPER)]:
        return None
    try:
        plan = SandboxPlan.from_json(command[3])
    except (ValueError, KeyError, TypeError):
        return None
    return plan.pid_file if plan.pid_namespace else None


def _note_start_error(plan: SandboxPlan, command: str, exc: OSError) -> None:
    if plan.start_error_file:
        with contextlib.suppress(OSError), open(plan.start_error_file, "w", encoding="utf-8") as fh:
            fh.write(f"cannot start {command}: {exc}")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: sandbox.py <plan-json> -- <command…>", file=sys.stderr)
        return 2
    plan, command = SandboxPlan.from_json(argv[0]), argv[2:]
    try:
        enter(plan)
    except OSError as exc:
        print(f"{SANDBOX_FAILURE} the rank's sandbox: {exc}", file=sys.stderr, flush=True)
        return SANDBOX_EXIT
    os.environ.update(plan.env)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"sandbox: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        _note_start_error(plan, command[0], exc)
        return START_ERROR_EXIT
    return START_ERROR_EXIT  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
