"""The rank → node-agent spool keeps every complete line exactly once across reads."""

from __future__ import annotations

from pathlib import Path

from trainyard_contract.events import StepMetrics
from trainyard_contract.spool import SpoolReader, SpoolWriter


def test_reader_resumes_from_offset_and_skips_partial_lines(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    with SpoolWriter(path) as w:
        for step in (1, 2):
            w.write(StepMetrics(job_id="j", attempt=1, rank=0, step=step, loss=1.0, consumed_tokens=step),
                    traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    with open(path, "a") as fh:
        fh.write('{"topic": "partial')  # a rank killed mid-write
    reader = SpoolReader(path)
    got = list(reader.read_new())
    assert [r["payload"]["step"] for _, r in got] == [1, 2]
    assert got[0][1]["traceparent"].startswith("00-111")
    reader.offset = got[-1][0]
    assert list(reader.read_new()) == []
    with open(path, "a") as fh:
        fh.write('", "payload": {}}\n')
    tail = list(SpoolReader(path, reader.offset).read_new())
    assert len(tail) == 1 and tail[0][1]["topic"] == "partial"


def test_missing_file_reads_nothing(tmp_path: Path) -> None:
    assert list(SpoolReader(tmp_path / "none.jsonl").read_new()) == []


def test_an_over_long_line_is_refused_and_skipped_however_long_it_grows(tmp_path: Path, monkeypatch) -> None:
    from trainyard_contract import spool

    monkeypatch.setattr(spool, "MAX_LINE_BYTES", 100)
    monkeypatch.setattr(spool, "READ_BYTES", 400)
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(b'{"a": 1}\n' + b"x" * 150 + b"\n" + b"y" * 900)  # one too long, one too long and unfinished
    reader = SpoolReader(path)

    def drain() -> list[dict]:
        out = []
        while got := list(reader.read_new()):
            for offset, record in got:
                reader.offset = offset  # what the relay does after publishing
                out.append(record)
        return out

    first = drain()
    assert first[0] == {"a": 1}
    assert "150 bytes" in first[1]["corrupt"] and "skipped" in first[2]["corrupt"]
    assert all(len(str(r)) < 200 for r in first)  # never the line's bytes
    with open(path, "ab") as fh:
        fh.write(b"y" * 900 + b'\n{"b": 2}\n')  # the long line ends at last; the next one is read
    assert drain() == [{"b": 2}]
    assert reader.offset == path.stat().st_size
    assert drain() == []


def test_a_json_value_that_is_not_an_object_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    path.write_text('[1, 2]\n"text"\n')
    assert [("corrupt" in r) for _, r in SpoolReader(path).read_new()] == [True, True]


def test_an_undecodable_line_is_corrupt_and_the_lines_after_it_are_read(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.jsonl"
    good = b'{"topic": "t", "payload": {"step": 1}}\n'
    # a NUL byte first (json's encoding guess reads UTF-16: UnicodeDecodeError), invalid UTF-8, a bare value
    path.write_bytes(b'\x00{"topic": "t"}\n' + b'{"topic": "\xff\xfe"}\n' + b"42\n" + good)
    got = [record for _, record in SpoolReader(path).read_new()]
    assert [sorted(r) for r in got[:3]] == [["corrupt"]] * 3
    assert got[3] == {"topic": "t", "payload": {"step": 1}}


def test_decode_line() -> None:
    from trainyard_contract.spool import decode_line

    assert decode_line(b'{"a": 1}') == {"a": 1}
    assert decode_line(b"\x00\x00").keys() == {"corrupt"}
    assert decode_line(b'{"a": "\xc3"}')["corrupt"].startswith('{"a": "')
    assert decode_line(b'"\xe9t\xe9"').keys() == {"corrupt"}
    assert decode_line(b"[1]").keys() == {"corrupt"}
    assert decode_line(b"[" * 200_000).keys() == {"corrupt"}  # RecursionError, not a crash


def test_a_spool_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    import os

    import pytest

    from trainyard_contract.rankfiles import RankFileRefused

    fifo = tmp_path / "rank-0.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(RankFileRefused, match="spool refused: not a regular file"):
        list(SpoolReader(fifo).read_new())
    link = tmp_path / "rank-1.jsonl"
    link.symlink_to("/dev/zero")
    with pytest.raises(RankFileRefused, match="spool refused: a symlink"):
        list(SpoolReader(link).read_new())
