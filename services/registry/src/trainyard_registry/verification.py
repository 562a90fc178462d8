"""Pure verification of a published dataset version, before it becomes visible.

The shell (``registry.py``) reads what the event points at — where the manifest resolves to,
its bytes' sha256, its JSON, and the size and sha256 of every file it lists — into a
:class:`VersionSeen`; :func:`version_problems` decides over that alone (no filesystem here).

A version is accepted only when:

* its qualified ref is well formed (tenant, name and version are plain path components);
* ``manifest_uri`` resolves (symlinks followed) to a file under the owner's dataset directory
  (``tenants/<t>/datasets/<n>/<v>/``, or ``datasets/<n>/<v>/`` for the platform's); under an
  object-store root, to an object under that prefix (``s3://…``, the URL normalised);
* the manifest's sha256 is the event's, and its own name and version are the event's;
* it lists at least one shard, and the tokenizer and every shard exist in that directory with the
  size and sha256 the manifest says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainyard_contract.events import DatasetVersionPublished, dataset_key
from trainyard_contract.spec import DatasetRef

MAX_PROBLEMS = 64  # DatasetRejected.problems holds at most this many


@dataclass(frozen=True)
class Listed:
    """A file a manifest lists, with what the manifest says of it (size None: not stated)."""

    file: str
    sha256: str | None
    size: int | None = None


@dataclass(frozen=True)
class FileSeen:
    """What the shell found of one listed file: ``size`` None when it is missing or not a regular
    file under the version's directory; ``sha256`` None when it was not hashed (size differed)."""

    size: int | None
    sha256: str | None = None


@dataclass(frozen=True)
class VersionSeen:
    """Everything read for one DatasetVersionPublished."""

    expected_dir: str  # the owner's dataset directory for name@version
    manifest_path: str | None  # where manifest_uri resolves (None: not a file: URI, nor the store's URL)
    inside: bool  # manifest_path is a regular file under expected_dir
    sha256: str | None = None  # of the manifest's bytes (None: unreadable)
    manifest: Any = None  # its parsed JSON (None: not JSON)
    files: Mapping[str, FileSeen] = field(default_factory=dict)


def ref_problem(event: DatasetVersionPublished) -> str | None:
    """Why the event's tenant/name/version cannot name a version (None when they can)."""
    ref = dataset_key(event.tenant, event.name, event.version)
    try:
        parsed = DatasetRef.parse(ref)
    except ValueError:
        return f"{ref!r} is not a dataset reference (tenant/name@version with plain names)"
    if (parsed.tenant, parsed.name, parsed.version) != (event.tenant, event.name, event.version):
        return f"{ref!r} is not a dataset reference (tenant/name@version with plain names)"
    return None


def listed_files(manifest: Any) -> list[Listed]:
    """The tokenizer and shards a manifest lists (what the shell must read); malformed entries are
    left out here and reported by :func:`manifest_shape_problems`."""
    if not isinstance(manifest, Mapping):
        return []
    out: list[Listed] = []
    tokenizer = manifest.get("tokenizer")
    if isinstance(tokenizer, Mapping) and isinstance(tokenizer.get("file"), str):
        out.append(Listed(tokenizer["file"], _str(tokenizer.get("sha256"))))
    shards = manifest.get("shards")
    for shard in shards if isinstance(shards, list) else []:
        if isinstance(shard, Mapping) and isinstance(shard.get("file"), str):
            size = shard.get("sizeBytes", shard.get("size_bytes"))
            out.append(Listed(shard["file"], _str(shard.get("sha256")), size if isinstance(size, int) else None))
    return out


def plain_file_name(name: str) -> bool:
    """A file directly in the version's directory (no separators, no ``..``)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def manifest_shape_problems(event: DatasetVersionPublished, manifest: Any) -> list[str]:
    """What is wrong with the manifest's JSON itself: not an object, another name or version, no shards."""
    if not isinstance(manifest, Mapping):
        return ["the manifest is not a JSON object"]
    problems = []
    for key in ("name", "version"):
        if manifest.get(key) != getattr(event, key):
            problems.append(f"the manifest's {key} is {manifest.get(key)!r}, the event says {getattr(event, key)!r}")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        problems.append("the manifest lists no shards")
    elif any(not (isinstance(s, Mapping) and isinstance(s.get("file"), str)) for s in shards):
        problems.append("the manifest has a shard entry without a file name")
    tokenizer = manifest.get("tokenizer")
    if not (isinstance(tokenizer, Mapping) and isinstance(tokenizer.get("file"), str)):
        problems.append("the manifest names no tokenizer file")
    return problems


def file_problems(listed: Sequence[Listed], seen: Mapping[str, FileSeen]) -> list[str]:
    """Each listed file that is missing, outside the directory, or of another size or sha256."""
    problems = []
    for item in listed:
        if not plain_file_name(item.file):
            problems.append(f"{item.file!r} is not a file name in the version's directory")
            continue
        found = seen.get(item.file)
        if found is None or found.size is None:
            problems.append(f"{item.file} is missing")
        elif item.size is not None and found.size != item.size:
            problems.append(f"{item.file} has {found.size} bytes, the manifest says {item.size}")
        elif item.sha256 is None:
            problems.append(f"{item.file} has no sha256 in the manifest")
        elif found.sha256 != item.sha256:
            problems.append(f"{item.file}: sha256 {(found.sha256 or '?')[:12]}… differs from the manifest's "
                            f"{item.sha256[:12]}…")
    return problems


def version_problems(event: DatasetVersionPublished, seen: VersionSeen) -> list[str]:
    """Every reason to refuse the version; empty when it verifies."""
    if not seen.inside:
        where = seen.manifest_path or event.manifest_uri
        return [f"manifest {where} is not a file under the owner's dataset directory {seen.expected_dir}"]
    if seen.sha256 is None:
        return [f"manifest {seen.manifest_path} cannot be read"]
    problems = []
    if seen.sha256 != event.sha256:
        problems.append(f"the manifest's sha256 is {seen.sha256}, the event says {event.sha256}")
    problems += manifest_shape_problems(event, seen.manifest)
    problems += file_problems(listed_files(seen.manifest), seen.files)
    return problems[:MAX_PROBLEMS]


def rejection_reason(problems: Sequence[str]) -> str:
    """One line for ``reason``: the first problem, and how many more there are."""
    if not problems:
        return "verification failed"
    more = len(problems) - 1
    return problems[0] if more == 0 else f"{problems[0]} (and {more} more problem{'s' if more > 1 else ''})"


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
