"""The rank → node-agent spool keeps every complete line exactly once across reads."""

from __future__ import annotations

from pathlib import Path

from trainyard_common.events import StepMetrics
from trainyard_common.spool import SpoolReader, SpoolWriter


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
