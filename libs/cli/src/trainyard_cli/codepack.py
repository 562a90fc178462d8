"""``trainyard submit --code DIR``: which files of DIR are the code, their archive, and the spec's ``code``.

* :func:`select` lists the files: in a git checkout what ``git ls-files --cached --others
  --exclude-standard`` lists (tracked and untracked, .gitignore respected) with the commit and whether
  the checkout is dirty; outside git a walk that honours every .gitignore on the way (``pathspec``).
  ``codetree.ALWAYS_EXCLUDED`` is never packed either way.
* :func:`pack` makes the deterministic archive, and says what is big when it is over the limit.
* :func:`find_lock` picks the environment lock of the tree (``code.environment``): the one the spec or
  ``--environment`` names, else the first of ``lockfile.LOCK_NAMES`` at the top of the tree (a
  ``requirements.txt`` only when it pins by hash); it is parsed here, so a lock the platform would refuse is
  said before anything is uploaded.
* :func:`with_code` is the spec with ``code`` naming the archive (pure).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pathspec

from trainyard_contract import codetree, lockfile
from trainyard_contract.errors import ConfigError

_EXCLUDED = frozenset(codetree.ALWAYS_EXCLUDED)


@dataclass(frozen=True)
class Selection:
    """The files of a code tree (POSIX paths relative to ``root``) and, in git, its commit and state."""

    root: Path
    files: tuple[str, ...]
    commit: str | None = None
    dirty: bool | None = None

    def sizes(self) -> list[tuple[int, str]]:
        """(bytes, path) of each file, largest first."""
        return sorted(((os.lstat(self.root / f).st_size, f) for f in self.files), reverse=True)


def select(root: Path) -> Selection:
    """The files of the code tree at ``root`` (ConfigError if it is not a directory)."""
    root = root.expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"--code {root}: not a directory")
    if _git(root, "rev-parse", "--is-inside-work-tree") == "true":
        return _git_selection(root)
    return Selection(root, tuple(walk(root)))


def _git(root: Path, *args: str, z: bool = False) -> str | None:
    """git's output in ``root`` (None when git fails or is not installed)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=False, timeout=120,
                              stdin=subprocess.DEVNULL, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    out = done.stdout.decode(errors="surrogateescape")
    return out if z else out.strip()


def _git_selection(root: Path) -> Selection:
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", z=True)
    if listed is None:
        raise ConfigError(f"--code {root}: `git ls-files` failed in this checkout")
    files = sorted({name for name in listed.split("\0") if name and not _excluded(name)
                    and _packable(root / name)})
    commit = _git(root, "rev-parse", "--verify", "--quiet", "HEAD")  # None before the first commit
    status = _git(root, "status", "--porcelain", "--", ".")
    return Selection(root, tuple(files), commit=commit or None, dirty=bool(status) if status is not None else None)


def _packable(path: Path) -> bool:
    """A regular file or a symlink (a tracked file deleted from the checkout, or a submodule, is not)."""
    return path.is_symlink() or path.is_file()


def _excluded(name: str) -> bool:
    return any(part in _EXCLUDED for part in PurePosixPath(name).parts)


def walk(root: Path) -> Iterator[str]:
    """Files under ``root`` no .gitignore on their way ignores, nor ``codetree.ALWAYS_EXCLUDED``."""
    specs: list[tuple[str, pathspec.GitIgnoreSpec]] = []  # (directory relative to root, its .gitignore)
    for directory, dirnames, filenames in os.walk(root):
        base = Path(directory)
        rel = base.relative_to(root).as_posix()
        rel = "" if rel == "." else rel
        specs = [(d, s) for d, s in specs if rel == d or rel.startswith(f"{d}/") or d == ""]
        ignore = base / ".gitignore"
        if ignore.is_file():
            specs.append((rel, pathspec.GitIgnoreSpec.from_lines(ignore.read_text(errors="replace").splitlines())))
        kept = []
        for name in sorted(dirnames):
            path = f"{rel}/{name}" if rel else name
            if name in _EXCLUDED or _ignored(specs, path, directory=True):
                continue
            if (base / name).is_symlink():  # packed as a link, never followed
                filenames.append(name)
                continue
            kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            path = f"{rel}/{name}" if rel else name
            if name not in _EXCLUDED and not _ignored(specs, path, directory=False):
                yield path


def _ignored(specs: list[tuple[str, pathspec.GitIgnoreSpec]], path: str, *, directory: bool) -> bool:
    """git's rule: the deepest .gitignore that has a say decides (a later ``!pattern`` re-includes)."""
    verdict = False
    for base, spec in specs:
        relative = path[len(base) + 1:] if base else path
        result = spec.check_file(relative + ("/" if directory else ""))
        if result.include is not None:
            verdict = result.include
    return verdict


# ----------------------------------------------------------------------------- packing


class CodeTooLargeError(ConfigError):
    """A tree whose archive is over the limit; the message lists its largest files."""


