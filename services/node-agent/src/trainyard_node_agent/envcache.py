"""Jobs' environments (``code.environment``) on this node: the packages a job's lock adds to the node's base
(its Python, torch and the trainyard SDK), built once per lock hash into a read-only cache beside the code cache
(a :class:`~trainyard_node_agent.sealedcache.SealedCache`: built in a temporary directory and renamed into
place, verified before every launch, quarantined and built again when tampered, evicted least recently used,
never while a live rank uses it, shared by several agents).

What a rank gets: the entry's ``tree/`` — a ``uv pip install --target`` directory — first on its import path
and bound read-only into its sandbox. What is layered over what (:func:`layer`, pure): the base's torch, SDK and
every distribution they need (:attr:`BaseEnvironment.protected`) stay the base's — a lock naming one of them at
another version is refused with the reason, at the same version it is not installed again; everything else the
lock pins is installed and shadows the base's copy, if any. After the install every requirement of what was
installed must be met by the environment or the base (:func:`unmet_requirements`): a lock missing a dependency is
refused, never run half-built.

The build (:class:`Installer`) trusts nothing of the lock beyond names, versions and hashes
(:mod:`trainyard_contract.lockfile` rewrites every format into ``name==version --hash=…`` lines): wheels only
(``--no-build``: no package's build code runs on the node), every file checked against the lock's hashes
(``--require-hashes``), from the operator's index (``TRAINYARD_ENV_INDEX_URL`` / ``_FIND_LINKS`` / ``_NO_INDEX``),
downloaded for the build and not kept (no download cache to grow, or to tamper with: the environment cache is what
stays, bounded by its limit). A failure the resolver blames on the lock (no such package or version, conflicting
pins, a hash mismatch, no wheel for this platform) is the job's (:class:`EnvironmentBuildError`, a ``config``
failure with the installer's words, not retried, no node blamed); one it blames on the network or the disk is this
node's (OSError: ``error``, retried).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from prometheus_client import Counter
from trainyard_contract.codetree import archive_hex
from trainyard_contract.errors import ConfigError
from trainyard_contract.lockfile import (
    BASE_ROOTS,
    MAX_LOCK_BYTES,
    LockError,
    Pin,
    parse_lock,
    requirements_text,
)
from trainyard_contract.spec import Environment
from trainyard_contract.storage import UnsafePathError, open_file_under

from trainyard_node_agent.sealedcache import CacheCounters, Sealed, SealedCache

log = logging.getLogger(__name__)

TAMPERED = Counter("trainyard_node_agent_env_cache_tampered_total",
                   "cached environments that no longer matched their digest before a launch (quarantined, rebuilt)")
BUILT = Counter("trainyard_node_agent_env_cache_built_total", "environments built into the node's environment cache")
REUSED = Counter("trainyard_node_agent_env_cache_reused_total",
                 "launches that found their environment built and intact in the node's environment cache")
EVICTED = Counter("trainyard_node_agent_env_cache_evicted_total",
                  "environment cache entries removed to stay under TRAINYARD_ENV_CACHE_MAX_BYTES")
PURGED = Counter("trainyard_node_agent_env_cache_quarantine_purged_total",
                 "quarantined (tampered) environments deleted once no running rank used them")
FAILED = Counter("trainyard_node_agent_env_cache_build_failed_total",
                 "environment builds that failed, by whose fault", ["fault"])

REQUIREMENTS_FILE = "requirements.txt"  # what was installed, beside the tree (the lock rewritten)

Progress = Callable[[str], None]


class EnvironmentBuildError(ConfigError):
    """The job's lock cannot be built here as it is: the message has the package and the installer's words."""


# ----------------------------------------------------------------------------- the base (pure, and one reader)


@dataclass(frozen=True)
class BaseEnvironment:
    """The node's own Python environment, which every environment is layered over."""

    python: str  # the interpreter ranks run (sys.executable of the agent)
    installed: Mapping[str, str]  # canonical name → version, every distribution of the base
    protected: Mapping[str, str]  # torch, the SDK and what they need: a lock may not replace these
    markers: Mapping[str, str] = field(default_factory=dict)  # environment markers of that interpreter

    def fingerprint(self) -> str:
        """Changes when an environment built over this base might no longer fit it (Python, platform, the
        protected distributions' versions): such an entry is built again."""
        m = self.markers
        key = {"python": m.get("python_full_version", ""), "platform": m.get("platform_machine", ""),
               "system": m.get("sys_platform", ""), "protected": sorted(self.protected.items())}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def closure(roots: Iterable[str], requires: Mapping[str, Sequence[str]], markers: Mapping[str, str]) -> set[str]:
    """The canonical names of ``roots`` and everything they require (markers evaluated, extras not followed)
    among the distributions of ``requires`` (name → its Requires-Dist strings)."""
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name not in requires:
            continue
        seen.add(name)
        for raw in requires[name]:
            req = _requirement(raw)
            if req is not None and _needed(req, markers):
                todo.append(canonicalize_name(req.name))
    return seen


