"""The rank launcher records how its child ended, including death by signal, and passes it on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from trainyard_node_agent.ranks import LAUNCHER, note_file_for, read_exit_file, read_note_step


def launch(tmp_path: Path, code: str) -> tuple[int, Path]:
    exit_file = tmp_path / "exit" / "rank-0.json"
    proc = subprocess.run([sys.executable, str(LAUNCHER), str(exit_file), "--", sys.executable, "-c", code],
                          timeout=60, capture_output=True)
    return proc.returncode, exit_file


def test_exit_code_is_recorded_and_returned(tmp_path: Path) -> None:
    code, exit_file = launch(tmp_path, "import sys; sys.exit(3)")
    assert code == 3 and read_exit_file(exit_file) == 3
    record = json.loads(exit_file.read_text())
    assert record["writer"] == "launcher" and record["pid"] == int((tmp_path / "exit" / "rank-0.pid").read_text())


def test_death_by_signal_is_recorded_and_the_launcher_dies_the_same_way(tmp_path: Path) -> None:
    code, exit_file = launch(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert code == -signal.SIGKILL and read_exit_file(exit_file) == -signal.SIGKILL


def test_sigterm_reaches_the_rank_with_its_default_action(tmp_path: Path) -> None:
    # the launcher's own no-op handler must not be inherited as "ignored"
    code, exit_file = launch(tmp_path, "import os, signal, time; os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)")
    assert read_exit_file(exit_file) == -signal.SIGTERM and code == -signal.SIGTERM


def test_a_checkpoint_request_signal_neither_kills_the_launcher_nor_a_rank_that_has_no_handler_yet(
    tmp_path: Path
) -> None:
    # the whole process group gets SIGUSR1; before the trainer installs its handler it is ignored
    exit_file = tmp_path / "exit" / "rank-0.json"
    code = ("import os, signal, sys; os.killpg(os.getpgrp(), signal.SIGUSR1); "
            "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(7)); os.kill(os.getpid(), signal.SIGUSR1)")
    proc = subprocess.run([sys.executable, str(LAUNCHER), str(exit_file), "--", sys.executable, "-c", code],
                          timeout=60, capture_output=True, start_new_session=True)  # a group of its own, like a rank's
    assert proc.returncode == 7 and read_exit_file(exit_file) == 7


def test_the_exit_note_beside_the_exit_file(tmp_path: Path) -> None:
    exit_file = tmp_path / "exit" / "rank-3.json"
    note = note_file_for(exit_file)
    assert note == tmp_path / "exit" / "rank-3.note.json"
    assert read_note_step(note) is None
    note.parent.mkdir(parents=True)
    note.write_text(json.dumps({"exitCode": 3, "globalStep": 12}))
    assert read_note_step(note) == 12
    note.write_text(json.dumps({"globalStep": "12"}))
    assert read_note_step(note) is None


async def test_rank_pid_waits_for_the_pid_file_and_never_reads_a_fifo(tmp_path: Path) -> None:
    import asyncio
    import os

    from trainyard_node_agent.ranks import rank_pid

    class Running:
        returncode = None

    exit_file = tmp_path / "rank-0.json"
    pid_file = tmp_path / "rank-0.pid"

    async def write_later() -> None:
        await asyncio.sleep(0.05)
        pid_file.write_text("4242\n")

    writer = asyncio.create_task(write_later())
    assert await rank_pid(exit_file, Running(), timeout_s=30) == 4242  # type: ignore[arg-type]  # a test double
    await writer
    pid_file.unlink()
    os.mkfifo(pid_file)  # put there by the rank: refused, never waited on

    class Ended:
        returncode = 0

    assert await rank_pid(exit_file, Ended(), timeout_s=30) is None  # type: ignore[arg-type]  # a test double


def test_with_pid_by_child_the_launcher_leaves_the_pid_file_to_its_child(tmp_path: Path) -> None:
    """The sandbox's wrapper writes the rank's own pid (its rank runs in a PID namespace, further down)."""
    exit_file = tmp_path / "exit" / "rank-0.json"
    pid_file = tmp_path / "exit" / "rank-0.pid"
    writes = f"open({str(pid_file)!r}, 'w').write('4242')"
    proc = subprocess.run([sys.executable, str(LAUNCHER), str(exit_file), "--pid-by-child", "--", sys.executable,
                           "-c", writes], timeout=60, capture_output=True)
    assert proc.returncode == 0 and read_exit_file(exit_file) == 0
    assert pid_file.read_text() == "4242"
