"""A job's environment lock, read without trusting it (pure: text in, pins or a refusal out).

Three formats, each turned into the same list of :class:`Pin` — ``name==version`` with the sha256 hashes
of its files — which is all the node ever hands the installer (:func:`requirements_text`):

* ``requirements.txt`` (any other name): ``name==version --hash=sha256:…`` lines, as ``uv pip compile
  --generate-hashes`` or ``pip-compile --generate-hashes`` write them (continuations, comments and environment
  markers allowed);
* ``pylock.toml`` / ``pylock.<name>.toml`` (PEP 751): ``[[packages]]`` with ``version`` and the sha256 of
  their wheels or sdist;
* ``uv.lock``: the packages the project (the lock's ``editable``/``virtual`` root) depends on, followed
  through their dependencies with the markers of the node's Python, registry packages only.

Whatever could make the installer read, fetch or run something the operator did not choose is refused with
the line it is on: options inside the file (``--index-url``, ``-r other.txt``, ``-e``, ``--find-links``…),
URLs, paths, VCS references, a pin without ``==`` or without a sha256 hash, and the platform's own packages
(:data:`PLATFORM_PACKAGES`, the trainyard SDK: the node's). Whether a pin would replace the node's torch or
what it needs is the node's to say (it knows its versions); which *versions* exist, and whether two pins
conflict, the resolver's.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from packaging.markers import InvalidMarker, Marker
from packaging.utils import canonicalize_name

from trainyard_contract.errors import ConfigError

LockFormat = Literal["requirements", "pylock", "uv"]

#: The largest lock the API and the node read (a full lock of a large project is a few hundred KiB).
MAX_LOCK_BYTES = 4 * 1024 * 1024
#: Distributions a lock may never name: the platform's own, which every rank runs on.
PLATFORM_PACKAGES = frozenset({"trainyard-sdk", "trainyard-contract"})
#: The base's roots: a uv.lock's project depends on torch to run anywhere, but what torch needs is the node's
#: (not followed); a pin of torch itself is kept for the node to compare with its own (same version: not
#: installed again; another: refused).
BASE_ROOTS = frozenset({"torch", *PLATFORM_PACKAGES})
#: Lock files ``trainyard submit --code DIR`` picks up from the top of the tree, in this order
#: (``requirements.txt`` only when it carries hashes: without them it is a wish list, not a lock).
LOCK_NAMES = ("pylock.toml", "uv.lock", "requirements.lock", "requirements.txt")

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9._,\s-]*\])?$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
_PYLOCK = re.compile(r"^pylock\.([^.]+\.)?toml$")


class LockError(ConfigError):
    """A lock the platform will not install: the message names the file, the line or package, and the fix."""


@dataclass(frozen=True)
class Pin:
    """One distribution of the environment: exactly this version, one of these files."""

    name: str  # canonical (PEP 503)
    version: str
    hashes: tuple[str, ...]  # sha256 hex digests of its acceptable files

    def line(self) -> str:
        return f"{self.name}=={self.version} " + " ".join(f"--hash=sha256:{h}" for h in self.hashes)


def lock_format(path: str) -> LockFormat:
    """The format of a lock by its file name."""
    name = path.rsplit("/", 1)[-1]
    if name == "uv.lock":
        return "uv"
    if _PYLOCK.match(name):
        return "pylock"
    return "requirements"


def has_hashes(text: str) -> bool:
    """Whether a requirements file pins by hash at all (a plain ``requirements.txt`` is not a lock)."""
    return "--hash=sha256:" in text or "--hash sha256:" in text


def parse_lock(text: str, path: str, *, environment: Mapping[str, str] | None = None) -> list[Pin]:
    """The pins of the lock ``text`` found at ``path`` (its format by name), sorted by name; LockError when it
    cannot be installed as given. ``environment``: marker values of the node's Python (None: the caller's)."""
    fmt = lock_format(path)
    if fmt == "uv":
        pins = _from_uv_lock(text, path, environment)
    elif fmt == "pylock":
        pins = _from_pylock(text, path, environment)
    else:
        pins = _from_requirements(text, path, environment)
    return _checked(pins, path)


def base_problems(pins: Iterable[Pin], path: str) -> list[str]:
    """Pins of the platform's own packages (refused: the lock adds to the base, never replaces it)."""
    return [f"{path} pins {p.name}=={p.version}: {p.name} is the node's own (the base every rank runs on); "
            f"remove it from the lock (the job gets the node's {p.name})" for p in pins if p.name in PLATFORM_PACKAGES]


