"""Pure decisions of the checkpoint protocol: no Redis, Kafka, clock or filesystem here.

One checkpoint is identified by (job, attempt, global step). Every rank of the world
reports its shard once (``ShardWritten``); this module decides

* what one report is (:func:`classify_shard`): new, a duplicate, a conflicting re-report,
  or a zombie's (stale fencing epoch);
* what the set of reports amounts to (:func:`assess`): still waiting for ranks, rejected
  with reasons, or complete with the draft :class:`CheckpointManifest`;
* when a pending checkpoint has waited too long (:func:`is_expired`).

The I/O shell (``coordinator.py``) verifies the draft manifest against the files on disk
with :func:`trainyard_contract.manifest.verify_manifest` and applies the outcome.
"""

from __future__ import annotations

import enum
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_contract.events import (
    CheckpointFailed,
    CheckpointReady,
    CheckpointRefused,
    FileDigest,
    ShardWritten,
    TensorDigest,
)
from trainyard_contract.manifest import (
    CheckpointManifest,
    ParallelLayout,
    ShardEntry,
    conflicting_tensors,
    content_hash,
    tensor_order,
    tensors_hash,
)
from trainyard_contract.errors import CheckpointError
from trainyard_contract.records import CheckpointRecord, checkpoint_id

MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True, order=True)
class CheckpointKey:
    """(job, attempt, global step): one checkpoint of one attempt."""

    job_id: str
    attempt: int
    global_step: int

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id(self.global_step, self.attempt)

    def __str__(self) -> str:
        return f"{self.job_id}/{self.checkpoint_id}"


class ShardReport(BaseModel):
    """What one rank reported about its shard: the content of a ``ShardWritten``, without
    the envelope (event id, time), so a re-delivery compares equal to the original."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True, extra="ignore")

    tenant: str
    epoch: int
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    uri: str
    size_bytes: int = Field(ge=0)
    sha256: str
    extra_files: tuple[FileDigest, ...] = ()
    consumed_tokens: int = 0
    consumed_samples: int = 0
    spec_hash: str | None = None
    parallelism: tuple[tuple[str, int], ...] = ()
    tensors: tuple[TensorDigest, ...] | None = None  # None: the rank did not report its entries

    @classmethod
    def from_event(cls, event: ShardWritten) -> ShardReport:
        return cls(
            tenant=event.tenant,
            epoch=event.epoch,
            rank=event.rank,
            world_size=event.world_size,
            uri=event.uri,
            size_bytes=event.size_bytes,
            sha256=event.sha256,
            extra_files=tuple(sorted(event.extra_files, key=lambda f: f.uri)),
            consumed_tokens=event.consumed_tokens,
            consumed_samples=event.consumed_samples,
            spec_hash=event.spec_hash,
            parallelism=tuple(sorted(event.parallelism.items())),
            tensors=None if event.tensor_digests is None else tuple(sorted(event.tensor_digests, key=tensor_order)),
        )

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True)

    @classmethod
    def loads(cls, raw: str) -> ShardReport:
        return cls.model_validate_json(raw)


def checkpoint_key(event: ShardWritten) -> CheckpointKey:
    return CheckpointKey(event.job_id, event.attempt, event.global_step)


# --------------------------------------------------------------------------- one report


class ShardVerdict(enum.Enum):
    NEW = "new"
    DUPLICATE = "duplicate"  # same rank, same content: at-least-once delivery, harmless
    CONFLICT = "conflict"  # same rank, different content: the checkpoint cannot be trusted
    STALE = "stale"  # epoch older than the job's fencing epoch: a zombie attempt


def classify_shard(report: ShardReport, *, current_epoch: int, existing: ShardReport | None) -> ShardVerdict:
    """What one shard report is, given the job's fencing epoch and what this rank reported before."""
    if report.epoch < current_epoch:
        return ShardVerdict.STALE
    if existing is None:
        return ShardVerdict.NEW
    return ShardVerdict.DUPLICATE if existing == report else ShardVerdict.CONFLICT


def describe_conflict(old: ShardReport, new: ShardReport) -> str:
    """A sentence naming the fields in which a re-report differs from the first report."""
    fields = [
        name for name in ShardReport.model_fields if getattr(old, name) != getattr(new, name)
    ]
    return f"rank {new.rank} reported its shard twice with different content ({', '.join(fields)})"


# --------------------------------------------------------------------------- whose shard it is


