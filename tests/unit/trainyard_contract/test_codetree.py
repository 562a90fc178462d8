"""Code archives: the same tree packs to the same bytes; extraction refuses what could escape or surprise;
a materialised tree that changed is detected; limits hold."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from trainyard_contract import codetree
from trainyard_contract.codetree import CodeTreeError


def make_tree(root: Path) -> list[str]:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "pkg" / "model.py").write_text("W = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    os.symlink("pkg/model.py", root / "model.py")
    return ["train.py", "pkg/model.py", "run.sh", "model.py"]


def tar_gz(*members: tarfile.TarInfo, data: bytes = b"x") -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for member in members:
            if member.isreg():
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
            else:
                tar.addfile(member)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def test_the_same_tree_packs_to_the_same_bytes_whoever_packs_it_and_when(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "a")
    first = codetree.pack(tmp_path / "a", files)
    # another copy, other mtimes and permissions beyond the executable bit, files listed in another order
    make_tree(tmp_path / "b")
    os.utime(tmp_path / "b" / "train.py", (1, 1))
    (tmp_path / "b" / "train.py").chmod(0o600)
    second = codetree.pack(tmp_path / "b", list(reversed(files)))
    assert first == second
    assert codetree.archive_id(first) == codetree.archive_id(second)
    assert codetree.archive_id(first).startswith("sha256:")
    assert len(codetree.archive_hex(codetree.archive_id(first))) == 64
    (tmp_path / "b" / "train.py").write_text("print('changed')\n")
    assert codetree.pack(tmp_path / "b", files) != first  # another tree, another address


def test_extract_restores_files_modes_and_in_tree_links(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src")
    digest = codetree.extract(codetree.pack(tmp_path / "src", files), tmp_path / "out")
    assert set(digest.files) == {"train.py", "pkg/model.py", "run.sh"} and digest.links == {"model.py": "pkg/model.py"}
    assert os.access(tmp_path / "out" / "run.sh", os.X_OK) and not os.access(tmp_path / "out" / "train.py", os.X_OK)
    assert (tmp_path / "out" / "model.py").read_text() == "W = 1\n"
    assert codetree.verify_tree(tmp_path / "out", digest) == []
    assert codetree.TreeDigest.loads(digest.dumps()) == digest


def test_a_tampered_tree_is_detected(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src")
    out = tmp_path / "out"
    digest = codetree.extract(codetree.pack(tmp_path / "src", files), out)
    (out / "train.py").write_text("import os; os.system('evil')\n")
    (out / "extra.py").write_text("")
    (out / "pkg" / "model.py").unlink()
    (out / "model.py").unlink()
    os.symlink("/etc/passwd", out / "model.py")
    assert codetree.verify_tree(out, digest) == [
        "extra.py: added", "pkg/model.py: missing", "train.py: changed", "model.py: symlink changed"]


@pytest.mark.parametrize("target", ["/etc/passwd", "../../outside", "../pkg/../../outside"])
def test_packing_refuses_a_symlink_out_of_the_tree(tmp_path: Path, target: str) -> None:
    (tmp_path / "pkg").mkdir()
    os.symlink(target, tmp_path / "pkg" / "link")
    with pytest.raises(CodeTreeError, match="outside the code tree"):
        codetree.pack(tmp_path, ["pkg/link"])


@pytest.mark.parametrize("name", ["../escape.py", "/abs/path.py", "a/../../b.py"])
def test_packing_refuses_paths_outside_the_tree(tmp_path: Path, name: str) -> None:
    with pytest.raises(CodeTreeError, match="not a path inside the code tree"):
        codetree.pack(tmp_path, [name])


@pytest.mark.parametrize("bad, message", [
    (member("../escape.py"), "not a path inside the code tree"),
    (member("/etc/cron.d/x"), "not a path inside the code tree"),
    (member("link", tarfile.SYMTYPE, "../../etc/passwd"), "outside the code tree"),
    (member("link", tarfile.SYMTYPE, "/etc/passwd"), "outside the code tree"),
    (member("hard", tarfile.LNKTYPE, "train.py"), "not a regular file"),
    (member("dev", tarfile.CHRTYPE), "not a regular file"),
    (member("fifo", tarfile.FIFOTYPE), "not a regular file"),
])
def test_extraction_refuses_what_could_escape_or_surprise(tmp_path: Path, bad: tarfile.TarInfo, message: str) -> None:
    with pytest.raises(CodeTreeError, match=message):
        codetree.extract(tar_gz(member("train.py"), bad), tmp_path / "out")
    assert not (tmp_path / "escape.py").exists()


def test_extraction_refuses_a_file_twice_and_what_is_not_an_archive(tmp_path: Path) -> None:
    with pytest.raises(CodeTreeError, match="twice"):
        codetree.extract(tar_gz(member("a.py"), member("a.py")), tmp_path / "one")
    with pytest.raises(CodeTreeError, match="not a readable code archive"):
        codetree.extract(b"garbage", tmp_path / "two")
    with pytest.raises(CodeTreeError, match="not a readable code archive"):
        codetree.extract(gzip.compress(b"not a tar"), tmp_path / "three")


def test_limits_hold_when_packing_and_extracting(tmp_path: Path) -> None:
    (tmp_path / "big.bin").write_bytes(os.urandom(64 * 1024))  # random bytes do not compress
    with pytest.raises(CodeTreeError, match="the limit is"):
        codetree.pack(tmp_path, ["big.bin"], max_bytes=16 * 1024)
    data = codetree.pack(tmp_path, ["big.bin"])
    with pytest.raises(CodeTreeError, match="expands past"):
        codetree.extract(data, tmp_path / "out", max_tree_bytes=1024)


@pytest.mark.parametrize("address", ["sha256:" + "A" * 64, "sha256:abc", "md5:" + "0" * 64, "0" * 64])
def test_only_sha256_addresses_are_archive_ids(address: str) -> None:
    with pytest.raises(CodeTreeError):
        codetree.archive_hex(address)
