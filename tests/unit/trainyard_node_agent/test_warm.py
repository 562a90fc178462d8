"""A warm interpreter imports its module in advance, then becomes the rank: environment, log, pid and
exit status as the cold launcher records them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainyard_node_agent import sandbox as sb
from trainyard_node_agent.ranks import read_exit_file
from trainyard_node_agent.warmpool import WARM, auto_size, mem_available_bytes

RANK = '''
import os, signal, sys
IMPORTED_AT_START = os.environ.get("ROLE", "none")

def main():
    print(f"imported as {IMPORTED_AT_START}, running as {os.environ['ROLE']}, argv {sys.argv}, nice {os.nice(0)}",
          flush=True)
    if os.environ.get("SECRET"):
        print(f"uid {os.getuid()} gid {os.getgid()} sees secret {os.path.exists(os.environ['SECRET'])} "
              f"plan env {os.environ.get('FROM_PLAN')}", flush=True)
    if os.environ.get("DIE"):
        os.kill(os.getpid(), signal.SIGKILL)
    return int(os.environ["CODE"])
'''


def warm_rank(tmp_path: Path, env: dict[str, str], plan: sb.SandboxPlan | None = None) -> tuple[int, Path, Path]:
    (tmp_path / "fake_rank.py").write_text(RANK)
    base = {**os.environ, "PYTHONPATH": str(tmp_path), "ROLE": "interpreter"}
    proc = subprocess.Popen([sys.executable, str(WARM), "fake_rank"], env=base, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == b"ready"
    # as root the interpreter imported at the lowest priority (background work); the rank runs at normal
    nice = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    assert nice == (19 if os.geteuid() == 0 else 0), nice
    log, exit_file = tmp_path / "logs" / "rank-0.log", tmp_path / "exit" / "rank-0.json"
    log.parent.mkdir()
    launch = {"env": {"PATH": os.environ["PATH"], "ROLE": "rank", **env}, "log": str(log), "exitFile": str(exit_file)}
    if plan is not None:
        launch["sandbox"] = plan.to_json()
    proc.stdin.write((json.dumps(launch) + "\n").encode())
    proc.stdin.close()
    return proc.wait(60), log, exit_file


def test_the_rank_runs_with_its_own_environment_and_its_exit_is_recorded(tmp_path: Path) -> None:
    code, log, exit_file = warm_rank(tmp_path, {"CODE": "3"})
    assert code == 3 and read_exit_file(exit_file) == 3
    assert "imported as interpreter, running as rank, argv ['trainyard-train'], nice 0" in log.read_text()
    assert json.loads(exit_file.read_text())["pid"] == int(exit_file.with_suffix(".pid").read_text())


def test_a_killed_rank_is_recorded_and_the_interpreter_dies_the_same_way(tmp_path: Path) -> None:
    code, _, exit_file = warm_rank(tmp_path, {"CODE": "0", "DIE": "1"})
    assert code == -signal.SIGKILL and read_exit_file(exit_file) == -signal.SIGKILL


def test_eof_before_a_launch_ends_an_idle_interpreter(tmp_path: Path) -> None:
    (tmp_path / "fake_rank.py").write_text(RANK)
    proc = subprocess.run([sys.executable, str(WARM), "fake_rank"], input=b"", capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip() == b"ready"


@pytest.mark.skipif(os.geteuid() != 0, reason="entering a sandbox needs root (CI runs as root)")
def test_on_a_sandboxed_node_the_rank_enters_its_sandbox_before_it_runs(tmp_path: Path) -> None:
    """The interpreter imported as the agent's user; the rank it forks runs as the job's uid, in its own
    mount namespace where the covered paths are empty, with the plan's environment on top — and the
    interpreter (root) still records its exit."""
    hidden = tmp_path / "other-tenants"
    hidden.mkdir()
    (hidden / "secret").write_text("not for this rank")
    plan = sb.SandboxPlan(uid=1_000_000_321, gid=1_000_000_321, cover=((str(hidden), 0o755),), binds=(),
                          cwd="/", env={"FROM_PLAN": "yes"}, hide_processes=False)
    code, log, exit_file = warm_rank(tmp_path, {"CODE": "0", "SECRET": str(hidden / "secret")}, plan)
    assert "uid 1000000321 gid 1000000321 sees secret False plan env yes" in log.read_text(), log.read_text()
    assert code == 0 and read_exit_file(exit_file) == 0
    assert (hidden / "secret").exists()  # covered inside the rank's namespace only


def test_a_sandbox_that_cannot_be_entered_ends_the_rank_as_the_wrapper_would(tmp_path: Path) -> None:
    """A bind source that does not exist: the rank never runs; the exit status and the log line are the
    exec wrapper's, so the agent reports it as this node's trouble, not the job's."""
    plan = sb.SandboxPlan(uid=1_000_000_321, gid=1_000_000_321, cover=(),
                          binds=(sb.Bind(str(tmp_path / "missing")),), cwd="/", hide_processes=False)
    code, log, exit_file = warm_rank(tmp_path, {"CODE": "0"}, plan)
    assert code == sb.SANDBOX_EXIT and read_exit_file(exit_file) == sb.SANDBOX_EXIT
    assert sb.SANDBOX_FAILURE in log.read_text() and "running as rank" not in log.read_text()


@pytest.mark.parametrize(("devices", "available", "size"), [
    (4, 24 * 2**30, 4),  # plenty of memory: one per device
    (8, 8 * 2**30, 2),  # an eighth of 8 GiB holds two at 512 MiB
    (4, 2 * 2**30, 0),  # a small host keeps none
    (0, 24 * 2**30, 0),
    (4, None, 0),  # memory unknown: no pool rather than a guess
])
def test_the_pool_is_sized_to_the_devices_and_the_memory(devices: int, available: int | None, size: int) -> None:
    assert auto_size(devices, available) == size


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n")
    assert mem_available_bytes(meminfo) == 1000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert mem_available_bytes(meminfo) is None
    assert mem_available_bytes(tmp_path / "absent") is None
