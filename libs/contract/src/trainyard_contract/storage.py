"""The artifact store: layout per tenant and job, atomic writes, content hashes.

The store is a filesystem root (``./.trainyard/artifacts`` locally, a shared filesystem
in a cluster) or an fsspec URL (``s3://bucket/prefix`` with s3fs: an object store). Local
URIs are ``file://`` absolute paths so every process, whatever its working directory,
resolves them the same way; an object's URI is its fsspec URL. Under an object-store root
the layout's locations are :class:`ObjectPath` s instead of :class:`~pathlib.Path` s.

An object store has no rename: an object is visible whole once its upload completes
(:func:`commit_bytes` is one PUT), and a directory of files becomes visible only through a
file written last that lists the others (a checkpoint's ``manifest.json``, an export's
``trainyard-export.json``). Credentials and endpoint come from the standard configuration
(``AWS_*`` variables, ``~/.aws``, ``AWS_ENDPOINT_URL_S3``; fsspec's ``FSSPEC_S3_*``).

Layout::

    <root>/datasets/<name>/<version>/{manifest.json,tokenizer.json,shard-00000.bin,…}   (the platform's)
    <root>/tenants/<tenant>/datasets/<name>/<version>/…                               (a tenant's)
    <root>/tenants/<tenant>/jobs/<job>/attempts/<n>/logs/rank-<r>.log
    <root>/tenants/<tenant>/jobs/<job>/attempts/<n>/events/rank-<r>.jsonl
    <root>/tenants/<tenant>/jobs/<job>/checkpoints/step-<000000040>-a<n>/{__<r>_0.distcp,.metadata,manifest.json}
    <root>/tenants/<tenant>/code/sha256/<hex>.tar.gz     (a code archive, named by its sha256)
    <root>/tenants/<tenant>/code/sha256/<hex>.json       (what the API recorded of it: size, files, uploadedAt)
    <root>/tenants/<tenant>/jobs/<job>/exports/<checkpoint dir>/<format>/{config.json,model.safetensors,…,
                                                                           trainyard-export.json}
    <root>/tenants/<tenant>/models/<name>/…              (a Hugging Face directory brought in)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import posixpath
import secrets
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from trainyard_contract.errors import StateStoreError
from trainyard_contract.spec import DatasetRef

CHUNK = 4 * 1024 * 1024
EXPORT_LISTING = "trainyard-export.json"
"""An export directory's file listing, written last: every other file with its size and sha256 (the
export artifact's hash is this file's sha256)."""


@dataclass(frozen=True)
class ListedFile:
    name: str
    size: int
    sha256: str


def export_listing(raw: bytes) -> list[ListedFile]:
    """The files an export's ``trainyard-export.json`` lists: plain names in the directory, each with its
    size and sha256. ValueError for anything else."""
    doc = json.loads(raw)
    entries = doc.get("files") if isinstance(doc, dict) else None
    if isinstance(entries, dict):
        entries = [{"name": k, **v} for k, v in entries.items() if isinstance(v, dict)]
    if not isinstance(entries, list):
        raise ValueError(f"{EXPORT_LISTING} has no list of files")
    files = []
    for entry in entries:
        name = entry.get("name", entry.get("file", entry.get("path"))) if isinstance(entry, dict) else None
        size = entry.get("size", entry.get("sizeBytes")) if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not (isinstance(name, str) and name and "/" not in name and "\\" not in name and name not in (".", "..")
                and name != EXPORT_LISTING and isinstance(size, int) and size >= 0 and isinstance(digest, str)):
            raise ValueError(f"{EXPORT_LISTING} has an entry that is not a file of the directory: {entry!r:.200}")
        files.append(ListedFile(name, size, digest.removeprefix("sha256:")))
    return files


def path_to_uri(path: Path | str) -> str:
    return Path(path).resolve().as_uri()


def uri_to_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path if parsed.scheme else uri))
    raise StateStoreError(f"unsupported artifact URI scheme {parsed.scheme!r} in {uri!r}", retryable=False)


def sha256_file(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write to a temporary sibling, fsync, rename into place, fsync the directory.

    The sibling's name is unique, so concurrent writers of one path (threads of one process too)
    never share it: the last rename wins, and every rename publishes a complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# ----------------------------------------------------------------------------- below the root, never through a link


class UnsafePathError(StateStoreError):
    """A location under the artifact root that goes through a symbolic link, or a component that is not
    a directory (a file that is not a regular file): a rank may have swapped it. Never retried."""

    retryable = False


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts_under(root: Path | str, path: Path | str) -> list[str]:
    """``path``'s components below ``root`` (both made absolute and normalised as strings, never resolved)."""
    base, target = os.path.normpath(os.path.abspath(root)), os.path.normpath(os.path.abspath(path))
    if target == base:
        return []
    if not target.startswith(base.rstrip(os.sep) + os.sep):
        raise UnsafePathError(f"{path} is not under the artifact root {root}")
    return target[len(base.rstrip(os.sep)) + 1:].split(os.sep)