class ShardRefused(CheckpointError):
    """A shard report the coordinator will not record (dead-lettered, never retried): ``security: …``."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"security: shard report refused: {reason}", retryable=False)
        self.reason = reason


def shard_refusal(report: ShardReport, key: CheckpointKey, *, job_tenant: str | None,
                  checkpoint_dir_uri: str | None) -> str | None:
    """Why a shard report is not the job's own, or None when it is.

    The job record (written by the API) is the authority, not the event: ``job_tenant`` is the record's
    tenant (None: no such job), ``checkpoint_dir_uri`` the URI of the record's checkpoint directory of
    this attempt and step (``tenants/<tenant>/jobs/<job>/checkpoints/step-<step>-a<attempt>``). The
    event's tenant must be the record's, and the shard and every extra file must be a plain file name
    directly in that directory, compared as normalised strings: no ``..`` or ``.`` segment, no
    percent-encoded separator, no other scheme, bucket, job or tenant, not the manifest itself. So a
    victim's ShardWritten re-published as another job, and a forged one for the victim's job naming
    another job's files, are both refused. (What is on disk behind the names is checked when the files
    are read: through directory handles, never through a link.)"""
    if job_tenant is None or checkpoint_dir_uri is None:
        return f"job {key.job_id!r} has no job record"
    if report.tenant != job_tenant:
        return f"the event's tenant {report.tenant!r} is not the tenant of job {key.job_id!r}"
    for what, uri in [("shard", report.uri)] + [("extra file", f.uri) for f in report.extra_files]:
        if problem := _outside(uri, checkpoint_dir_uri):
            return f"rank {report.rank}'s {what} {uri!r:.300} {problem} ({checkpoint_dir_uri})"
    return None


def _outside(uri: str, directory_uri: str) -> str | None:
    """Why ``uri`` is not a file directly in ``directory_uri``; None when it is."""
    if any(c in uri for c in ("\x00", "\\", "?", "#")):
        return "is not a plain file URI"
    parts, want = urlsplit(uri), urlsplit(directory_uri)
    if (parts.scheme, parts.netloc) != (want.scheme, want.netloc):
        return "is not in the job's checkpoint directory"
    path, base = unquote(parts.path), unquote(want.path).rstrip("/")
    if unquote(path) != path or "\x00" in path:
        return "is not a plain file URI"
    if any(segment in (".", "..") for segment in path.split("/")) or posixpath.normpath(path) != path:
        return "is not a normalised path"
    directory, name = posixpath.split(path)
    if directory != base:
        return "is not in the job's checkpoint directory"
    if name in ("", MANIFEST_NAME) or name.startswith(f".{MANIFEST_NAME}.tmp"):
        return "names the checkpoint's manifest"
    return None


# --------------------------------------------------------------------------- the set of reports


@dataclass(frozen=True)
class Waiting:
    """Not every rank has reported yet."""

    missing: tuple[int, ...]


@dataclass(frozen=True)
class Rejected:
    """The reports cannot form a consistent checkpoint."""

    problems: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)


@dataclass(frozen=True)
class Complete:
    """Every rank reported, consistently: the draft manifest, still to be verified on disk."""

    manifest: CheckpointManifest
    directory_uri: str

    @property
    def manifest_uri(self) -> str:
        return join_uri(self.directory_uri, MANIFEST_NAME)


Assessment = Waiting | Rejected | Complete


@dataclass(frozen=True)
class JobDefaults:
    """What the job's spec says, for fields a shard report may leave empty."""

    spec_hash: str | None = None
    parallelism: ParallelLayout | None = None


def assess(
    key: CheckpointKey,
    reports: Mapping[int, ShardReport],
    *,
    world_size: int,
    current_epoch: int,
    created_at: datetime,
    defaults: JobDefaults = JobDefaults(),
) -> Assessment:
    """Decide what the shard reports of one checkpoint amount to.

    ``world_size`` is what the checkpoint record expects (the first report's); a report
    that disagrees, a rank outside the world, reports from different epochs, specs or
    directories, or a set fenced by a newer epoch reject the checkpoint even before every
    rank has reported: waiting would not make it consistent.
    """
    problems = _consistency_problems(reports, world_size=world_size, current_epoch=current_epoch)
    if problems:
        return Rejected(tuple(problems))
    missing = tuple(r for r in range(world_size) if r not in reports)
    if missing:
        return Waiting(missing)
    directory = common_directory([r.uri for r in reports.values()])
    if directory is None:
        return Rejected(("the shards are not all in one checkpoint directory",))
    return Complete(build_manifest(key, reports, created_at=created_at, defaults=defaults), directory)


