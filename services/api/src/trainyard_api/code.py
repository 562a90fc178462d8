"""Users' code, pinned by content: uploaded archives, and ``code.repo`` + ``code.revision`` at submission.

Pure parts: :func:`upload_problem` (does an upload name its own bytes, within the limit),
:func:`code_problems` (is the spec's archive one this tenant uploaded), :func:`pinned` (the spec with
the resolved commit and archive filled in), :func:`environment_pinned` (``code.environment`` with the sha256 of
the lock the archive holds, or why the lock is refused), :func:`is_remote`. The I/O: :class:`CodeStore` (the
tenant's archives under the artifact root, ``ArtifactLayout.code_archive``) and :class:`GitSource`
(git subprocesses with a timeout and no prompts). Both are synchronous; the routes and the job service
call them through ``asyncio.to_thread`` so hashing, extraction and git never block the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath

from trainyard_contract import codetree, lockfile
from trainyard_contract.errors import NotFoundError, SpecError
from trainyard_contract.events import utcnow
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout, commit_bytes, is_file, read_bytes

from trainyard_api.validation import FieldProblem


class ArchiveTooLargeError(SpecError):
    """An upload over the API's limit (answered 413, not 422)."""


@dataclass(frozen=True)
class ArchiveInfo:
    """What the API recorded of a stored archive."""

    archive: str
    size: int
    files: int
    uploaded_at: datetime

    def dumps(self) -> str:
        return json.dumps({"archive": self.archive, "size": self.size, "files": self.files,
                           "uploadedAt": self.uploaded_at.isoformat()})

    @classmethod
    def loads(cls, raw: str) -> ArchiveInfo:
        data = json.loads(raw)
        return cls(data["archive"], int(data["size"]), int(data["files"]),
                   datetime.fromisoformat(data["uploadedAt"]))


# ----------------------------------------------------------------------------- pure decisions


def too_large_message(size: int, limit: int) -> str:
    return (f"the code archive is {size} bytes; this API takes at most {limit} bytes "
            f"(TRAINYARD_API_MAX_CODE_BYTES): leave data, checkpoints and virtual environments out of the "
            "tree (.gitignore them) and read data from a trainyard dataset instead")


def upload_problem(archive: str, digest_hex: str, size: int, limit: int) -> SpecError | None:
    """Why an upload of ``size`` bytes hashing to ``digest_hex`` cannot be stored as ``archive``."""
    if size > limit:
        return ArchiveTooLargeError("body", too_large_message(size, limit))
    if archive != f"sha256:{digest_hex}":
        return SpecError("path.archive", f"the body's sha256 is sha256:{digest_hex}, not {archive}: the path "
                                         "names the archive by the sha256 of its bytes (re-pack and upload again)")
    return None


def code_problems(spec: TrainingSpec, *, archive_known: bool) -> list[FieldProblem]:
    """Problems of a spec's uploaded code (``code.archive`` without ``code.repo``)."""
    code = spec.code
    if code is None or code.repo is not None or code.archive is None or archive_known:
        return []
    return [FieldProblem("code.archive", f"no code archive {code.archive} was uploaded for this tenant: "
                                         "`trainyard submit --code DIR` uploads it (PUT /v1/code/{archive}) "
                                         "before submitting")]


def pinned(spec: TrainingSpec, *, commit: str, archive: str) -> TrainingSpec:
    """``spec`` naming exactly the tree that runs: ``code.commit`` and ``code.archive`` filled in."""
    assert spec.code is not None
    return spec.model_copy(update={"code": spec.code.model_copy(update={"commit": commit, "archive": archive})})


def lock_in_archive(data: bytes, path: str) -> bytes | str:
    """The bytes of the regular file ``path`` in the code archive ``data``, or why it cannot be the lock (missing,
    a link or anything but a regular file, too big). The archive was checked when it was stored."""
    import gzip
    import io
    import tarfile

    want = PurePosixPath(path)
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz, tarfile.open(fileobj=gz, mode="r|") as tar:
        for member in tar:
            if PurePosixPath(member.name) != want:
                continue
            if not member.isreg():
                kind = "a link" if member.issym() or member.islnk() else "not a regular file"
                return f"{path} is {kind} in the code tree: a lock must be a regular file"
            if member.size > lockfile.MAX_LOCK_BYTES:
                return f"{path} is {member.size} bytes; a lock may be at most {lockfile.MAX_LOCK_BYTES}"
            handle = tar.extractfile(member)
            return handle.read() if handle is not None else f"{path} cannot be read from the archive"
    return (f"{path} is not a file of the code tree {codetree.archive_id(data)[:19]}… (a path relative to the "
            "tree's top, e.g. requirements.txt)")


