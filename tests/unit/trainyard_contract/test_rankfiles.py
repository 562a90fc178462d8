"""trainyard_contract.rankfiles: a rank's file is read only if it is a small regular file, never by following
a link, never blocking on a FIFO."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from trainyard_contract.rankfiles import RankFileRefused, aread_rank_file, open_rank_file, read_rank_file


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    note = tmp_path / "rank-0.note.json"
    note.write_bytes(b'{"globalStep": 7}')
    assert read_rank_file(note, what="exit note") == b'{"globalStep": 7}'


def test_a_missing_file_is_none(tmp_path: Path) -> None:
    assert read_rank_file(tmp_path / "absent") is None
    assert open_rank_file(tmp_path / "absent") is None


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "rank-0.note.json"
    os.mkfifo(fifo)  # nobody writes to it: a plain open() would wait forever
    with pytest.raises(RankFileRefused, match=r"exit note refused: not a regular file \(a FIFO\)"):
        read_rank_file(fifo, what="exit note")


def test_a_symlink_to_dev_zero_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "rank-0.note.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(RankFileRefused, match="exit note refused: a symlink"):
        read_rank_file(link, what="exit note")


def test_a_symlink_to_a_regular_file_is_refused_too(tmp_path: Path) -> None:
    (tmp_path / "victim.json").write_text("{}")
    (tmp_path / "note").symlink_to(tmp_path / "victim.json")
    with pytest.raises(RankFileRefused, match="a symlink"):
        read_rank_file(tmp_path / "note")


def test_a_character_device_is_refused() -> None:
    with pytest.raises(RankFileRefused, match=r"not a regular file \(a character device\)"):
        read_rank_file("/dev/zero")


def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "note").mkdir()
    with pytest.raises(RankFileRefused, match="not a regular file"):
        read_rank_file(tmp_path / "note")


def test_a_huge_sparse_file_is_refused_unread(tmp_path: Path) -> None:
    huge = tmp_path / "note"
    with open(huge, "wb") as fh:
        fh.truncate(20 << 30)  # 20 GiB, sparse: costs no disk, would cost 20 GiB of memory to read
    with pytest.raises(RankFileRefused, match=r"too large \(21474836480 bytes; the limit is 1024\)"):
        read_rank_file(huge, limit=1024)


def test_the_async_read_runs_off_the_loop(tmp_path: Path) -> None:
    note = tmp_path / "note"
    note.write_bytes(b"x" * 10)
    assert asyncio.run(aread_rank_file(note, limit=10)) == b"x" * 10
    os.unlink(note)
    os.mkfifo(note)
    with pytest.raises(RankFileRefused):
        asyncio.run(aread_rank_file(note))
