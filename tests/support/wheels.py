"""Real wheels and locks for the environment tests, made here (no network): a package index of our own.

:func:`make_wheel` writes a valid ``py3-none-any`` wheel (METADATA, WHEEL, RECORD with its hashes) — the bytes
are deterministic, so its sha256 is stable within a run. :func:`requirements_lock` writes a hash-pinned
requirements file for some of them; :func:`pylock` and :func:`uv_lock` the same pins as PEP 751 and uv.lock.
A node agent installs them with ``TRAINYARD_ENV_FIND_LINKS=<dir>`` and ``TRAINYARD_ENV_NO_INDEX=true``.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_EPOCH = (2020, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    path: Path

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def pin(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


def make_wheel(index: Path, name: str, version: str, files: Mapping[str, str], *,
               requires: Sequence[str] = (), extra_entries: Mapping[str, str] | None = None) -> Wheel:
    """A wheel of ``files`` (path in the wheel → text) in ``index``; ``extra_entries`` are written as given
    (not in RECORD: for attacks)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = index / f"{dist}-py3-none-any.whl"
    entries = dict(files)
    entries[f"{dist}.dist-info/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                             + "".join(f"Requires-Dist: {r}\n" for r in requires))
    entries[f"{dist}.dist-info/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: trainyard-tests\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
    record = []
    for entry, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{entry},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    entries[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    entries.update(extra_entries or {})
    index.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for entry, text in entries.items():
            archive.writestr(zipfile.ZipInfo(entry, _EPOCH), text)
    return Wheel(name, version, path)


def probe_wheel(index: Path, version: str = "1.0.0", *, name: str = "typrobe",
                requires: Sequence[str] = ()) -> Wheel:
    """A package no base environment has: ``import typrobe; typrobe.VALUE == "<name> <version>"``."""
    module = name.replace("-", "_")
    return make_wheel(index, name, version, {f"{module}/__init__.py": f"VALUE = {f'{name} {version}'!r}\n"},
                      requires=requires)


def requirements_lock(wheels: Iterable[Wheel]) -> str:
    return "".join(w.pin() + "\n" for w in wheels)


def pylock(wheels: Iterable[Wheel]) -> str:
    out = ['lock-version = "1.0"\ncreated-by = "trainyard-tests"\nrequires-python = ">=3.11"\n']
    for w in wheels:
        out.append(f'\n[[packages]]\nname = "{w.name}"\nversion = "{w.version}"\n'
                   f'wheels = [{{ name = "{w.path.name}", hashes = {{ sha256 = "{w.sha256}" }} }}]\n')
    return "".join(out)


def uv_lock(project: str, wheels: Sequence[Wheel], *, direct: Sequence[str] | None = None,
            edges: Mapping[str, Sequence[str]] | None = None) -> str:
    """A uv.lock of ``project`` (virtual, at ".") depending on ``direct`` (default: every wheel)."""
    edges = edges or {}

    def deps(names: Iterable[str]) -> str:
        return "[" + ", ".join(f'{{ name = "{n}" }}' for n in names) + "]"

    roots = direct if direct is not None else [w.name for w in wheels]
    out = [f'version = 1\nrequires-python = ">=3.11"\n\n[[package]]\nname = "{project}"\nversion = "0.1.0"\n'
           f'source = {{ virtual = "." }}\ndependencies = {deps(roots)}\n']
    for w in wheels:
        out.append(f'\n[[package]]\nname = "{w.name}"\nversion = "{w.version}"\n'
                   f'source = {{ registry = "https://pypi.org/simple" }}\n'
                   f'dependencies = {deps(edges.get(w.name, []))}\n'
                   f'wheels = [{{ url = "https://files.example/{w.path.name}", hash = "sha256:{w.sha256}", '
                   f'size = {w.path.stat().st_size} }}]\n')
    return "".join(out)
