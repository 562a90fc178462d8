"""Which files `trainyard submit --code DIR` packs (in git and outside, .gitignore honoured), the size
error, and the spec's code section."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from trainyard_cli import codepack
from trainyard_contract import codetree
from trainyard_contract.errors import ConfigError

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env={**GIT_ENV, "HOME": str(root)}).stdout.strip()


PROJECT = {
    "train.py": "print(1)\n",
    "pkg/model.py": "W = 1\n",
    "pkg/data/shard.bin": "big",
    "pkg/keep.log": "kept by a negation",
    "notes.log": "ignored",
    "checkpoints/step-1.pt": "ignored",
    ".gitignore": "*.log\ncheckpoints/\n",
    "pkg/.gitignore": "data/\n!keep.log\n",
    ".venv/lib/site.py": "never packed",
    "pkg/__pycache__/model.cpython-311.pyc": "never packed",
    ".trainyard/dev-token": "never packed",
}
EXPECTED = ["pkg/.gitignore", "pkg/keep.log", "pkg/model.py", "train.py", ".gitignore"]


def test_outside_git_every_gitignore_on_the_way_is_honoured(tmp_path: Path) -> None:
    write(tmp_path, PROJECT)
    selection = codepack.select(tmp_path)
    assert sorted(selection.files) == sorted(EXPECTED)
    assert selection.commit is None and selection.dirty is None


def test_in_git_ls_files_decides_and_the_commit_and_dirty_state_are_recorded(tmp_path: Path) -> None:
    write(tmp_path, PROJECT)
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = git(tmp_path, "rev-parse", "HEAD")
    clean = codepack.select(tmp_path)
    assert sorted(clean.files) == sorted(EXPECTED) and (clean.commit, clean.dirty) == (head, False)

    (tmp_path / "new.py").write_text("untracked, not ignored\n")
    (tmp_path / "more.log").write_text("ignored\n")
    (tmp_path / "pkg" / "model.py").unlink()  # tracked, deleted: nothing to pack
    dirty = codepack.select(tmp_path)
    assert sorted(dirty.files) == sorted({*EXPECTED, "new.py"} - {"pkg/model.py"})
    assert (dirty.commit, dirty.dirty) == (head, True)

    sub = codepack.select(tmp_path / "pkg")  # a directory of a checkout: its files, relative to it
    assert sorted(sub.files) == [".gitignore", "keep.log"] and sub.commit == head


def test_a_git_checkout_without_commits_has_no_commit(tmp_path: Path) -> None:
    write(tmp_path, {"train.py": "x"})
    git(tmp_path, "init", "-q")
    selection = codepack.select(tmp_path)
    assert selection.files == ("train.py",) and selection.commit is None and selection.dirty is True


def test_the_selection_packs_to_the_same_archive_in_and_outside_git(tmp_path: Path) -> None:
    write(tmp_path / "plain", PROJECT)
    write(tmp_path / "repo", PROJECT)
    git(tmp_path / "repo", "init", "-q")
    assert codepack.pack(codepack.select(tmp_path / "plain")) == codepack.pack(codepack.select(tmp_path / "repo"))


def test_a_tree_over_the_limit_is_refused_naming_its_largest_files(tmp_path: Path) -> None:
    write(tmp_path, {"train.py": "x"})
    for i, size in enumerate((40_000, 30_000, 20_000, 10_000, 5_000, 1_000)):
        (tmp_path / f"blob{i}.bin").write_bytes(os.urandom(size))
    with pytest.raises(codepack.CodeTooLargeError) as caught:
        codepack.pack(codepack.select(tmp_path), max_bytes=50_000)
    message = caught.value.message
    assert "blob0.bin" in message and "blob4.bin" in message and "blob5.bin" not in message
    assert ".gitignore" in message
    with pytest.raises(ConfigError, match="no files"):
        codepack.pack(codepack.Selection(tmp_path, ()))


def test_the_spec_names_the_archive_commit_dirty_state_and_entrypoint(tmp_path: Path) -> None:
    selection = codepack.Selection(tmp_path, ("train.py",), commit="a" * 40, dirty=True)
    spec = {"specVersion": "v1", "code": {"entrypoint": ["python", "old.py"], "env": {"A": "1"}}}
    archive = "sha256:" + "b" * 64
    code = codepack.with_code(spec, archive=archive, selection=selection,
                              entrypoint="python train.py --lr 3e-4")["code"]
    assert code == {"archive": archive, "commit": "a" * 40, "dirty": True, "env": {"A": "1"},
                    "entrypoint": ["python", "train.py", "--lr", "3e-4"]}
    kept = codepack.with_code(spec, archive=archive, selection=codepack.Selection(tmp_path, ("t",)), entrypoint=None)
    assert kept["code"] == {"archive": archive, "env": {"A": "1"}, "entrypoint": ["python", "old.py"]}
    with pytest.raises(ConfigError, match="no entrypoint"):
        codepack.with_code({"specVersion": "v1"}, archive=archive, selection=selection, entrypoint=None)
    with pytest.raises(ConfigError, match="code.repo"):
        codepack.with_code({"code": {"repo": "r", "revision": "main"}}, archive=archive, selection=selection,
                           entrypoint="python t.py")
    with pytest.raises(ConfigError, match="empty"):
        codepack.command("  ")
    assert codetree.ALWAYS_EXCLUDED  # the list the selection leaves out