def environment_pinned(spec: TrainingSpec, lock: bytes | str) -> tuple[TrainingSpec, list[FieldProblem]]:
    """``spec`` with ``code.environment.sha256`` filled in from the lock's bytes, or the problems: the lock missing
    or refused (:mod:`trainyard_contract.lockfile`: no options, URLs or unpinned lines; never torch or the SDK), or a
    sha256 in the spec that is not the lock's."""
    assert spec.code is not None and spec.code.environment is not None
    env = spec.code.environment
    if isinstance(lock, str):
        return spec, [FieldProblem("code.environment.lock", lock)]
    try:
        lockfile.parse_lock(lock.decode(), env.lock)
    except UnicodeDecodeError:
        return spec, [FieldProblem("code.environment.lock", f"{env.lock} is not UTF-8 text")]
    except lockfile.LockError as exc:
        return spec, [FieldProblem("code.environment.lock", exc.message)]
    digest = codetree.archive_id(lock)
    if env.sha256 is not None and env.sha256 != digest:
        return spec, [FieldProblem("code.environment.sha256", f"{env.lock} in the code tree is {digest}, not "
                                                              f"{env.sha256}: leave code.environment.sha256 out, "
                                                              "the API fills it in")]
    code = spec.code.model_copy(update={"environment": env.model_copy(update={"sha256": digest})})
    return spec.model_copy(update={"code": code}), []


def resolution_problems(spec: TrainingSpec, *, commit: str, archive: str) -> list[FieldProblem]:
    """A repo spec that also names a commit or archive must name the ones its revision resolved to."""
    assert spec.code is not None
    problems = []
    if spec.code.commit is not None and spec.code.commit != commit:
        problems.append(FieldProblem("code.commit", f"{spec.code.repo} {spec.code.revision} is commit {commit}, "
                                                    f"not {spec.code.commit}: leave code.commit out, the API "
                                                    "fills it in"))
    if spec.code.archive is not None and spec.code.archive != archive:
        problems.append(FieldProblem("code.archive", f"{spec.code.repo} at {commit} archives to {archive}, not "
                                                     f"{spec.code.archive}: leave code.archive out with code.repo"))
    return problems


_SCP_LIKE = re.compile(r"^[\w.-]+@[\w.-]+:")


def is_remote(repo: str) -> bool:
    """A URL (``https://…``, ``file://…``, ``git@host:path``) rather than a path on the API's machine."""
    return "://" in repo or bool(_SCP_LIKE.match(repo))


def is_local(repo: str) -> bool:
    """A repository on the API's own machine: a path, or a ``file://`` URL."""
    return not is_remote(repo) or repo.lower().startswith("file:")


# ----------------------------------------------------------------------------- the tenant's archives


class CodeStore:
    """Code archives per tenant under the artifact root; an archive is written once, atomically (a rename
    locally, one PUT in an object store), then what the API recorded of it: that record, written last,
    makes the archive known."""

    def __init__(self, layout: ArtifactLayout, *, max_bytes: int = codetree.MAX_ARCHIVE_BYTES) -> None:
        self.layout = layout
        self.max_bytes = max_bytes

    def info(self, tenant: str, archive: str) -> ArchiveInfo | None:
        hex_digest = codetree.archive_hex(archive)
        meta = self.layout.code_archive_meta(tenant, hex_digest)
        if not is_file(meta) or not is_file(self.layout.code_archive(tenant, hex_digest)):
            return None
        return ArchiveInfo.loads(read_bytes(meta).decode())

    def put(self, tenant: str, archive: str, data: bytes, *, now: datetime) -> tuple[ArchiveInfo, bool]:
        """Check and store; (its info, whether this call stored it). Storing it again changes nothing."""
        if problem := upload_problem(archive, hashlib.sha256(data).hexdigest(), len(data), self.max_bytes):
            raise problem
        if (existing := self.info(tenant, archive)) is not None:
            return existing, False
        if too_many := codetree.count_entries(data):  # before writing any of them, even to a temporary directory
            raise SpecError("body", f"{too_many}; pack the tree with `trainyard submit --code DIR`")
        digest = readable(data, "body")
        hex_digest = codetree.archive_hex(archive)
        info = ArchiveInfo(archive, len(data), len(digest.files) + len(digest.links), now)
        commit_bytes(self.layout.code_archive(tenant, hex_digest), data)
        commit_bytes(self.layout.code_archive_meta(tenant, hex_digest), info.dumps().encode())
        return info, True