def _consistency_problems(
    reports: Mapping[int, ShardReport], *, world_size: int, current_epoch: int
) -> list[str]:
    problems: list[str] = []
    sizes = sorted({r.world_size for r in reports.values()})
    if sizes != [world_size] and reports:
        problems.append(f"shards disagree on the world size: {sizes}, expected {world_size}")
    outside = sorted(rank for rank in reports if rank >= world_size)
    if outside:
        problems.append(f"ranks {outside} are outside a world of {world_size}")
    epochs = sorted({r.epoch for r in reports.values()})
    if len(epochs) > 1:
        problems.append(f"shards come from different fencing epochs {epochs}")
    elif epochs and epochs[0] < current_epoch:
        problems.append(f"fenced: epoch {epochs[0]} is older than the job's current epoch {current_epoch}")
    tenants = sorted({r.tenant for r in reports.values()})
    if len(tenants) > 1:
        problems.append(f"shards disagree on the tenant: {tenants}")
    spec_hashes = sorted({r.spec_hash for r in reports.values() if r.spec_hash})
    if len(spec_hashes) > 1:
        problems.append(f"shards disagree on the spec hash: {spec_hashes}")
    problems.extend(_extra_file_conflicts(reports))
    if conflicts := conflicting_tensors(d for r in reports.values() for d in r.tensors or ()):
        shown = ", ".join(conflicts[:5]) + (f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else "")
        problems.append(f"ranks report different digests for the same saved entry: {shown}")
    return problems


def _extra_file_conflicts(reports: Mapping[int, ShardReport]) -> list[str]:
    seen: dict[str, FileDigest] = {}
    problems: list[str] = []
    for rank in sorted(reports):
        for digest in reports[rank].extra_files:
            first = seen.setdefault(digest.uri, digest)
            if first != digest:
                problems.append(f"ranks disagree on the shared file {digest.uri}")
    return problems


def build_manifest(
    key: CheckpointKey,
    reports: Mapping[int, ShardReport],
    *,
    created_at: datetime,
    defaults: JobDefaults = JobDefaults(),
) -> CheckpointManifest:
    """The draft manifest of a complete, consistent set of shard reports.

    Counters and layout come from rank 0 (every rank of a data-parallel step has seen the
    same global counts); shared files are the union of what the ranks reported.
    """
    ranks = sorted(reports)
    lead = reports[ranks[0]]
    shards = [
        ShardEntry(rank=r, uri=reports[r].uri, size_bytes=reports[r].size_bytes, sha256=reports[r].sha256)
        for r in ranks
    ]
    extra = {f.uri: f for r in ranks for f in reports[r].extra_files}
    extra_files = [extra[uri] for uri in sorted(extra)]
    tensors = combine_tensors(reports)
    return CheckpointManifest(
        job_id=key.job_id,
        tenant=lead.tenant,
        attempt=key.attempt,
        epoch=lead.epoch,
        global_step=key.global_step,
        world_size=lead.world_size,
        parallelism=parallel_layout(dict(lead.parallelism), lead.world_size, defaults.parallelism),
        consumed_tokens=lead.consumed_tokens,
        consumed_samples=lead.consumed_samples,
        spec_hash=lead.spec_hash or defaults.spec_hash,
        shards=shards,
        extra_files=extra_files,
        content_hash=content_hash(shards, extra_files),
        created_at=created_at,
        tensors=tensors or [],
        tensors_hash=None if tensors is None else tensors_hash(tensors),
    )


def combine_tensors(reports: Mapping[int, ShardReport]) -> list[TensorDigest] | None:
    """Every rank's entry digests as one list in canonical order (by key, then offset), an entry
    reported by two ranks once; None unless every rank reported its entries (a partial list would
    name a hash that no complete checkpoint has). Conflicting digests are refused by :func:`assess`."""
    if any(r.tensors is None for r in reports.values()):
        return None
    unique = {(d.key, tuple(d.offset)): d for r in reports.values() for d in r.tensors or ()}
    return sorted(unique.values(), key=tensor_order)


_AXES = {"dp": "dp", "data": "dp", "tp": "tp", "tensor": "tp", "pp": "pp", "pipeline": "pp"}


def parallel_layout(
    reported: Mapping[str, int], world_size: int, fallback: ParallelLayout | None = None
) -> ParallelLayout:
    """The {dp, tp, pp} layout from a shard's ``parallelism`` (either naming), else the spec's,
    else pure data parallelism over the whole world."""
    axes = {_AXES[k]: v for k, v in reported.items() if k in _AXES}
    if axes:
        return ParallelLayout(**axes)
    return fallback or ParallelLayout(dp=world_size)


# --------------------------------------------------------------------------- locations


def split_uri(uri: str) -> tuple[str, str]:
    """(directory URI, file name) of a file URI."""
    parts = urlsplit(uri)
    directory, name = posixpath.split(parts.path)
    return urlunsplit(parts._replace(path=directory)), name


def join_uri(directory_uri: str, name: str) -> str:
    parts = urlsplit(directory_uri)
    return urlunsplit(parts._replace(path=posixpath.join(parts.path, name)))


def common_directory(uris: list[str]) -> str | None:
    """The one directory every URI lives in, or None when they are spread out."""
    directories = {split_uri(u)[0] for u in uris}
    return directories.pop() if len(directories) == 1 else None


