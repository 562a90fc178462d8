"""The artifact store: layout per tenant and job, atomic writes, content hashes.

The store is a filesystem root (``./.trainyard/artifacts`` locally, a shared filesystem
in a cluster). URIs are ``file://`` absolute paths so every process, whatever its
working directory, resolves them the same way.

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

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from trainyard_common.errors import StateStoreError
from trainyard_common.spec import DatasetRef

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


class ArtifactLayout:
    """Where things live under the artifact root."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()

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

    def rank_log(self, tenant: str, job_id: str, attempt: int, rank: int) -> Path:
        return self.attempt_dir(tenant, job_id, attempt) / "logs" / f"rank-{rank}.log"

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