def readable(data: bytes, field: str) -> codetree.TreeDigest:
    """The digest of the tree ``data`` unpacks to (SpecError naming ``field`` if it does not unpack safely)."""
    with tempfile.TemporaryDirectory(prefix="trainyard-code-") as tmp:
        try:
            return codetree.extract(data, Path(tmp) / "tree")
        except codetree.CodeTreeError as exc:
            raise SpecError(field, f"{exc.message}; pack the tree with `trainyard submit --code DIR`") from exc


# ----------------------------------------------------------------------------- git


_GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",  # never ask for a password: fail instead
    "GIT_ASKPASS": "true",
    "SSH_ASKPASS": "true",
    "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new",
    "GIT_CONFIG_NOSYSTEM": "1",
}


@dataclass(frozen=True)
class Resolved:
    """A revision resolved: its full commit, and the deterministic archive of that commit's tree."""

    commit: str
    archive: str
    data: bytes


class GitSource:
    """Resolve ``repo`` + ``revision`` to a commit and archive its tree, with git and a timeout."""

    def __init__(self, *, timeout_s: float = 60.0, max_bytes: int = codetree.MAX_ARCHIVE_BYTES,
                 local_repos: bool = True) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.local_repos = local_repos
        # ext:: runs a command, so it is never allowed; file:// only where local repositories are
        protocols = "file:git:http:https:ssh" if local_repos else "git:http:https:ssh"
        self._env = {**os.environ, **_GIT_ENV, "GIT_ALLOW_PROTOCOL": protocols}

    def resolve(self, repo: str, revision: str) -> Resolved:
        """SpecError naming ``code.repo`` (unreachable, not a repository) or ``code.revision`` (no such one)."""
        for field, value in (("code.repo", repo), ("code.revision", revision)):
            if value.startswith("-"):
                raise SpecError(field, f"{value!r} must not start with '-'")
        if not self.local_repos and is_local(repo):
            raise SpecError("code.repo", f"{repo!r}: this API takes only git URLs (https://, ssh://, git@host:…), "
                                         "not repositories on its own machine (TRAINYARD_API_GIT_LOCAL_REPOS)")
        with tempfile.TemporaryDirectory(prefix="trainyard-git-") as tmp:
            if is_remote(repo):
                commit = self._remote_commit(repo, revision)
                workdir = Path(tmp) / "repo"
                self._git(["init", "-q", "--bare", str(workdir)], field="code.repo")
                self._git(["-C", str(workdir), "fetch", "-q", "--depth", "1", "--", repo, commit],
                          field="code.revision", what=f"cannot fetch commit {commit} of {repo}")
                source = str(workdir)
            else:
                source = self._local_repo(repo)
                commit = self._local_commit(source, revision)
            tarball = self._git(["-C", source, "archive", "--format=tar.gz", commit], field="code.repo",
                                what=f"cannot archive {commit} of {repo}")
            data = self._repack(tarball, Path(tmp) / "tree", f"{repo} at {commit}")
        return Resolved(commit, codetree.archive_id(data), data)

    def _remote_commit(self, repo: str, revision: str) -> str:
        out = self._git(["ls-remote", "--", repo], field="code.repo", what=f"cannot reach {repo}").decode()
        refs: dict[str, str] = {}
        for line in out.splitlines():
            sha, _, name = line.partition("\t")
            refs[name] = sha
        for name in (f"{revision}^{{}}", f"refs/tags/{revision}^{{}}", revision, f"refs/heads/{revision}",
                     f"refs/tags/{revision}"):
            if name in refs:
                return refs[name]
        if re.fullmatch(r"[0-9a-f]{40}", revision):
            return revision  # a full commit: the fetch says whether the repository has it
        raise SpecError("code.revision", f"{repo} has no branch or tag {revision!r} (give a branch, a tag or a "
                                         "full 40-hex commit)")

    def _local_repo(self, repo: str) -> str:
        path = Path(repo)
        if not path.is_absolute():
            raise SpecError("code.repo", f"{repo!r} is neither a URL nor an absolute path on the API's machine")
        if not path.is_dir():
            raise SpecError("code.repo", f"no directory {repo} on the API's machine")
        self._git(["-C", repo, "rev-parse", "--git-dir"], field="code.repo", what=f"{repo} is not a git repository")
        return repo

    def _local_commit(self, repo: str, revision: str) -> str:
        out = self._git(["-C", repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{revision}^{{commit}}"],
                        field="code.revision", what=f"{repo} has no commit, branch or tag {revision!r}")
        return out.decode().strip()

    def _repack(self, tarball: bytes, tree: Path, what: str) -> bytes:
        """git's archive → codetree's deterministic one (the same tree always gets the same address)."""
        try:
            digest = codetree.extract(tarball, tree)
            return codetree.pack(tree, [*digest.files, *digest.links], max_bytes=self.max_bytes)
        except codetree.CodeTreeError as exc:
            raise SpecError("code.repo", f"{what}: {exc.message}") from exc

    def _git(self, args: list[str], *, field: str, what: str | None = None) -> bytes:
        try:
            done = subprocess.run(["git", *args], capture_output=True, timeout=self.timeout_s, env=self._env,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SpecError(field, f"{what or 'git'}: git took longer than {self.timeout_s:.0f} s "
                                   "(TRAINYARD_API_GIT_TIMEOUT_S)") from exc
        except OSError as exc:
            raise SpecError(field, f"{what or 'git'}: cannot run git on the API's machine ({exc})") from exc
        if done.returncode != 0:
            reason = done.stderr.decode(errors="replace").strip().splitlines()
            tail = f" ({reason[-1][:300]})" if reason else ""
            raise SpecError(field, f"{what or 'git ' + args[0] + ' failed'}{tail}")
        return done.stdout


# ----------------------------------------------------------------------------- the async shell


class CodeService:
    """What the routes and the submission do with code, off the event loop."""

    def __init__(self, store: CodeStore, git: GitSource, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.git = git
        self.clock = clock

    async def upload(self, tenant: str, archive: str, data: bytes) -> tuple[ArchiveInfo, bool]:
        return await asyncio.to_thread(self.store.put, tenant, archive, data, now=self.clock())

    async def info(self, tenant: str, archive: str) -> ArchiveInfo:
        info = await asyncio.to_thread(self.store.info, tenant, archive)
        if info is None:
            raise NotFoundError(f"no code archive {archive} for tenant {tenant!r}; upload it with PUT")
        return info

    async def pin(self, spec: TrainingSpec, tenant: str) -> tuple[TrainingSpec, list[FieldProblem]]:
        """The spec as it will be stored (code.repo resolved to its commit and archive), or its code problems."""
        code = spec.code
        if code is None:
            return spec, []
        if code.repo is None:
            assert code.archive is not None  # Code's validator: archive or repo
            known = await asyncio.to_thread(self.store.info, tenant, code.archive) is not None
            if problems := code_problems(spec, archive_known=known):
                return spec, problems
            return await self.pin_environment(spec, tenant)
        assert code.revision is not None
        try:
            resolved = await asyncio.to_thread(self.git.resolve, code.repo, code.revision)
        except SpecError as exc:
            return spec, [FieldProblem(exc.field, exc.detail)]
        if problems := resolution_problems(spec, commit=resolved.commit, archive=resolved.archive):
            return spec, problems
        try:
            await asyncio.to_thread(self.store.put, tenant, resolved.archive, resolved.data, now=self.clock())
        except SpecError as exc:  # over the limit, or a tree codetree will not unpack
            return spec, [FieldProblem("code.repo", f"{code.repo} at {resolved.commit}: {exc.detail}")]
        return await self.pin_environment(pinned(spec, commit=resolved.commit, archive=resolved.archive), tenant)

    async def pin_environment(self, spec: TrainingSpec, tenant: str) -> tuple[TrainingSpec, list[FieldProblem]]:
        """``code.environment`` pinned to the sha256 of the lock in the (stored) archive, or why it cannot be."""
        assert spec.code is not None and spec.code.archive is not None
        if spec.code.environment is None:
            return spec, []
        where = self.store.layout.code_archive(tenant, codetree.archive_hex(spec.code.archive))
        data = await asyncio.to_thread(read_bytes, where)
        lock = await asyncio.to_thread(lock_in_archive, data, spec.code.environment.lock)
        return environment_pinned(spec, lock)