def base_environment(python: str | None = None) -> BaseEnvironment:
    """The base as this process sees it (the agent runs in the environment its ranks' ``python`` is)."""
    installed: dict[str, str] = {}
    requires: dict[str, list[str]] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = canonicalize_name(name)
        if key not in installed:  # the first on sys.path wins, as for an import
            installed[key] = dist.version
            requires[key] = list(dist.requires or [])
    markers = {k: str(v) for k, v in default_environment().items()}
    protected = closure(BASE_ROOTS, requires, markers)  # torch, the SDK, and all they require here
    return BaseEnvironment(python=python or sys.executable, installed=installed,
                           protected={n: installed[n] for n in sorted(protected)}, markers=markers)


def layer(pins: Sequence[Pin], base: BaseEnvironment, lock: str) -> list[Pin]:
    """What to install over ``base`` for ``pins``: the base's protected distributions stay (a pin of one at its
    version is dropped, at another version refused: :class:`EnvironmentBuildError`), everything else is."""
    refused = [f"{p.name}=={p.version} (the node has {p.name} {base.protected[p.name]})" for p in pins
               if p.name in base.protected and not _same(p.version, base.protected[p.name])]
    if refused:
        raise EnvironmentBuildError(
            f"{lock} would replace the node's own {', '.join(refused)}: an environment adds to the base (torch, the "
            "SDK and what they need), it never replaces it; remove those pins, or pin the versions the node has")
    return [p for p in pins if p.name not in base.protected]


def unmet_requirements(installed: Mapping[str, tuple[str, Sequence[str]]], base: BaseEnvironment) -> list[str]:
    """Requirements of the installed distributions (name → (version, Requires-Dist)) that neither they nor the base
    meet — what a lock without its dependencies leaves behind."""
    available = {**base.installed, **{n: v for n, (v, _) in installed.items()}}
    unmet = []
    for name, (version, requires) in sorted(installed.items()):
        for raw in requires:
            req = _requirement(raw)
            if req is None or not _needed(req, base.markers):
                continue
            have = available.get(canonicalize_name(req.name))
            if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
                unmet.append(f"{name} {version} needs {req.name}{req.specifier or ''}"
                             f" ({'missing' if have is None else f'{have} found'})")
    return unmet


def _requirement(raw: str) -> Requirement | None:
    try:
        return Requirement(raw)
    except InvalidRequirement:
        return None


def _needed(req: Requirement, markers: Mapping[str, str]) -> bool:
    """Whether a requirement applies on this interpreter without extras."""
    if req.marker is None:
        return True
    with contextlib.suppress(Exception):
        return bool(req.marker.evaluate({**markers, "extra": ""}))
    return False


def _same(a: str, b: str) -> bool:
    """The same release: ``2.13.0`` is the node's ``2.13.0+cpu`` (a local build of it)."""
    try:
        return Version(a).public == Version(b).public
    except InvalidVersion:
        return a == b


# ----------------------------------------------------------------------------- the installer


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: The installer's words for a lock that cannot be built (the job's fault, not the node's).
_JOB_FAULT = ("No solution found", "not found in the package registry", "not found in the provided package",
              "Hash mismatch", "unsatisfiable", "conflicting", "no wheels", "has no wheels",
              "Building source distributions is disabled", "is not available for", "not compatible with",
              "no version of", "Failed to parse", "In `--require-hashes` mode")


def installer_words(output: str, *, limit: int = 2000) -> str:
    """The installer's explanation, without colours, progress lines or the interpreter banner."""
    lines = [_ANSI.sub("", line).rstrip() for line in output.splitlines()]
    kept = [line for line in lines if line.strip() and not line.startswith(("Using CPython", "Using Python"))]
    text = "\n".join(kept).strip()
    return text if len(text) <= limit else "…" + text[-limit:]