def requirements_text(pins: Iterable[Pin]) -> str:
    """What the node hands the installer: one hash-pinned line per distribution, nothing else."""
    return "".join(p.line() + "\n" for p in pins)


# ----------------------------------------------------------------------------- formats


def _from_requirements(text: str, path: str, environment: Mapping[str, str] | None) -> list[Pin]:
    pins = []
    for number, line in _logical_lines(text):
        requirement, _, options = line.partition(" --")
        requirement, options = requirement.strip(), ("--" + options) if options else ""
        if requirement.startswith("-"):
            raise LockError(f"{path} line {number}: {_first_word(requirement)!r} is not allowed in a job's lock "
                            "(no options, includes, editables or indexes: the node's operator chooses the "
                            "package index); keep only name==version --hash=sha256:… lines")
        spec, _, marker = requirement.partition(";")
        if marker.strip() and not _applies(marker.strip(), f"{path} line {number}", environment):
            continue
        name, version = _pinned(spec.strip(), f"{path} line {number}")
        hashes, tokens = [], options.split()
        while tokens:
            option = tokens.pop(0)
            if option.startswith("--hash="):
                value = option.removeprefix("--hash=")
            elif option == "--hash" and tokens:
                value = tokens.pop(0)
            else:
                raise LockError(f"{path} line {number}: {option!r} is not allowed after a requirement "
                                "(only --hash=sha256:…)")
            hashes.append(_sha256(value, f"{path} line {number}"))
        if not hashes:
            raise LockError(f"{path} line {number}: {name}=={version} has no --hash=sha256:…; a job's lock pins every "
                            "file by hash (uv pip compile --generate-hashes requirements.in -o requirements.txt)")
        pins.append(Pin(name, version, tuple(hashes)))
    return pins


def _from_pylock(text: str, path: str, environment: Mapping[str, str] | None) -> list[Pin]:
    data = _toml(text, path)
    packages = data.get("packages")
    if not isinstance(packages, list):
        raise LockError(f"{path}: no [[packages]] table; is this a PEP 751 lock (uv pip compile --format pylock.toml)?")
    pins = []
    for index, package in enumerate(packages):
        where = f"{path} packages[{index}]"
        if not isinstance(package, dict):
            raise LockError(f"{where}: not a table")
        if (marker := package.get("marker")) is not None and not _applies(str(marker), where, environment):
            continue
        for source in ("vcs", "directory", "archive"):
            if source in package:
                raise LockError(f"{where} ({package.get('name')}): a {source} source is not allowed in a job's lock; "
                                "only packages from the operator's index")
        name, version = _pinned(f"{package.get('name')}=={package.get('version')}", where)
        files = _files(package)
        hashes = [_sha256(str(h), f"{where} ({name})") for f in files
                  if isinstance(f, dict) and (h := (f.get("hashes") or {}).get("sha256"))]
        if not hashes:
            raise LockError(f"{where} ({name}): no sha256 hash of any of its files; lock it again with hashes")
        pins.append(Pin(name, version, tuple(hashes)))
    return pins


def _from_uv_lock(text: str, path: str, environment: Mapping[str, str] | None) -> list[Pin]:
    data = _toml(text, path)
    packages = [p for p in data.get("package") or [] if isinstance(p, dict) and "name" in p]
    roots = [p for p in packages if _source_kind(p) in ("editable", "virtual")
             and (p.get("source") or {}).get(_source_kind(p)) == "."]
    if len(roots) != 1:
        raise LockError(f"{path}: cannot find the project this uv.lock locks (one package with source "
                        "editable = \".\" or virtual = \".\"); write it with `uv lock` in the project's directory")
    by_name: dict[str, list[dict[str, Any]]] = {}
    for package in packages:
        by_name.setdefault(canonicalize_name(str(package["name"])), []).append(package)
    pins: dict[str, Pin] = {}
    todo = list(_edges(roots[0], path, environment))
    seen: set[tuple[str, str | None, tuple[str, ...]]] = set()
    while todo:
        name, version, extras = todo.pop()
        if (name, version, extras) in seen:
            continue
        seen.add((name, version, extras))
        candidates = [p for p in by_name.get(name, []) if version is None or str(p.get("version")) == version]
        if len(candidates) != 1:
            raise LockError(f"{path}: the dependency {name}{'==' + version if version else ''} is "
                            f"{'missing from' if not candidates else 'ambiguous in'} the lock; run `uv lock` again")
        package = candidates[0]
        for extra in extras:  # what an extra adds (httpx[http2] → h2)
            optional = (package.get("optional-dependencies") or {}).get(extra) or []
            todo.extend(_edges({"name": name, "dependencies": optional}, path, environment))
        if name in pins:
            continue
        kind = _source_kind(package)
        if kind != "registry":
            raise LockError(f"{path}: {name} comes from a {kind or 'unknown'} source; a job's lock takes packages "
                            "from the operator's index only")
        files = _files(package)
        hashes = [_sha256(str(f.get("hash", "")).removeprefix("sha256:"), f"{path} ({name})")
                  for f in files if isinstance(f, dict) and str(f.get("hash", "")).startswith("sha256:")]
        if not hashes:
            raise LockError(f"{path}: {name} has no sha256 hash of any of its files")
        pins[name] = Pin(*_pinned(f"{name}=={package.get('version')}", f"{path} ({name})"), tuple(hashes))
        if name not in BASE_ROOTS:  # what torch needs is the node's: not followed
            todo.extend(_edges(package, path, environment))
    return list(pins.values())


