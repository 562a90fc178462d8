"""Checkpoint manifests (docs/design.md §5) and their verification.

``verify_manifest`` is pure: file access is injected (``stat_size``, ``file_sha256``) so
the coordinator, the trainer's restore path and the tests share one rule.

A manifest carries two hashes, for two questions:

* ``contentHash`` — *are these the files that were written?* sha256 over every file's size and
  sha256, DCP's ``.metadata`` included. The coordinator verified each file before it wrote it. It
  differs between bitwise-identical checkpoints: DCP's ``.metadata`` holds a fresh save id.
* ``tensorsHash`` — *do these checkpoints hold the same values?* sha256 over every saved entry's
  digest (:class:`TensorDigest`: key, offset, sha256 of dtype + shape + raw bytes), sorted by key
  and offset (:func:`tensors_hash`). Equal for bitwise-identical checkpoints, different when one
  element differs. The ranks computed the entry digests; the coordinator only combined them.
"""

from __future__ import annotations

from typing import Any

import hashlib
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_contract.events import FileDigest, TensorDigest, utcnow
from trainyard_contract.spec import canonical_json

MANIFEST_VERSION = 1


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True, extra="ignore")


class ShardEntry(_Wire):
    rank: int = Field(ge=0)
    uri: str
    size_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ParallelLayout(_Wire):
    dp: int = 1
    tp: int = 1
    pp: int = 1


class CheckpointManifest(_Wire):
    manifest_version: int = MANIFEST_VERSION
    job_id: str
    tenant: str
    attempt: int
    epoch: int
    global_step: int
    world_size: int
    parallelism: ParallelLayout = ParallelLayout()
    consumed_tokens: int = 0
    consumed_samples: int = 0
    spec_hash: str | None = None
    shards: list[ShardEntry]
    extra_files: list[FileDigest] = []
    content_hash: str = Field(description="sha256 over the files as written (DCP's .metadata included), verified "
                                          "by the coordinator: differs between bitwise-identical checkpoints")
    created_at: datetime = Field(default_factory=utcnow)
    tensors: list[TensorDigest] = Field(
        default=[], description="every saved entry's digest, sorted by key and offset, as the ranks reported them")
    tensors_hash: str | None = Field(
        default=None, description="sha256 over ``tensors`` (tensors_hash): equal for checkpoints holding the same "
                                  "values; null when a rank did not report its entries")

    def to_bytes(self) -> bytes:
        return self.model_dump_json(by_alias=True, indent=2).encode()

    def total_bytes(self) -> int:
        """Bytes of every file it lists: the shards and the shared (extra) files."""
        return sum(s.size_bytes for s in self.shards) + sum(f.size_bytes for f in self.extra_files)


def content_hash(shards: Sequence[ShardEntry], extra_files: Sequence[FileDigest] = ()) -> str:
    """sha256 over the ordered (rank, size, sha256) of every shard and shared file.

    Independent of where the files live, so a copied checkpoint keeps its hash.
    """
    body = {
        "shards": [[s.rank, s.size_bytes, s.sha256] for s in sorted(shards, key=lambda s: s.rank)],
        "extra": sorted([_basename(f.uri), f.size_bytes, f.sha256] for f in extra_files),
    }
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


def tensor_order(digest: TensorDigest) -> tuple[str, list[int]]:
    """The canonical order of entry digests: by key, then by the chunk's offset."""
    return digest.key, digest.offset


def tensors_hash(digests: Iterable[TensorDigest]) -> str:
    """sha256 over the canonical JSON of every entry's ``[key, offset, sha256]``, in :func:`tensor_order`.

    Pure and order-free: the same entries give the same hash whichever ranks reported them and in
    whatever order. An entry reported twice identically counts once (DCP writes each entry once);
    two different digests of one entry are the caller's to refuse (:func:`conflicting_tensors`).
    """
    unique = {(d.key, tuple(d.offset)): d for d in digests}
    body = [[d.key, d.offset, d.sha256] for d in sorted(unique.values(), key=tensor_order)]
    return "sha256:" + hashlib.sha256(canonical_json({"tensors": body})).hexdigest()