def lock_fault(output: str) -> bool:
    """Whether the installer's failure is the lock's (True) rather than the network's or the disk's (False)."""
    return any(marker.lower() in output.lower() for marker in _JOB_FAULT)


@dataclass(frozen=True)
class Installer:
    """``uv pip install --target`` with the operator's index; see the module docstring."""

    uv: str
    index_url: str | None = None
    find_links: tuple[str, ...] = ()
    no_index: bool = False
    cache_dir: Path | None = None
    timeout_s: float = 1800.0

    def command(self, requirements: Path, target: Path, python: str) -> list[str]:
        cmd = [self.uv, "pip", "install", "--target", str(target), "--python", python, "--no-deps",
               "--require-hashes", "--no-build", "--link-mode", "copy", "--no-config", "--no-progress",
               "-r", str(requirements)]
        if self.index_url:
            cmd += ["--index-url", self.index_url]
        for link in self.find_links:
            cmd += ["--find-links", link]
        if self.no_index:
            cmd.append("--no-index")
        cmd += ["--cache-dir", str(self.cache_dir)] if self.cache_dir is not None else ["--no-cache"]
        return cmd

    def install(self, requirements: Path, target: Path, python: str, progress: Progress) -> None:
        """Blocking: install, reporting each line the installer prints; EnvironmentBuildError for the lock's
        fault, OSError for the node's (and for a build past ``timeout_s``)."""
        cmd = self.command(requirements, target, python)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "PIP_"))}
        env.update({"NO_COLOR": "1", "UV_NO_PROGRESS": "1"})
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, text=True, errors="replace", start_new_session=True)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            _kill_group(proc)

        timer = threading.Timer(self.timeout_s, expire)
        timer.start()
        lines: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if (words := _ANSI.sub("", line).strip()) and not words.startswith("Using "):
                    progress(words[:300])
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _kill_group(proc)
        output = "".join(lines)
        if code == 0:
            return
        words = installer_words(output)
        if expired.is_set():
            raise OSError(f"the installer (uv) did not finish within {self.timeout_s:.0f}s "
                          "(TRAINYARD_ENV_BUILD_TIMEOUT_S)")
        if lock_fault(output):
            raise EnvironmentBuildError(words)
        raise OSError(f"the installer (uv) failed on this node: {words}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)


def installer(settings: Any) -> Installer:
    """The installer the operator configured (NodeAgentSettings: ``env_*``). No download cache: each lock is built
    once per node, and the environment cache is what stays (bounded by its limit)."""
    return Installer(find_uv(), index_url=settings.env_index_url, find_links=tuple(settings.env_find_links),
                     no_index=settings.env_no_index, timeout_s=settings.env_build_timeout_s)


def find_uv() -> str:
    """The uv binary installed with the agent (the ``uv`` package), else one on PATH."""
    with contextlib.suppress(ImportError, FileNotFoundError):
        from uv import find_uv_bin

        return str(find_uv_bin())
    here = Path(sys.executable).with_name("uv")
    return str(here) if here.exists() else "uv"


# ----------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class EnvPlan:
    """What one launch needs of the environment cache: which entry, what to install into it, how it is named."""

    hex: str  # sha256 hex of the lock's bytes
    lock: str  # its path in the code tree
    pins: tuple[Pin, ...]  # to install (the base's own dropped)
    packages: int  # distributions the lock pins for this interpreter

    @property
    def environment(self) -> str:
        return f"sha256:{self.hex}"


@dataclass(frozen=True)
class BuildRequest:
    """What :meth:`EnvCache.build` is handed: the plan, and where the installer's lines go."""

    plan: EnvPlan
    progress: Progress


class EnvCache(SealedCache):
    """The node's environment cache under ``root``; see the module docstring."""

    what = "environment"

    def __init__(self, root: Path, *, max_bytes: int, installer: Installer, base: BaseEnvironment) -> None:
        super().__init__(root, max_bytes=max_bytes, counters=CacheCounters(TAMPERED, BUILT, EVICTED, PURGED))
        self.installer = installer
        self.base = base

    def plan(self, environment: Environment, tree: Path) -> EnvPlan:
        """Blocking: read the lock from the verified code tree (never through a link, a regular file within
        the limit), check it is the one the spec pins, and what to install over the base. The job's error
        (ConfigError) when it is not."""
        lock = environment.lock
        try:
            fd = open_file_under(tree, tree / lock)
        except FileNotFoundError:
            raise LockError(f"code.environment.lock {lock!r} is not a file of the code tree") from None
        except UnsafePathError as exc:
            raise LockError(f"code.environment.lock: {exc}") from None
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(MAX_LOCK_BYTES + 1)
        if len(data) > MAX_LOCK_BYTES:
            raise LockError(f"code.environment.lock {lock!r} is over {MAX_LOCK_BYTES} bytes")
        hex_digest = hashlib.sha256(data).hexdigest()
        if environment.sha256 is not None and archive_hex(environment.sha256) != hex_digest:
            raise LockError(f"code.environment.lock {lock!r} is sha256:{hex_digest}, not the {environment.sha256} "
                            "the spec pins")
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise LockError(f"code.environment.lock {lock!r} is not UTF-8 text") from None
        pins = parse_lock(text, lock, environment=self.base.markers)
        return EnvPlan(hex_digest, lock, tuple(layer(pins, self.base, lock)), len(pins))

    def cached(self, hex_digest: str) -> bool:
        """Whether an entry is there (it is still verified when acquired)."""
        return self.entry_dir(hex_digest).is_dir()

    async def acquire(self, plan: EnvPlan, progress: Progress) -> Sealed:
        """The verified environment of ``plan``, built if needed, pinned until :meth:`release`."""
        entry = await self.acquire_entry(plan.hex, BuildRequest(plan, progress))
        if not entry.materialised:
            REUSED.inc()
        return entry

    def build(self, staging_tree: Path, hex_digest: str, source: Any) -> dict[str, Any]:
        """Install the plan's pins into ``staging_tree`` (see :class:`Installer`), then check nothing they need is
        missing."""
        assert isinstance(source, BuildRequest)
        plan = source.plan
        staging_tree.mkdir(parents=True)
        requirements = staging_tree.parent / REQUIREMENTS_FILE
        requirements.write_text(requirements_text(plan.pins))
        started = time.monotonic()
        try:
            if plan.pins:
                self.installer.install(requirements, staging_tree, self.base.python, source.progress)
        except EnvironmentBuildError:
            FAILED.labels("job").inc()
            raise
        except OSError:
            FAILED.labels("node").inc()
            raise
        for leftover in (".lock",):  # the installer's own lock file
            with contextlib.suppress(FileNotFoundError):
                (staging_tree / leftover).unlink()
        installed = installed_in(staging_tree)
        if shadowed := sorted(top_level_names(staging_tree) & set(sys.stdlib_module_names)):
            FAILED.labels("job").inc()
            raise EnvironmentBuildError(
                f"{plan.lock} installs {', '.join(shadowed)}, which would shadow the standard library's module of the "
                "same name (the environment comes first on the import path): remove that backport from the lock")
        if unmet := unmet_requirements(installed, self.base):
            FAILED.labels("job").inc()
            raise EnvironmentBuildError(
                f"{plan.lock} is not complete: {'; '.join(unmet[:10])}. Lock every dependency (uv pip compile "
                "--generate-hashes, uv lock, or uv pip compile --format pylock.toml write complete locks)")
        os.chmod(requirements, 0o444)
        source.progress(f"installed {len(installed)} package(s) in {time.monotonic() - started:.1f}s")
        return {"environment": plan.environment, "lock": plan.lock, "base": self.base.fingerprint(),
                "packages": {n: v for n, (v, _) in sorted(installed.items())}}

    def stale(self, hex_digest: str, meta: dict[str, Any]) -> list[str]:
        if meta.get("base") != self.base.fingerprint():
            return ["built over another base (the node's Python, torch or SDK changed since)"]
        return []


def top_level_names(target: Path) -> set[str]:
    """The importable top-level names an install target provides (packages, modules, extension modules)."""
    names = set()
    for entry in target.iterdir():
        if entry.name.endswith((".dist-info", ".data")) or entry.name in ("bin", "__pycache__"):
            continue
        names.add(entry.name.split(".", 1)[0] if entry.is_file() else entry.name)
    return names


def installed_in(target: Path) -> dict[str, tuple[str, list[str]]]:
    """The distributions under an install target: name → (version, Requires-Dist)."""
    found: dict[str, tuple[str, list[str]]] = {}
    for dist in md.distributions(path=[str(target)]):
        if name := dist.metadata["Name"]:
            found[canonicalize_name(name)] = (dist.version, list(dist.requires or []))
    return found
