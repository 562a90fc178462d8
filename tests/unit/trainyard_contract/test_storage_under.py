"""Writing and reading under the artifact root through directory handles, never through a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainyard_contract.storage import (
    UnsafePathError,
    commit_bytes_under,
    open_dir_under,
    remove_file_under,
    sha256_under,
    stat_size_under,
)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = tmp_path / "artifacts"
    mine = root / "tenants" / "evil" / "jobs" / "j1" / "checkpoints" / "step-000000040-a1"
    victim = root / "tenants" / "victim" / "jobs" / "v1" / "checkpoints" / "step-000000040-a1"
    for d in (mine, victim):
        d.mkdir(parents=True)
    (victim / "manifest.json").write_bytes(b"victim's")
    return root, mine, victim


def test_commit_writes_atomically_in_a_real_directory(tree: tuple[Path, Path, Path]) -> None:
    root, mine, _ = tree
    commit_bytes_under(root, mine / "manifest.json", b"{}")
    commit_bytes_under(root, mine / "manifest.json", b"{\"again\": 1}")
    assert (mine / "manifest.json").read_bytes() == b"{\"again\": 1}"
    assert sorted(p.name for p in mine.iterdir()) == ["manifest.json"]


def test_a_step_directory_swapped_for_a_link_is_refused_and_the_target_untouched(
        tree: tuple[Path, Path, Path]) -> None:
    root, mine, victim = tree
    os.rename(mine, mine.with_name("gone"))
    mine.symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        commit_bytes_under(root, mine / "manifest.json", b"attacker's")
    assert (victim / "manifest.json").read_bytes() == b"victim's"
    assert sorted(p.name for p in victim.iterdir()) == ["manifest.json"]


def test_a_link_higher_up_is_refused_too(tree: tuple[Path, Path, Path]) -> None:
    root, mine, victim = tree
    jobs = root / "tenants" / "evil" / "jobs"
    os.rename(jobs / "j1", jobs / "old")
    (jobs / "j1").symlink_to(victim.parents[2])  # tenants/victim/jobs/v1
    with pytest.raises(UnsafePathError):
        commit_bytes_under(root, jobs / "j1" / "checkpoints" / "step-000000040-a1" / "manifest.json", b"x")
    assert (victim / "manifest.json").read_bytes() == b"victim's"


def test_the_directory_is_never_created(tree: tuple[Path, Path, Path]) -> None:
    root, mine, _ = tree
    with pytest.raises(FileNotFoundError):
        commit_bytes_under(root, mine.with_name("step-000000080-a1") / "manifest.json", b"x")
    assert not mine.with_name("step-000000080-a1").exists()


def test_a_path_outside_the_root_is_refused(tree: tuple[Path, Path, Path], tmp_path: Path) -> None:
    root, _, _ = tree
    with pytest.raises(UnsafePathError, match="not under the artifact root"):
        commit_bytes_under(root, tmp_path / "elsewhere" / "manifest.json", b"x")
    with pytest.raises(UnsafePathError):
        open_dir_under(root, root / ".." / "x")


def test_a_manifest_name_that_is_a_link_is_replaced_not_followed(tree: tuple[Path, Path, Path]) -> None:
    root, mine, victim = tree
    (mine / "manifest.json").symlink_to(victim / "manifest.json")
    commit_bytes_under(root, mine / "manifest.json", b"mine")
    assert not (mine / "manifest.json").is_symlink() and (mine / "manifest.json").read_bytes() == b"mine"
    assert (victim / "manifest.json").read_bytes() == b"victim's"


def test_reads_refuse_links_fifos_and_report_missing_files(tree: tuple[Path, Path, Path]) -> None:
    root, mine, victim = tree
    (mine / "shard").write_bytes(b"abc")
    assert stat_size_under(root, mine / "shard") == 3
    assert sha256_under(root, mine / "shard") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert stat_size_under(root, mine / "missing") is None
    (mine / "link").symlink_to(victim / "manifest.json")
    os.mkfifo(mine / "fifo")
    for name in ("link", "fifo"):
        with pytest.raises(UnsafePathError):
            stat_size_under(root, mine / name)
    os.rename(mine, mine.with_name("gone"))
    mine.symlink_to(victim)
    with pytest.raises(UnsafePathError):
        sha256_under(root, mine / "manifest.json")


def test_remove_goes_through_the_same_handles(tree: tuple[Path, Path, Path]) -> None:
    root, mine, victim = tree
    (mine / "manifest.json").write_bytes(b"x")
    remove_file_under(root, mine / "manifest.json")
    remove_file_under(root, mine / "manifest.json")  # absent is fine
    assert not (mine / "manifest.json").exists()
    os.rename(mine, mine.with_name("gone"))
    mine.symlink_to(victim)
    with pytest.raises(UnsafePathError):
        remove_file_under(root, mine / "manifest.json")
    assert (victim / "manifest.json").exists()


def test_remove_tree_unlinks_a_swapped_step_directory_and_refuses_a_link_above(
        tree: tuple[Path, Path, Path]) -> None:
    from trainyard_contract.storage import remove_tree_under

    root, mine, victim = tree
    (mine / "__0_0.distcp").write_bytes(b"x")
    remove_tree_under(root, mine)
    assert not mine.exists()
    remove_tree_under(root, mine)  # absent is fine
    mine.symlink_to(victim, target_is_directory=True)  # the step directory swapped for a link
    remove_tree_under(root, mine)
    assert not mine.is_symlink() and (victim / "manifest.json").read_bytes() == b"victim's"
    jobs = root / "tenants" / "evil" / "jobs"
    os.rename(jobs / "j1", jobs / "old")
    (jobs / "j1").symlink_to(victim.parents[2], target_is_directory=True)  # the job directory swapped
    with pytest.raises(UnsafePathError):
        remove_tree_under(root, jobs / "j1" / "checkpoints" / "step-000000040-a1")
    assert (victim / "manifest.json").read_bytes() == b"victim's"