def conflicting_tensors(digests: Iterable[TensorDigest]) -> list[str]:
    """The entries (``key@offset``) reported with two different digests, sorted. Pure."""
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    conflicts = set()
    for d in digests:
        where = (d.key, tuple(d.offset))
        if seen.setdefault(where, d.sha256) != d.sha256:
            conflicts.add(where)
    return [f"{key}@{list(offset)}" for key, offset in sorted(conflicts)]


def _basename(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def verify_manifest(
    manifest: CheckpointManifest,
    *,
    stat_size: Callable[[str], int | None],
    file_sha256: Callable[[str], str],
) -> list[str]:
    """Every problem found, as sentences; empty when the checkpoint is complete and intact.

    ``stat_size(uri)`` returns None for a missing file. Hashes are computed only for
    files whose size matches, so a truncated shard is reported without reading it.
    """
    problems: list[str] = []
    ranks = sorted(s.rank for s in manifest.shards)
    if ranks != list(range(manifest.world_size)):
        problems.append(f"shards cover ranks {ranks}, expected 0..{manifest.world_size - 1}")
    entries: list[tuple[str, str, int, str]] = [
        (f"rank {s.rank} shard", s.uri, s.size_bytes, s.sha256) for s in manifest.shards
    ] + [(f"shared file {_basename(f.uri)}", f.uri, f.size_bytes, f.sha256) for f in manifest.extra_files]
    for what, uri, size, sha in entries:
        actual = stat_size(uri)
        if actual is None:
            problems.append(f"{what} is missing: {uri}")
        elif actual != size:
            problems.append(f"{what} has {actual} bytes, manifest says {size}: {uri}")
        elif (digest := file_sha256(uri)) != sha:
            problems.append(f"{what} sha256 {digest[:12]}… does not match manifest {sha[:12]}…: {uri}")
    expected = content_hash(manifest.shards, manifest.extra_files)
    if expected != manifest.content_hash:
        problems.append(f"content hash {manifest.content_hash} does not match its shards ({expected})")
    if manifest.tensors_hash is not None and manifest.tensors_hash != (listed := tensors_hash(manifest.tensors)):
        problems.append(f"tensors hash {manifest.tensors_hash} does not match its tensor digests ({listed})")
    return problems


def _own_path(uri: str) -> Any:
    """The local path of ``uri``, refused (StateStoreError) when any part of it is a symbolic link:
    checkpoint files are written by ranks, and a rank could swap a shard for a link to another
    tenant's file after reporting it. Platform URIs name resolved paths (``path_to_uri``)."""
    import os

    from trainyard_contract.errors import StateStoreError
    from trainyard_contract.storage import uri_to_path

    path = uri_to_path(uri)
    real = os.path.realpath(path)
    if real != os.path.normpath(path):
        raise StateStoreError(f"{uri} goes through a symbolic link (to {real}): refused", retryable=False)
    return path


def local_stat_size(uri: str) -> int | None:
    """Size of the file or object ``uri`` names (None: missing). A ``file://`` URI is read locally,
    refusing symbolic links; an object-store URL (``s3://…``) through its fsspec filesystem."""
    from trainyard_contract.storage import ObjectPath, is_object_url, stat_size

    if is_object_url(uri):
        return stat_size(ObjectPath.parse(uri))
    try:
        return _own_path(uri).stat().st_size
    except FileNotFoundError:
        return None


def local_sha256(uri: str) -> str:
    """sha256 of the file or object ``uri`` names, streamed (see :func:`local_stat_size`)."""
    import hashlib
    import os

    from trainyard_contract.storage import ObjectPath, is_object_url, sha256_of

    if is_object_url(uri):
        return sha256_of(ObjectPath.parse(uri))
    fd = os.open(_own_path(uri), os.O_RDONLY | os.O_NOFOLLOW)  # and not swapped for one since
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