def open_dir_under(root: Path | str, path: Path | str) -> int:
    """A handle of the directory ``path`` under ``root``, opened from ``root`` one component at a time
    (``O_DIRECTORY|O_NOFOLLOW`` relative to the previous handle, each checked with ``fstat``): a
    component that is a symbolic link is refused (:class:`UnsafePathError`), whatever it points to and
    whenever it was swapped in. ``root`` itself is the platform's configuration and is trusted.
    FileNotFoundError when a component is missing. The caller closes the handle."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in _parts_under(root, path):
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise UnsafePathError(f"{path}: {part!r} is a symbolic link or not a directory: refused") from exc
                raise
            os.close(fd)
            fd = child
            if not stat.S_ISDIR(os.fstat(fd).st_mode):  # pragma: no cover - O_DIRECTORY says so already
                raise UnsafePathError(f"{path}: {part!r} is not a directory: refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file_under(root: Path | str, path: Path | str) -> int:
    """A read handle of the regular file ``path`` under ``root`` (its directories walked as in
    :func:`open_dir_under`, the file itself ``O_NOFOLLOW|O_NONBLOCK``, ``fstat``: a regular file).
    FileNotFoundError when it is missing; :class:`UnsafePathError` for a link, a FIFO, a device…"""
    path = Path(path)
    directory = open_dir_under(root, path.parent)
    try:
        try:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise UnsafePathError(f"{path} is a symbolic link: refused") from exc
            raise
    finally:
        os.close(directory)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file: refused")
    return fd


def stat_size_under(root: Path | str, path: Path | str) -> int | None:
    """Size of the regular file ``path`` under ``root`` (see :func:`open_file_under`); None: missing."""
    try:
        fd = open_file_under(root, path)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def sha256_under(root: Path | str, path: Path | str) -> str:
    """sha256 of the regular file ``path`` under ``root``, read from a handle :func:`open_file_under` opened."""
    digest = hashlib.sha256()
    with os.fdopen(open_file_under(root, path), "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def commit_bytes_under(root: Path | str, path: Path | str, data: bytes) -> None:
    """Publish ``data`` whole at ``path`` under ``root`` without following a link on the way: the
    directory is opened with :func:`open_dir_under` (it must exist: nothing is created), the temporary
    file created in it (``O_CREAT|O_EXCL|O_NOFOLLOW``, ``dir_fd``), fsynced and renamed into place
    relative to that handle, the directory fsynced. A directory swapped for a link before the walk is
    refused (:class:`UnsafePathError`); one swapped after it is not written through (the handle holds the
    real directory)."""
    path = Path(path)
    directory = open_dir_under(root, path.parent)
    tmp = f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.rename(tmp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=directory)
            raise
        os.fsync(directory)
    finally:
        os.close(directory)


def remove_file_under(root: Path | str, path: Path | str) -> None:
    """Delete the file ``path`` under ``root`` relative to a handle of its directory (see
    :func:`open_dir_under`); absent is fine."""
    path = Path(path)
    try:
        directory = open_dir_under(root, path.parent)
    except FileNotFoundError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.name, dir_fd=directory)
            os.fsync(directory)
    finally:
        os.close(directory)


def remove_tree_under(root: Path | str, path: Path | str) -> None:
    """rm -r ``path`` under ``root`` relative to a handle of its parent (see :func:`open_dir_under`):
    a ``path`` that is itself a link is unlinked, never followed; a link above it is refused
    (:class:`UnsafePathError`); below it ``shutil.rmtree`` works from directory handles too. Absent is fine."""
    import shutil

    path = Path(path)
    try:
        parent = open_dir_under(root, path.parent)
    except FileNotFoundError:
        return
    try:
        try:
            mode = os.lstat(path.name, dir_fd=parent).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            shutil.rmtree(path.name, dir_fd=parent)
        else:
            os.unlink(path.name, dir_fd=parent)
        os.fsync(parent)
    finally:
        os.close(parent)


# ----------------------------------------------------------------------------- object storage (fsspec)


@dataclass(frozen=True)
class ObjectPath:
    """A location in an object store, ``<scheme>://<bucket>/<key>``, with the few path operations the
    layout and the checkpoint code use (``/``, ``name``, ``parent``, ``with_name``)."""

    scheme: str
    path: str  # "<bucket>/<key>", normalised, without leading or trailing slash

    @classmethod
    def parse(cls, url: str) -> ObjectPath:
        scheme, sep, rest = url.partition("://")
        if not sep or len(scheme) < 2 or scheme == "file" or not rest.strip("/"):
            raise ValueError(f"not an object-store URL: {url!r}")
        return cls(scheme, posixpath.normpath(rest).strip("/"))

    def __truediv__(self, part: str | os.PathLike[str]) -> ObjectPath:
        joined = posixpath.normpath(posixpath.join(self.path, os.fspath(part))).strip("/")
        if joined.split("/", 1)[0] != self.path.split("/", 1)[0]:
            raise ValueError(f"{part!r} leaves the bucket of {self}")
        return ObjectPath(self.scheme, joined)

    def joinpath(self, *parts: str) -> ObjectPath:
        location = self
        for part in parts:
            location = location / part
        return location

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.scheme, posixpath.dirname(self.path) or self.path)

    @property
    def parents(self) -> list[ObjectPath]:
        found, location = [], self
        while (up := location.parent) != location:
            found.append(up)
            location = up
        return found

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def as_uri(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"


Location = Path | ObjectPath
"""Where an artifact lives: a local (or shared-filesystem) path, or an object in an object store."""


def is_object_url(value: object) -> bool:
    """Whether ``value`` is an fsspec URL of an object store (``s3://…``), not a local path or ``file://``."""
    if not isinstance(value, str):
        return isinstance(value, ObjectPath)
    scheme = urlparse(value).scheme
    return len(scheme) > 1 and scheme != "file" and "://" in value


def root_setting(value: object) -> object:
    """An artifact-root setting as read (a pydantic ``before`` validator): an object-store URL stays a string
    (a Path would fold its ``//``) once it parses (ValueError: reported against the variable); any other
    string is a Path."""
    if isinstance(value, str) and is_object_url(value):
        ObjectPath.parse(value)
        return value
    return Path(value) if isinstance(value, str) else value


def as_location(value: str | os.PathLike[str] | ObjectPath) -> Location:
    """A root, path or URI as a location: an object-store URL → :class:`ObjectPath`; a ``file://`` URI
    or a path → an absolute :class:`Path`."""
    if isinstance(value, ObjectPath):
        return value
    if isinstance(value, str) and is_object_url(value):
        return ObjectPath.parse(value)
    if isinstance(value, str) and value.startswith("file:"):
        return uri_to_path(value)
    return Path(value).expanduser().resolve()


def location_uri(location: Location) -> str:
    """The URI recorded for ``location`` (manifests, events, records)."""
    return str(location) if isinstance(location, ObjectPath) else path_to_uri(location)


_FS_LOCK = threading.Lock()
_FILESYSTEMS: dict[tuple[str, int], Any] = {}


def object_filesystem(location: ObjectPath | str) -> Any:
    """The fsspec filesystem of ``location``'s scheme, configured from the environment (one per process).

    Listings are not cached: other processes (ranks, the coordinator) write under the same
    prefixes, and a stale listing would hide their objects."""
    scheme = location.scheme if isinstance(location, ObjectPath) else ObjectPath.parse(location).scheme
    key = (scheme, os.getpid())
    with _FS_LOCK:
        if key not in _FILESYSTEMS:
            _FILESYSTEMS[key] = _make_filesystem(scheme)
        return _FILESYSTEMS[key]


def object_storage_options() -> dict[str, Any]:
    """What every object-store filesystem of this process is opened with (also for DCP's fsspec I/O)."""
    return {"use_listings_cache": False}


def _make_filesystem(scheme: str) -> Any:
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec ships with torch
        raise StateStoreError(f"{scheme}:// artifacts need fsspec", retryable=False) from exc
    try:
        return fsspec.filesystem(scheme, **object_storage_options())
    except (ImportError, ValueError) as exc:
        raise StateStoreError(f"no filesystem for {scheme}:// ({exc}); install its fsspec backend "
                              "(s3fs for s3://)", retryable=False) from exc


def _object(location: ObjectPath) -> tuple[Any, str]:
    return object_filesystem(location), location.path


def exists(location: Location) -> bool:
    if isinstance(location, ObjectPath):
        fs, key = _object(location)
        return bool(fs.exists(key))
    return location.exists()


def stat_size(location: Location) -> int | None:
    """Size in bytes, None when there is no such file or object."""
    if isinstance(location, ObjectPath):
        fs, key = _object(location)
        try:
            info = fs.info(key)
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])
    try:
        return location.stat().st_size
    except FileNotFoundError:
        return None


