"""bench/gpu/mfu.py runs end to end without a GPU: a few steps of llama-tiny through the real trainer
rank, and the figures it reports are the trainer's own (the H200 run is bench/gpu/run.sh)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_mfu_benchmark_runs_llama_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "mfu.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench/gpu/mfu.py"), "--device", "cpu", "--model", "llama-tiny@v1",
         "--steps", "8", "--micro-batch", "2", "--accumulation", "1", "--seq", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["architecture"] == "llama"
    assert figures["parameters"] == 223_552  # the catalog's llama-tiny@v1, built by the trainer
    assert figures["steps"] == 8
    assert figures["tokensPerSecond"] > 0 and 0 < figures["mfu"] < 1
    assert "MFU (steady state" in done.stdout
