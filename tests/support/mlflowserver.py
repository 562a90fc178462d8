"""A real MLflow tracking server for the tracking exporter's tests: ``mlflow server`` from .tools/mlflow
(scripts/ensure-mlflow.sh installs it there, outside .venv), on a free port, over a SQLite store in a temporary
directory. Starting it takes ~15-20 s on a CI host: start one per test module."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from trainyard_cli import infra

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "mlflow"
MLFLOW = TOOLS / "bin" / "mlflow"


def ensure_installed() -> Path:
    """The ``mlflow`` executable, installing it first when missing; skips the test when it cannot be installed."""
    if not MLFLOW.exists():
        done = subprocess.run([str(ROOT / "scripts" / "ensure-mlflow.sh")], capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0 or not MLFLOW.exists():
            pytest.skip(f"no MLflow server: scripts/ensure-mlflow.sh failed ({done.stderr.strip()[-500:]})")
    return MLFLOW


@contextlib.contextmanager
def mlflow_server(workdir: Path, timeout_s: float = 120.0) -> Iterator[str]:
    """Run ``mlflow server`` until the block ends; yields its URL once ``/health`` answers."""
    mlflow = ensure_installed()
    workdir.mkdir(parents=True, exist_ok=True)
    port = infra.free_port()
    logfile = workdir / "mlflow.log"
    with logfile.open("wb") as out:
        proc = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
             "--default-artifact-root", str(workdir / "artifacts")],
            stdout=out, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {logfile.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