def sha256_of(location: Location) -> str:
    """sha256 of a file or object, streamed in chunks."""
    if not isinstance(location, ObjectPath):
        return sha256_file(location)
    fs, key = _object(location)
    digest = hashlib.sha256()
    with fs.open(key, "rb", block_size=CHUNK, cache_type="none") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_bytes(location: Location) -> bytes:
    """A whole file or object; FileNotFoundError when there is none."""
    if isinstance(location, ObjectPath):
        fs, key = _object(location)
        return bytes(fs.cat_file(key))
    return location.read_bytes()


def commit_bytes(location: Location, data: bytes) -> None:
    """Publish ``data`` whole at ``location``: an atomic rename locally, one PUT in an object store
    (an object is never visible half-written). The commit point of whatever it lists."""
    if isinstance(location, ObjectPath):
        fs, key = _object(location)
        fs.pipe_file(key, data)
        return
    atomic_write_bytes(location, data)


def remove_file(location: Location) -> None:
    """Delete one file or object (durably: the directory is fsynced locally); absent is fine."""
    if isinstance(location, ObjectPath):
        fs, key = _object(location)
        try:
            fs.rm_file(key)
        except FileNotFoundError:
            pass
        return
    try:
        location.unlink()
    except FileNotFoundError:
        return
    fsync_dir(location.parent)