# --------------------------------------------------------------------------- time


def is_expired(created_at: datetime, *, now: datetime, timeout_s: float) -> bool:
    """Whether a checkpoint pending since ``created_at`` has waited longer than ``timeout_s``."""
    return (now - created_at).total_seconds() > timeout_s


def timeout_reason(missing: tuple[int, ...], timeout_s: float) -> str:
    ranks = ", ".join(str(r) for r in missing)
    return f"timed out after {timeout_s:g}s waiting for the shards of ranks [{ranks}]"


# --------------------------------------------------------------------------- record transitions


@dataclass(frozen=True)
class ShardTiming:
    """When the ranks wrote their shard reports, and the slowest rank's save time (if reported)."""

    first_at: datetime | None = None
    last_at: datetime | None = None
    write_seconds: float | None = None

    @classmethod
    def of(cls, reports: Mapping[int, tuple[datetime, float | None]]) -> ShardTiming:
        """From rank -> (report time, the rank's write seconds or None)."""
        if not reports:
            return cls()
        times = [at for at, _ in reports.values()]
        writes = [w for _, w in reports.values() if w is not None]
        return cls(min(times), max(times), max(writes) if writes else None)


def settle_ready(
    record: CheckpointRecord, complete: Complete, *, current_epoch: int, now: datetime,
    timing: ShardTiming = ShardTiming(),
) -> CheckpointRecord:
    """The record once its verified manifest is on disk: READY, or FAILED when a newer
    fencing epoch was granted meanwhile (a zombie attempt never produces READY)."""
    manifest = complete.manifest
    if manifest.epoch < current_epoch:
        return settle_failed(
            record, f"fenced: epoch {manifest.epoch} is older than the job's current epoch {current_epoch}"
        )
    return record.model_copy(
        update={
            "state": "READY",
            "manifest_uri": complete.manifest_uri,
            "content_hash": manifest.content_hash,
            "tensors_hash": manifest.tensors_hash,
            "consumed_tokens": manifest.consumed_tokens,
            "reason": None,
            "ready_at": now,
            "first_shard_at": timing.first_at,
            "last_shard_at": timing.last_at,
            "write_seconds": timing.write_seconds,
            "size_bytes": manifest.total_bytes(),
        }
    )


def settle_failed(record: CheckpointRecord, reason: str) -> CheckpointRecord:
    return record.model_copy(update={"state": "FAILED", "reason": reason})


REFUSED_PREFIX = "refused at restore by attempt"


def refusal_reason(event: CheckpointRefused) -> str:
    """``refused at restore by attempt N: <problems>``, the FAILED record's reason."""
    problems = "; ".join(event.problems) or "restore verification failed"
    return f"{REFUSED_PREFIX} {event.attempt}: {problems}"


def settle_refused(record: CheckpointRecord, event: CheckpointRefused) -> CheckpointRecord | None:
    """The record once a restoring attempt refused it: FAILED with the problems, or None when
    nothing changes (settled FAILED/DELETED already, or the refusal names another manifest)."""
    if record.state not in ("READY", "PENDING"):
        return None
    if record.manifest_uri is not None and record.manifest_uri != event.manifest_uri:
        return None
    return record.model_copy(update={"state": "FAILED", "reason": refusal_reason(event)})


def settled_event(record: CheckpointRecord, now: datetime) -> CheckpointReady | CheckpointFailed:
    """The event announcing a settled (READY or FAILED) checkpoint record, stamped ``now``."""
    if record.state == "READY":
        assert record.manifest_uri and record.content_hash, "a READY record names its manifest"
        return CheckpointReady(
            occurred_at=now,
            job_id=record.job_id,
            tenant=record.tenant,
            attempt=record.attempt,
            epoch=record.epoch,
            global_step=record.global_step,
            world_size=record.world_size,
            manifest_uri=record.manifest_uri,
            content_hash=record.content_hash,
            consumed_tokens=record.consumed_tokens,
            tensors_hash=record.tensors_hash,
        )
    return CheckpointFailed(
        occurred_at=now,
        job_id=record.job_id,
        tenant=record.tenant,
        attempt=record.attempt,
        global_step=record.global_step,
        reason=record.reason or "failed",
    )


def pending_record(key: CheckpointKey, first: ShardReport, *, now: datetime) -> CheckpointRecord:
    """The PENDING record a checkpoint gets with its first shard report."""
    return CheckpointRecord(
        job_id=key.job_id,
        tenant=first.tenant,
        attempt=key.attempt,
        epoch=first.epoch,
        global_step=key.global_step,
        world_size=first.world_size,
        consumed_tokens=first.consumed_tokens,
        created_at=now,
    )
