"""The job's torchft Lighthouse as the node agent runs it (``python -m trainyard_node_agent.lighthouse``): a
process of its own that answers quorums, without importing torch, and stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from trainyard_cli.infra import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_the_lighthouse_answers_quorums_and_stops_on_sigterm(tmp_path: Path) -> None:
    from torchft._torchft import LighthouseClient

    port = free_port()
    out_file, err_file = tmp_path / "out", tmp_path / "err"
    with out_file.open("w") as out_w, err_file.open("w") as err_w:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "trainyard_node_agent.lighthouse", "--bind",
             f"127.0.0.1:{port}", "--min-replicas", "1", "--join-timeout-ms", "50"], stdout=out_w, stderr=err_w)
    try:
        deadline = time.monotonic() + 60
        quorum = None
        while quorum is None:
            try:
                client = LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=timedelta(seconds=2))
                quorum = client.quorum(replica_id="job-x-replica0", timeout=timedelta(seconds=5), step=3,
                                       world_size=1)
            except Exception:  # noqa: BLE001 - not listening yet
                assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()[-3000:]
                time.sleep(0.2)
        assert [p.replica_id for p in quorum.participants] == ["job-x-replica0"]
        assert quorum.participants[0].step == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    out, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 0, err[-2000:]
    assert "listening on 127.0.0.1" in out
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "torchft" not in imported  # the extension alone: ~15 MB, not torch