def remove_tree(location: Location) -> None:
    """Delete a directory, or every object under a prefix; absent is fine."""
    if isinstance(location, ObjectPath):
        fs, key = _object(location)
        try:
            fs.rm(key.rstrip("/") + "/", recursive=True)
        except FileNotFoundError:
            pass
        return
    import shutil

    shutil.rmtree(location, ignore_errors=True)


@dataclass(frozen=True)
class Child:
    """An entry of a directory (a common prefix in an object store); ``mtime`` of the newest object in it."""

    name: str
    is_dir: bool
    mtime: float | None
    size: int | None = None  # a file's bytes


def list_children(location: Location) -> list[Child]:
    """The entries directly under ``location``; empty when there is none. In an object store a
    sub-"directory" is a common prefix, and its age that of the newest object under it."""
    if not isinstance(location, ObjectPath):
        found = []
        try:
            entries = list(location.iterdir())
        except FileNotFoundError:
            return []
        for entry in entries:
            try:
                st = entry.stat()
                found.append(Child(entry.name, entry.is_dir(), st.st_mtime, None if entry.is_dir() else st.st_size))
            except FileNotFoundError:
                continue  # removed meanwhile
        return found
    fs, key = _object(location)
    try:
        entries = fs.ls(key, detail=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        name = posixpath.basename(entry["name"].rstrip("/"))
        if entry.get("type") == "directory":
            newest = [_mtime(info) for info in fs.find(entry["name"], detail=True).values()]
            found.append(Child(name, True, max((m for m in newest if m is not None), default=None)))
        else:
            found.append(Child(name, False, _mtime(entry), int(entry.get("size") or 0)))
    return found


def _mtime(info: dict[str, Any]) -> float | None:
    value = info.get("LastModified", info.get("mtime", info.get("last_modified")))
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


def glob(location: Location, pattern: str) -> list[Location]:
    """The files under ``location`` that match ``pattern`` (``*/manifest.json``), sorted."""
    if not isinstance(location, ObjectPath):
        return list[Location](sorted(location.glob(pattern)))
    fs, key = _object(location)
    return sorted((ObjectPath(location.scheme, p.strip("/")) for p in fs.glob(f"{key}/{pattern}")),
                  key=str)


class HashingWriter(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through it to ``raw``: an upload's
    sha256 and size without reading the object back. ``tell()`` is the bytes written so far."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.size = 0
        self._digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        self._digest.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self.closed:
            self.raw.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def is_file(location: Location) -> bool:
    """Whether a regular file (locally) or an object (in a store) is there."""
    if isinstance(location, ObjectPath):
        return stat_size(location) is not None
    return location.is_file()


@contextlib.contextmanager
def upload(location: ObjectPath, *, exclusive: bool = False) -> Iterator[HashingWriter]:
    """Stream one object up: what is written is sent in parts, hashed and counted as it passes (the
    writer's ``hexdigest()`` and ``size``). The object appears whole when the block ends, and not at
    all when it raises (the multipart upload is aborted). ``exclusive``: create only, FileExistsError
    when the object exists (a conditional PUT: the first writer wins)."""
    fs, key = _object(location)
    fh = fs.open(key, "xb" if exclusive else "wb")
    writer = HashingWriter(fh)
    try:
        yield writer
        writer.close()  # flushed through to the object's buffer, which stays open
    except BaseException:
        # s3fs: discard aborts the multipart upload (nothing was PUT otherwise); then never close it, for
        # closing would complete the upload
        for undo in (writer.close, getattr(fh, "discard", None), lambda: setattr(fh, "closed", True)):
            with contextlib.suppress(Exception):
                if undo is not None:
                    undo()
        raise
    fh.close()  # completes the upload: the object appears whole


def upload_file(source: Path | str, location: ObjectPath, *, exclusive: bool = False) -> tuple[int, str]:
    """Copy a local file to an object, streamed; the (size, sha256) of the bytes sent."""
    with open(source, "rb") as fh, upload(location, exclusive=exclusive) as writer:
        while chunk := fh.read(CHUNK):
            writer.write(chunk)
    return writer.size, writer.hexdigest()


def download_file(location: ObjectPath, dest: Path | str) -> tuple[int, str]:
    """Copy an object to a local file (written anew), streamed; the (size, sha256) of the bytes received.
    FileNotFoundError when there is no such object."""
    fs, key = _object(location)
    with fs.open(key, "rb", block_size=CHUNK, cache_type="none") as src, open(dest, "wb") as out:
        writer = HashingWriter(out)
        while chunk := src.read(CHUNK):
            writer.write(chunk)
        writer.close()
    return writer.size, writer.hexdigest()


def iter_chunks(location: Location, chunk_size: int = CHUNK) -> Iterator[bytes]:
    """A file's or object's bytes in chunks (for streaming it out); FileNotFoundError when there is none."""
    if isinstance(location, ObjectPath):
        fs, key = _object(location)
        fh = fs.open(key, "rb", block_size=chunk_size, cache_type="none")
    else:
        fh = open(location, "rb")
    with fh:
        while chunk := fh.read(chunk_size):
            yield chunk


class ArtifactLayout:
    """Where things live under the artifact root (a local path, or an object-store URL: then every
    location it gives is an :class:`ObjectPath`)."""

    def __init__(self, root: Path | str | ObjectPath) -> None:
        self.root: Any = as_location(root)

    @property
    def remote(self) -> bool:
        """Whether the root is an object store."""
        return isinstance(self.root, ObjectPath)

    def dataset_dir(self, name: str, version: str, tenant: str | None = None) -> Path:
        """A platform dataset under ``datasets/``; a tenant's under ``tenants/<tenant>/datasets/``."""
        base = self.root / "tenants" / tenant / "datasets" if tenant else self.root / "datasets"
        return base / name / version

    def dataset_ref_dir(self, ref: str) -> Path:
        """The directory of a qualified dataset reference (``name@version`` or ``tenant/name@version``)."""
        tenant, name, version = DatasetRef.parse(ref)
        return self.dataset_dir(name, version, tenant)

    def job_dir(self, tenant: str, job_id: str) -> Path:
        return self.root / "tenants" / tenant / "jobs" / job_id

    def attempt_dir(self, tenant: str, job_id: str, attempt: int) -> Path:
        return self.job_dir(tenant, job_id) / "attempts" / str(attempt)

    def rank_log(self, tenant: str, job_id: str, attempt: int, rank: int, generation: int = 0) -> Path:
        """A rank's log (``generation`` n: the n-th replacement of a fault-tolerant job's replica, its own file)."""
        return self.attempt_dir(tenant, job_id, attempt) / "logs" / f"rank-{rank}{_generation(generation)}.log"

    def rank_log_segments(self, tenant: str, job_id: str, attempt: int, rank: int, generation: int = 0) -> Path:
        """Where a node agent ships a rank's log under an object-store root (:mod:`trainyard_contract.logsegments`)."""
        return self.attempt_dir(tenant, job_id, attempt) / "logs" / f"rank-{rank}{_generation(generation)}"

    def rank_events(self, tenant: str, job_id: str, attempt: int, rank: int) -> Path:
        return self.attempt_dir(tenant, job_id, attempt) / "events" / f"rank-{rank}.jsonl"

    def checkpoints_dir(self, tenant: str, job_id: str) -> Path:
        return self.job_dir(tenant, job_id) / "checkpoints"

    def checkpoint_dir(self, tenant: str, job_id: str, attempt: int, step: int) -> Path:
        return self.checkpoints_dir(tenant, job_id) / f"step-{step:09d}-a{attempt}"

    def exports_dir(self, tenant: str, job_id: str) -> Path:
        return self.job_dir(tenant, job_id) / "exports"

    def export_dir(self, tenant: str, job_id: str, checkpoint_name: str, fmt: str) -> Path:
        """A checkpoint's conversion: ``tenants/<t>/jobs/<job>/exports/<checkpoint dir name>/<format>``."""
        return self.exports_dir(tenant, job_id) / checkpoint_name / fmt

    def tenant_dir(self, tenant: str) -> Path:
        """The tenant's prefix; ``initFrom.huggingFace`` is relative to it."""
        return self.root / "tenants" / tenant

    def model_dir(self, tenant: str, name: str) -> Path:
        """A Hugging Face model directory brought in with ``trainyard models import``."""
        return self.tenant_dir(tenant) / "models" / name

    @staticmethod
    def manifest_path(checkpoint_dir: Path) -> Path:
        return checkpoint_dir / "manifest.json"

    def code_dir(self, tenant: str) -> Path:
        return self.root / "tenants" / tenant / "code" / "sha256"

    def code_archive(self, tenant: str, hex_digest: str) -> Path:
        """The tenant's code archive whose sha256 is ``hex_digest`` (``code.archive`` = ``sha256:<hex>``)."""
        return self.code_dir(tenant) / f"{hex_digest}.tar.gz"

    def code_archive_meta(self, tenant: str, hex_digest: str) -> Path:
        """What the API recorded of that archive (JSON), written after the archive itself."""
        return self.code_dir(tenant) / f"{hex_digest}.json"


def _generation(generation: int) -> str:
    return f".g{generation}" if generation else ""
