"""Code trees pinned by content: deterministic ``.tar.gz`` archives, their address, and a safe,
verified extraction. Pure functions over bytes and paths (no network, no Redis).

* :func:`pack` makes the same bytes from the same files, whoever packs them and when (sorted
  entries, mtime 0, owner 0, modes 0644/0755, gzip without a timestamp), so the archive's sha256
  (:func:`archive_id`) names the tree.
* :func:`extract` refuses anything that could escape its directory or surprise a reader
  (absolute paths, ``..``, links out of the tree, devices, fifos, hard links) and returns the
  :class:`TreeDigest` of what it wrote; :func:`verify_tree` checks a materialised tree against
  that digest before every run (a tampered cache entry is re-materialised, never run).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trainyard_contract.errors import ConfigError

#: Default limit of an archive (compressed) and of the tree it expands to.
MAX_ARCHIVE_BYTES = 100 * 1024 * 1024
MAX_TREE_BYTES = 1024 * 1024 * 1024
#: Files and symlinks a tree may hold: refused when packing, and by :func:`extract` (the API at upload, the node
#: agent at extraction), which also allows no more directory entries than this.
MAX_FILES = 50_000
#: Never packed, whatever .gitignore says (they are machine-local or rebuilt on import).
ALWAYS_EXCLUDED = (".git", "__pycache__", ".trainyard", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache")


class CodeTreeError(ConfigError):
    """An archive or tree that cannot be packed, extracted or trusted (the message says why)."""


def archive_id(data: bytes) -> str:
    """``sha256:<hex>`` of the archive bytes: the content address ``code.archive`` names."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def archive_hex(archive: str) -> str:
    """``sha256:<hex>`` → ``<hex>`` (CodeTreeError if it is not one)."""
    prefix, _, digest = archive.partition(":")
    if prefix != "sha256" or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CodeTreeError(f"not a code archive address (sha256:<64 hex digits>): {archive!r}")
    return digest


# ----------------------------------------------------------------------------- packing


def pack(root: Path, files: Iterable[str], *, max_bytes: int = MAX_ARCHIVE_BYTES) -> bytes:
    """The deterministic ``.tar.gz`` of ``files`` (POSIX paths relative to ``root``).

    Regular files keep only their executable bit; a symlink is kept when it points inside the
    tree (relative), otherwise packing fails. CodeTreeError past ``max_bytes`` (compressed).
    """
    names = sorted({_clean(name) for name in files})
    if len(names) > MAX_FILES:
        raise CodeTreeError(f"{len(names)} files to pack; the limit is {MAX_FILES} (add a .gitignore?)")
    buffer = io.BytesIO()
    # gzip with mtime 0 and no file name: the same tree packs to the same bytes
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            path = root / name
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                if not _inside(PurePosixPath(name).parent, target):
                    raise CodeTreeError(f"{name} is a symlink to {target}, outside the code tree")
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                info.size = st.st_size
                info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                raise CodeTreeError(f"{name} is not a regular file or symlink")
            if buffer.tell() > max_bytes:
                raise CodeTreeError(_too_big(buffer.tell(), max_bytes))
    data = buffer.getvalue()
    if len(data) > max_bytes:
        raise CodeTreeError(_too_big(len(data), max_bytes))
    return data


def _too_big(size: int, limit: int) -> str:
    return (f"the code archive is over {size / 2**20:.1f} MiB, the limit is {limit / 2**20:.0f} MiB: "
            "leave data, checkpoints and virtual environments out (.gitignore) and read data from a "
            "trainyard dataset instead")


def _clean(name: str) -> str:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise CodeTreeError(f"{name!r} is not a path inside the code tree")
    return path.as_posix()


def _inside(directory: PurePosixPath, target: str) -> bool:
    """Whether a symlink in ``directory`` (relative to the tree root) pointing at ``target`` stays inside."""
    if target.startswith("/"):
        return False
    depth = len(directory.parts)
    for part in PurePosixPath(target).parts:
        depth += -1 if part == ".." else (0 if part == "." else 1)
        if depth < 0:
            return False
    return True


# ----------------------------------------------------------------------------- extraction and verification


@dataclass(frozen=True)
class TreeDigest:
    """What a tree holds: path → sha256 of each regular file, path → target of each symlink."""

    files: Mapping[str, str]
    links: Mapping[str, str]

    def dumps(self) -> str:
        return json.dumps({"files": dict(sorted(self.files.items())), "links": dict(sorted(self.links.items()))})

    @classmethod
    def loads(cls, raw: str) -> TreeDigest:
        data = json.loads(raw)
        return cls(dict(data["files"]), dict(data["links"]))


