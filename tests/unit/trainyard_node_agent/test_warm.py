"""A warm interpreter imports its module in advance, then becomes the rank: environment, log, pid and
exit status as the cold launcher records them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from trainyard_node_agent.ranks import read_exit_file
from trainyard_node_agent.warmpool import WARM

RANK = '''
import os, signal, sys
IMPORTED_AT_START = os.environ.get("ROLE", "none")

def main():
    print(f"imported as {IMPORTED_AT_START}, running as {os.environ['ROLE']}, argv {sys.argv}", flush=True)
    if os.environ.get("DIE"):
        os.kill(os.getpid(), signal.SIGKILL)
    return int(os.environ["CODE"])
'''


def warm_rank(tmp_path: Path, env: dict[str, str]) -> tuple[int, Path, Path]:
    (tmp_path / "fake_rank.py").write_text(RANK)
    base = {**os.environ, "PYTHONPATH": str(tmp_path), "ROLE": "interpreter"}
    proc = subprocess.Popen([sys.executable, str(WARM), "fake_rank"], env=base, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == b"ready"
    log, exit_file = tmp_path / "logs" / "rank-0.log", tmp_path / "exit" / "rank-0.json"
    log.parent.mkdir()
    launch = {"env": {"PATH": os.environ["PATH"], "ROLE": "rank", **env}, "log": str(log), "exitFile": str(exit_file)}
    proc.stdin.write((json.dumps(launch) + "\n").encode())
    proc.stdin.close()
    return proc.wait(60), log, exit_file


def test_the_rank_runs_with_its_own_environment_and_its_exit_is_recorded(tmp_path: Path) -> None:
    code, log, exit_file = warm_rank(tmp_path, {"CODE": "3"})
    assert code == 3 and read_exit_file(exit_file) == 3
    assert "imported as interpreter, running as rank, argv ['trainyard-train']" in log.read_text()
    assert json.loads(exit_file.read_text())["pid"] == int(exit_file.with_suffix(".pid").read_text())


def test_a_killed_rank_is_recorded_and_the_interpreter_dies_the_same_way(tmp_path: Path) -> None:
    code, _, exit_file = warm_rank(tmp_path, {"CODE": "0", "DIE": "1"})
    assert code == -signal.SIGKILL and read_exit_file(exit_file) == -signal.SIGKILL


def test_eof_before_a_launch_ends_an_idle_interpreter(tmp_path: Path) -> None:
    (tmp_path / "fake_rank.py").write_text(RANK)
    proc = subprocess.run([sys.executable, str(WARM), "fake_rank"], input=b"", capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip() == b"ready"