def _files(package: Mapping[str, Any]) -> list[Any]:
    """A locked package's wheels and sdist entries."""
    sdist = package.get("sdist")
    return list(package.get("wheels") or []) + ([sdist] if isinstance(sdist, dict) else [])


def _edges(package: Mapping[str, Any], path: str,
           environment: Mapping[str, str] | None) -> Iterable[tuple[str, str | None, tuple[str, ...]]]:
    """(name, version or None, extras) of each dependency of a uv.lock package that applies here."""
    for dep in package.get("dependencies") or []:
        if not isinstance(dep, dict) or "name" not in dep:
            continue
        if (marker := dep.get("marker")) and not _applies(str(marker), f"{path} ({package.get('name')})", environment):
            continue
        version = dep.get("version")
        extras = tuple(sorted(str(e) for e in dep.get("extra") or []))
        yield canonicalize_name(str(dep["name"])), str(version) if version is not None else None, extras


def _source_kind(package: Mapping[str, Any]) -> str | None:
    source = package.get("source")
    return next(iter(source), None) if isinstance(source, dict) and source else None


# ----------------------------------------------------------------------------- pieces


def _checked(pins: list[Pin], path: str) -> list[Pin]:
    seen: dict[str, Pin] = {}
    out = []
    for pin in pins:
        if (earlier := seen.get(pin.name)) is not None:
            if earlier.version == pin.version:
                continue  # the same pin twice (markers) is one pin; two versions are the resolver's to refuse
        seen.setdefault(pin.name, pin)
        out.append(pin)
    if problems := base_problems(out, path):
        raise LockError("; ".join(problems))
    return sorted(out, key=lambda p: (p.name, p.version))


def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """(first line number, the line with continuations joined and comments removed), non-empty ones."""
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        if buffer.strip():
            yield start, " ".join(buffer.split())
        buffer = ""
    if buffer.strip():
        yield start, " ".join(buffer.split())


def _pinned(spec: str, where: str) -> tuple[str, str]:
    name, sep, version = spec.partition("==")
    name, version = name.strip(), version.strip()
    if not sep or not version or "=" in version or "," in version or "*" in version:
        raise LockError(f"{where}: {spec!r} is not an exact pin; a job's lock pins every package as name==version")
    if "@" in name or "/" in name or ":" in name or not (match := _NAME.match(name)):
        raise LockError(f"{where}: {name!r} is not a package name (no URLs or paths in a job's lock)")
    if not _VERSION.match(version):
        raise LockError(f"{where}: {version!r} is not a version")
    return canonicalize_name(match.group(1)), version


def _sha256(value: str, where: str) -> str:
    hex_digest = value.removeprefix("sha256:").lower()
    if not _SHA256.match(hex_digest):
        raise LockError(f"{where}: {value!r} is not a sha256 hash (--hash=sha256:<64 hex digits>)")
    return hex_digest


def _applies(marker: str, where: str, environment: Mapping[str, str] | None) -> bool:
    try:
        return Marker(marker).evaluate(dict(environment) if environment is not None else None)
    except InvalidMarker as exc:
        raise LockError(f"{where}: invalid environment marker {marker!r}: {exc}") from None


def _toml(text: str, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{path}: not valid TOML ({exc})") from None


def _first_word(text: str) -> str:
    return text.split()[0] if text.split() else text