def too_many_files(count: int, limit: int = MAX_FILES, *, what: str = "files and symlinks") -> str:
    """Why an archive past the entry limit is refused (``count`` is how far reading got: at least that many)."""
    return (f"the code archive holds at least {count} {what}, the limit is {limit}: leave data, checkpoints and "
            "virtual environments out (.gitignore) and read data from a trainyard dataset instead")


def count_entries(data: bytes, *, max_files: int = MAX_FILES, max_tree_bytes: int = MAX_TREE_BYTES) -> str | None:
    """Why the archive holds too many entries (with their count), or None; reads member headers only, writes
    nothing. Counting stops at ten times the limit, and where the members' declared sizes pass ``max_tree_bytes``
    (None then: :func:`extract` refuses that archive with its own reason)."""
    entries = directories = total = 0
    stop = 10 * max_files
    with contextlib.suppress(tarfile.TarError, EOFError, gzip.BadGzipFile, OSError), \
            tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            if member.isdir():
                directories += 1
            else:
                entries += 1
                total += member.size if member.isreg() else 0
            if total > max_tree_bytes or entries > stop or directories > stop:
                break
    for count, what in ((entries, "files and symlinks"), (directories, "directory entries")):
        if count > max_files:
            return (f"the code archive holds {'more than ' if count > stop else ''}{min(count, stop)} {what}, "
                    f"the limit is {max_files}: leave data, checkpoints and virtual environments out "
                    "(.gitignore) and read data from a trainyard dataset instead")
    return None


def extract(data: bytes, dest: Path, *, max_tree_bytes: int = MAX_TREE_BYTES,
            max_files: int = MAX_FILES) -> TreeDigest:
    """Unpack archive bytes into the empty or new directory ``dest``; returns its digest.

    CodeTreeError on a member that is not a plain file, directory or in-tree relative symlink,
    on a path outside ``dest``, past ``max_tree_bytes`` uncompressed, or at the member past ``max_files``
    files and symlinks (or directory entries): reading stops there, nothing more is written."""
    dest.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    total = 0
    entries = directories = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                if member.isdir():
                    directories += 1
                    if directories > max_files:
                        raise CodeTreeError(too_many_files(directories, max_files, what="directory entries"))
                else:
                    entries += 1
                    if entries > max_files:
                        raise CodeTreeError(too_many_files(entries, max_files))
                name = _clean(member.name)
                target = dest / name
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if member.issym():
                    if not _inside(PurePosixPath(name).parent, member.linkname):
                        raise CodeTreeError(f"{name} links to {member.linkname}, outside the code tree")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(member.linkname, target)
                    links[name] = member.linkname
                    continue
                if not member.isreg():
                    raise CodeTreeError(f"{name} is not a regular file, directory or symlink")
                total += member.size
                if total > max_tree_bytes:
                    raise CodeTreeError(f"the code tree expands past {max_tree_bytes / 2**20:.0f} MiB")
                source = tar.extractfile(member)
                assert source is not None
                target.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with open(target, "xb") as out:
                    for chunk in iter(functools.partial(source.read, 1 << 20), b""):
                        digest.update(chunk)
                        out.write(chunk)
                os.chmod(target, 0o755 if member.mode & 0o100 else 0o644)
                files[name] = digest.hexdigest()
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, FileExistsError):
            raise CodeTreeError(f"the archive holds {exc.filename} twice") from exc
        raise CodeTreeError(f"not a readable code archive: {exc}") from exc
    return TreeDigest(files, links)


def digest_tree(root: Path) -> TreeDigest:
    """The digest of what is under ``root`` now (files hashed, symlinks read, directories walked)."""
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    for directory, dirnames, filenames in os.walk(root):
        base = Path(directory)
        for name in list(dirnames):
            if (base / name).is_symlink():  # os.walk lists a symlink to a directory as a directory
                dirnames.remove(name)
                filenames.append(name)
        for name in filenames:
            path = base / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                links[rel] = os.readlink(path)
            elif path.is_file():
                files[rel] = _sha256_file(path)
            else:
                files[rel] = "<not a regular file>"
    return TreeDigest(files, links)


def verify_tree(root: Path, expected: TreeDigest) -> list[str]:
    """Differences between the tree under ``root`` and its digest (empty: it is intact)."""
    actual = digest_tree(root)
    problems = []
    for name in sorted(set(expected.files) | set(actual.files)):
        want, got = expected.files.get(name), actual.files.get(name)
        if want != got:
            problems.append(f"{name}: " + ("missing" if got is None else "added" if want is None else "changed"))
    for name in sorted(set(expected.links) | set(actual.links)):
        if expected.links.get(name) != actual.links.get(name):
            problems.append(f"{name}: symlink changed")
    return problems


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