def pack(selection: Selection, *, max_bytes: int = codetree.MAX_ARCHIVE_BYTES) -> bytes:
    """The deterministic archive of ``selection`` (CodeTooLargeError naming the 5 largest files)."""
    if not selection.files:
        raise ConfigError(f"--code {selection.root}: no files to pack (all ignored?)")
    sizes = selection.sizes()
    total = sum(size for size, _ in sizes)
    if total > codetree.MAX_TREE_BYTES:
        raise CodeTooLargeError(_too_large(selection, f"{_mib(total)} of files, over the "
                                                      f"{_mib(codetree.MAX_TREE_BYTES)} a tree may hold", sizes))
    try:
        return codetree.pack(selection.root, selection.files, max_bytes=max_bytes)
    except codetree.CodeTreeError as exc:
        if "limit is" in exc.message and "MiB" in exc.message:
            raise CodeTooLargeError(_too_large(selection, exc.message, sizes)) from exc
        raise


def _too_large(selection: Selection, why: str, sizes: list[tuple[int, str]]) -> str:
    largest = "\n".join(f"  {_mib(size):>10}  {name}" for size, name in sizes[:5])
    return (f"--code {selection.root}: {why}.\nThe largest files:\n{largest}\n"
            "Add them to .gitignore (data belongs in a trainyard dataset, checkpoints in the artifact store)")


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- the spec


def command(entrypoint: str) -> list[str]:
    """``--entrypoint`` split like a shell (ConfigError when it is empty or unbalanced)."""
    try:
        words = shlex.split(entrypoint)
    except ValueError as exc:
        raise ConfigError(f"--entrypoint {entrypoint!r}: {exc}") from exc
    if not words:
        raise ConfigError('--entrypoint is empty: give the command each rank runs, e.g. "python train.py"')
    return words


@dataclass(frozen=True)
class Lock:
    """The environment lock found in a tree."""

    path: str  # POSIX, relative to the tree
    sha256: str  # sha256:<hex> of its bytes
    packages: int  # distributions it pins for this machine's Python


@dataclass(frozen=True)
class LockChoice:
    """The lock to use (or None), and what to tell the user about the choice."""

    lock: Lock | None
    note: str | None = None


def find_lock(selection: Selection, named: str | None) -> LockChoice:
    """The tree's environment lock: ``named`` (the spec's ``code.environment.lock`` or ``--environment``; ``none``:
    no environment), else the first of :data:`lockfile.LOCK_NAMES` in the tree. ConfigError when the named one is
    not among the packed files or the lock would be refused."""
    if named == "none":
        return LockChoice(None)
    files = set(selection.files)
    if named is not None:
        if named not in files:
            raise ConfigError(f"the environment lock {named!r} is not among the packed files of {selection.root} "
                              "(a path relative to the tree; is it .gitignored?)")
        return LockChoice(_read_lock(selection.root, named))
    for name in lockfile.LOCK_NAMES:
        if name not in files:
            continue
        text = (selection.root / name).read_text(errors="replace")
        if name == "requirements.txt" and not lockfile.has_hashes(text):
            return LockChoice(None, f"{name} has no hashes, so it is not used as the job's environment: lock it "
                                    "(uv pip compile --generate-hashes requirements.in -o requirements.txt) or pass "
                                    "--environment none to silence this")
        return LockChoice(_read_lock(selection.root, name))
    return LockChoice(None)


def _read_lock(root: Path, name: str) -> Lock:
    path = root / name
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"the environment lock {name} must be a regular file in the tree, not a link")
    data = path.read_bytes()
    if len(data) > lockfile.MAX_LOCK_BYTES:
        raise ConfigError(f"the environment lock {name} is over {lockfile.MAX_LOCK_BYTES} bytes")
    try:
        pins = lockfile.parse_lock(data.decode(), name)
    except UnicodeDecodeError:
        raise ConfigError(f"the environment lock {name} is not UTF-8 text") from None
    except lockfile.LockError as exc:
        raise ConfigError(f"the environment lock would be refused: {exc.message}") from None
    return Lock(name, codetree.archive_id(data), len(pins))


def with_code(spec: Mapping[str, Any], *, archive: str, selection: Selection,
              entrypoint: str | None, lock: Lock | None = None) -> dict[str, Any]:
    """``spec`` whose ``code`` names ``archive`` (and the checkout's commit and dirty state).

    The entrypoint is ``--entrypoint`` (split like a shell) or the spec's ``code.entrypoint``;
    ConfigError when neither, or when the spec already names ``code.repo``."""
    code = dict(spec.get("code") or {})
    if code.get("repo"):
        raise ConfigError("the spec's code names code.repo; --code uploads a directory instead: use one of them")
    if entrypoint is not None:
        code["entrypoint"] = command(entrypoint)
    elif not code.get("entrypoint"):
        raise ConfigError("no entrypoint: give --entrypoint \"python train.py …\" or code.entrypoint in the spec")
    code["archive"] = archive
    for key in ("commit", "dirty", "revision"):
        code.pop(key, None)
    if selection.commit is not None:
        code["commit"] = selection.commit
    if selection.dirty is not None:
        code["dirty"] = selection.dirty
    code.pop("environment", None)
    if lock is not None:
        code["environment"] = {"lock": lock.path, "sha256": lock.sha256}
    return {**spec, "code": code}
