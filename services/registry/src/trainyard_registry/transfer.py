"""An export's files between an object-store artifact root and the conversion's local scratch directory.

``trainyard-export`` reads a checkpoint directory and writes a model directory on a filesystem; under an
``s3://`` root the export worker (``exporter.py``) brings its inputs down and its output up around it:

* :func:`stage_inputs` downloads the READY checkpoint's objects (each hashed as it streams, checked
  against its manifest: a mismatch is a :class:`CheckpointCorruptError`, nothing is converted) and
  writes a local manifest naming the copies. Its content hash stays valid: it does not depend on
  where the files live. The dataset's tokenizer comes down too. Local inputs are used where they are.
* :func:`stage_local_checkpoint` does the same for a checkpoint under a local root, because its directory
  belongs to the job's user: a rank of that job (or a later one) could swap a shard, or the step directory,
  for a link to another tenant's checkpoint after verification, and the conversion (root) would read the
  victim's weights into the attacker's export. The manifest and every file are read from handles opened
  from the artifact root one component at a time without following a link (``storage.open_file_under``),
  copied into the conversion's private scratch directory while hashed, and checked against the manifest;
  the conversion reads only the copies.
* :func:`publish_export` uploads the directory the command wrote, each file hashed as it streams and
  checked against the command's listing, ``*.index.json`` after the weights it indexes, and the
  listing (``trainyard-export.json``) last: the commit point, one object whose sha256 is the export's.
  Nothing is renamed.
* :func:`remove_export` deletes an export the other way round: the listing first, then the rest.

A store that fails (not a missing object) raises a retryable :class:`StateStoreError`: the request is
delivered again and the conversion redone.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard_contract.errors import CheckpointCorruptError, StateStoreError
from trainyard_contract.manifest import CheckpointManifest
from trainyard_contract.storage import (
    CHUNK,
    EXPORT_LISTING,
    Location,
    ObjectPath,
    download_file,
    export_listing,
    open_file_under,
    path_to_uri,
    read_bytes,
    remove_file,
    remove_tree,
    upload_file,
    uri_to_path,
)

MANIFEST_FILE = "manifest.json"
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json: uploaded after the shards it names


@dataclass(frozen=True)
class Staged:
    """What the conversion command is given: local paths only."""

    checkpoint: Path  # a checkpoint's manifest.json or its directory
    tokenizer: Path | None
    out: Path  # the directory the command creates


def stage_inputs(checkpoint: Location, tokenizer: Location | None, out: Location, scratch: Path, *,
                 root: Path | None = None) -> Staged:
    """Local paths for the command: a checkpoint copied into ``scratch`` (downloaded from an object store, or
    read through handles under the local artifact ``root``), other inputs in an object store downloaded, an
    output in one written to ``scratch`` first. CheckpointCorruptError for a checkpoint that is not READY or
    not intact; UnsafePathError for one that goes through a link."""
    if isinstance(checkpoint, ObjectPath):
        checkpoint = stage_checkpoint(checkpoint, scratch / "checkpoint")
    elif root is not None:
        checkpoint = stage_local_checkpoint(root, checkpoint, scratch / "checkpoint")
    if isinstance(tokenizer, ObjectPath):
        (scratch / "tokenizer").mkdir(parents=True, exist_ok=True)
        local = scratch / "tokenizer" / tokenizer.name
        _download(tokenizer, local)
        tokenizer = local
    return Staged(checkpoint, tokenizer, scratch / "out" / out.name if isinstance(out, ObjectPath) else out)


def stage_checkpoint(location: ObjectPath, into: Path) -> Path:
    """Download a READY checkpoint (``location``: its manifest or its prefix) into ``into``; the local
    manifest, which names the local copies."""
    manifest_at = location if location.name == MANIFEST_FILE else location / MANIFEST_FILE

    def read_manifest() -> bytes:
        try:
            return read_bytes(manifest_at)
        except FileNotFoundError:
            raise  # the checkpoint is not READY: _stage says so
        except OSError as exc:
            raise StateStoreError(f"cannot read {manifest_at}: {exc}", retryable=True) from exc

    def source_of(uri: str) -> ObjectPath | None:
        return ObjectPath.parse(uri) if "://" in uri else None

    return _stage(manifest_at, into, read_manifest, source_of,
                  lambda source, dest, _size: _download(source, dest))


MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists digests, not data: a larger one is refused unread


def stage_local_checkpoint(root: Path, location: Path, into: Path) -> Path:
    """Copy a READY checkpoint under the local artifact ``root`` (``location``: its manifest or its directory)
    into ``into``, every file read from a handle walked from ``root`` without following a link, hashed as it
    is copied and checked against the manifest; the local manifest, which names the copies."""
    manifest_at = location if location.name == MANIFEST_FILE else location / MANIFEST_FILE

    def copy(source: Path, dest: Path, size: int) -> tuple[int, str]:
        try:
            return _copy_under(root, source, dest, limit=size)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{source} is missing") from None

    return _stage(manifest_at, into, lambda: _read_under(root, manifest_at, limit=MAX_MANIFEST_BYTES),
                  lambda uri: uri_to_path(uri) if uri.startswith("file://") else None, copy)


def _stage(manifest_at: Any, into: Path, read_manifest: Callable[[], bytes],
           source_of: Callable[[str], Any], fetch: Callable[[Any, Path, int], tuple[int, str]]) -> Path:
    """The staging both stores share: the manifest read (``read_manifest``) and parsed, each file it names
    (``source_of`` its URI) directly beside it, fetched into ``into`` (``fetch``: size and sha256 as written)
    and checked against the manifest; a local manifest naming the copies. CheckpointCorruptError otherwise."""
    try:
        raw = read_manifest()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{manifest_at} does not exist: the checkpoint is not READY") from None
    try:
        manifest = CheckpointManifest.model_validate_json(raw)
    except ValueError as exc:
        raise CheckpointCorruptError(f"checkpoint manifest {manifest_at} is malformed: {exc}") from exc
    into.mkdir(parents=True, exist_ok=True)
    local: dict[str, str] = {}
    entries: list[Any] = [*manifest.shards, *manifest.extra_files]  # ShardEntry and ExtraFile: uri, size, sha256
    for entry in entries:
        source = source_of(entry.uri)
        if source is None or source.parent != manifest_at.parent or source.name in local.values() \
                or source.name in ("", ".", "..", MANIFEST_FILE):
            raise CheckpointCorruptError(f"checkpoint file {entry.uri} is not beside its manifest {manifest_at}")
        size, sha256 = fetch(source, into / source.name, entry.size_bytes)
        if (size, sha256) != (entry.size_bytes, entry.sha256):
            raise CheckpointCorruptError(
                f"checkpoint step {manifest.global_step} ({manifest_at}) failed verification: {source.name} has "
                f"{size} bytes, sha256 {sha256[:12]}…; its manifest says {entry.size_bytes} bytes, "
                f"sha256 {entry.sha256[:12]}…")
        local[entry.uri] = source.name
    copy = manifest.model_copy(update={
        "shards": [s.model_copy(update={"uri": path_to_uri(into / local[s.uri])}) for s in manifest.shards],
        "extra_files": [f.model_copy(update={"uri": path_to_uri(into / local[f.uri])})
                        for f in manifest.extra_files],
    })
    (into / MANIFEST_FILE).write_bytes(copy.to_bytes())
    return into / MANIFEST_FILE


def _read_under(root: Path, path: Path, *, limit: int) -> bytes:
    with os.fdopen(open_file_under(root, path), "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CheckpointCorruptError(f"{path} is larger than {limit} bytes: refused")
    return data


def _copy_under(root: Path, source: Path, dest: Path, *, limit: int) -> tuple[int, str]:
    """Copy the regular file ``source`` under ``root`` (never through a link) to ``dest``, at most ``limit`` + 1
    bytes (a file that grew is refused by its size); its size and sha256 as copied."""
    digest, size = hashlib.sha256(), 0
    with os.fdopen(open_file_under(root, source), "rb") as src, open(dest, "wb") as out:
        while size <= limit and (chunk := src.read(min(CHUNK, limit + 1 - size))):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def publish_export(directory: Path, out: ObjectPath) -> str:
    """Upload the export ``directory`` under ``out``, its listing last; the listing's sha256 (as sent).
    StateStoreError (not retryable) when a file is not what the listing says."""
    raw = (directory / EXPORT_LISTING).read_bytes()
    try:
        listed = {f.name: f for f in export_listing(raw)}
    except ValueError as exc:
        raise StateStoreError(f"{directory / EXPORT_LISTING}: {exc}", retryable=False) from exc
    present = sorted(p.name for p in directory.iterdir() if p.name != EXPORT_LISTING)
    if sorted(listed) != present:
        raise StateStoreError(f"{directory} holds {present}, its listing names {sorted(listed)}", retryable=False)
    for name in sorted(present, key=lambda n: (n.endswith(INDEX_SUFFIX), n)):
        size, sha256 = _upload(directory / name, out / name)
        if (size, sha256) != (listed[name].size, listed[name].sha256):
            raise StateStoreError(f"{name} was uploaded as {size} bytes, sha256 {sha256[:12]}…; the listing says "
                                  f"{listed[name].size} bytes, sha256 {listed[name].sha256[:12]}…", retryable=False)
    return _upload(directory / EXPORT_LISTING, out / EXPORT_LISTING)[1]  # the commit point


def remove_export(out: ObjectPath) -> None:
    """Delete an export (or what an interrupted upload left): its listing first, then every object."""
    try:
        remove_file(out / EXPORT_LISTING)
        remove_tree(out)
    except OSError as exc:
        raise StateStoreError(f"cannot remove {out}: {exc}", retryable=True) from exc


def _download(source: ObjectPath, dest: Path) -> tuple[int, str]:
    try:
        return download_file(source, dest)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{source} is missing") from None
    except OSError as exc:
        raise StateStoreError(f"cannot download {source}: {exc}", retryable=True) from exc


def _upload(source: Path, dest: ObjectPath) -> tuple[int, str]:
    try:
        return upload_file(source, dest)
    except OSError as exc:
        raise StateStoreError(f"cannot upload {posixpath.basename(str(dest))} to {dest}: {exc}",
                              retryable=True) from exc
