"""bench/control_plane/run.py --quick runs end to end on its own local stack and reports every figure; no
accepted submission is lost (a correctness promise; the durations are figures, never asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_control_plane_benchmark_reports_every_figure_and_loses_no_job(tmp_path: Path) -> None:
    out = tmp_path / "control_plane.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench/control_plane/run.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    for name in ("broker_round_trip_ms", "gang_allocated_ms"):
        assert figures[name]["samples"] > 0
        assert figures[name]["p50"] is not None and figures[name]["p99"] is not None
    assert figures["gang_allocated_ms"]["not_placed"] == 0
    assert set(figures["gang_allocated_ms"]["ratio_to_broker"]) == {"p50", "p99"}
    sustained = figures["sustained"]
    assert sustained["accepted"] > 0 and sustained["post_ms"]["p99"] is not None
    assert sustained["lost"] == 0
    assert sustained["listed"] == sustained["terminal"] == sustained["accepted"]
    assert figures["first_step_ms"]["value"] is not None and figures["first_step_ms"]["ratio_to_broker"] is not None
    assert "POST sent → GangAllocated" in done.stdout
