"""The node-local cache of users' code trees, one entry per archive hash (a :class:`SealedCache`: built once,
verified before every launch, quarantined when tampered, evicted least recently used, shared by several
agents; see :mod:`sealedcache`), and the paths a rank of user code runs with.

An entry's tree is the extracted archive. Building it reads the archive from the artifact store and checks
its sha256 (a mismatch is refused, never run) before extracting.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter
from trainyard_contract.codetree import CodeTreeError, TreeDigest, archive_hex, extract
from trainyard_contract.spec import Code
from trainyard_contract.storage import ArtifactLayout, read_bytes

from trainyard_node_agent.sealedcache import (
    CacheCounters,
    CacheEntry,
    Collection,
    Quarantined,
    Sealed,
    SealedCache,
    choose_evictions,
    choose_purges,
    parse_quarantined,
    quarantine_name,
    remove_tree,
    seal,
)

__all__ = ["CacheEntry", "CodeCache", "CodeTree", "Collection", "Quarantined", "RankPaths", "TAMPERED",
           "check_archive", "choose_evictions", "choose_purges", "code_archive_path", "parse_quarantined",
           "quarantine_name", "rank_paths", "remove_tree", "seal"]

TAMPERED = Counter("trainyard_node_agent_code_cache_tampered_total",
                   "cached code trees that no longer matched their digest before a launch (quarantined, "
                   "re-materialised)")
MATERIALISED = Counter("trainyard_node_agent_code_cache_materialised_total",
                       "code archives extracted into the node's code cache")
EVICTED = Counter("trainyard_node_agent_code_cache_evicted_total",
                  "code cache entries removed to stay under TRAINYARD_CODE_CACHE_MAX_BYTES")
PURGED = Counter("trainyard_node_agent_code_cache_quarantine_purged_total",
                 "quarantined (tampered) code trees deleted once no running rank used them")


@dataclass(frozen=True)
class RankPaths:
    """Everything on disk a rank of user code may touch. One place, so a sandbox (a later issue) can
    bind exactly these: the code tree read-only, the datasets read-only, the job's checkpoint
    prefix and the rank's scratch directory writable, plus the attempt's own files."""

    code_dir: Path  # the verified tree (TRAINYARD_CODE_DIR), read-only
    cwd: Path  # <code_dir>/<workingDir or .>
    datasets: tuple[Path, ...]  # read-only
    checkpoints: Path  # the job's checkpoint prefix, writable
    scratch: Path  # the rank's own scratch directory (TRAINYARD_SCRATCH_DIR), writable, per attempt
    attempt_dir: Path  # logs, spool, exit note, checkpoint request file
    env_dir: Path | None = None  # the job's environment (code.environment), read-only, first on the import path


def rank_paths(layout: ArtifactLayout, *, tenant: str, job_id: str, attempt: int, rank: int, dataset: str,
               code_dir: Path, working_dir: str | None, node_layout: ArtifactLayout | None = None,
               env_dir: Path | None = None) -> RankPaths:
    """The paths of one rank of user code (no I/O); its attempt directory under ``node_layout`` (this
    node's own files) when given, else under ``layout``."""
    attempt_dir = (node_layout or layout).attempt_dir(tenant, job_id, attempt)
    return RankPaths(
        code_dir=code_dir, cwd=code_dir / (working_dir or "."), datasets=(layout.dataset_ref_dir(dataset),),
        checkpoints=layout.checkpoints_dir(tenant, job_id), scratch=attempt_dir / "scratch" / f"rank-{rank}",
        attempt_dir=attempt_dir, env_dir=env_dir,
    )


def code_archive_path(layout: ArtifactLayout, tenant: str, hex_digest: str) -> Path:
    """``<artifact root>/tenants/<tenant>/code/sha256/<hex>.tar.gz``: where the API stored the archive."""
    return layout.code_archive(tenant, hex_digest)


def check_archive(data: bytes, hex_digest: str, where: Path) -> None:
    """CodeTreeError unless ``data`` is the archive ``sha256:<hex_digest>``."""
    got = hashlib.sha256(data).hexdigest()
    if got != hex_digest:
        raise CodeTreeError(f"the code archive at {where} is sha256:{got}, not the sha256:{hex_digest} the job "
                            "names (corrupted or replaced after upload): not running it; submit the code again")


# ----------------------------------------------------------------------------- the cache


CodeTree = Sealed


class CodeCache(SealedCache):
    """The node's code cache under ``root``; see the module docstring."""

    what = "code tree"

    def __init__(self, root: Path, layout: ArtifactLayout, *, max_bytes: int) -> None:
        super().__init__(root, max_bytes=max_bytes, counters=CacheCounters(TAMPERED, MATERIALISED, EVICTED, PURGED))
        self.layout = layout

    async def acquire(self, tenant: str, code: Code) -> CodeTree:
        """The verified tree of ``code.archive``, materialised if needed, pinned until :meth:`release`.

        CodeTreeError (a ConfigError: the job's fault) when the archive is missing, not the one named,
        or cannot be extracted."""
        if code.archive is None:
            raise CodeTreeError("code.archive is not set: the API resolves code.repo to an archive at submission")
        return await self.acquire_entry(archive_hex(code.archive), tenant)

    def build(self, staging_tree: Path, hex_digest: str, source: Any) -> dict[str, Any]:
        """Read the tenant's (``source``) archive, check it is the one named, extract it."""
        where = code_archive_path(self.layout, str(source), hex_digest)
        try:
            data = read_bytes(where)  # a file, or an object under an object-store root
        except FileNotFoundError:
            raise CodeTreeError(f"the code archive sha256:{hex_digest} is not in the artifact store ({where}): "
                                "upload it again (trainyard submit --code DIR)") from None
        except OSError as exc:
            raise CodeTreeError(f"cannot read the code archive {where}: {exc}") from exc
        check_archive(data, hex_digest, where)
        _extract(data, staging_tree)
        return {"archive": f"sha256:{hex_digest}"}


def _extract(data: bytes, dest: Path) -> TreeDigest:
    """:func:`extract`, with the node's own trouble (disk full, permissions) raised as the OSError it is:
    that is not the job's fault, unlike an archive that cannot be read."""
    try:
        return extract(data, dest)
    except CodeTreeError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError) and not isinstance(cause, FileExistsError):
            raise OSError(cause.errno, f"extracting into the code cache: {cause.strerror}", cause.filename) from exc
        raise


