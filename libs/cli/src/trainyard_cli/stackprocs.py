"""Process supervision of the local stack: pid files name what ``up`` started, so ``down`` stops exactly that.

Every component (broker, Redis, a service, a node agent, Prometheus) runs in a session of its own
(``start_new_session``) and is recorded as ``<run dir>/<name>.pid``; stopping signals the whole process group,
SIGTERM first, SIGKILL after the grace period. Used by :class:`trainyard_cli.stack.LocalStack`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainyard_contract.errors import ConfigError

__all__ = ["Component", "Processes", "pid_alive"]


@dataclass(frozen=True)
class Component:
    name: str
    pid: int
    log: Path

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as dead
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


class Processes:
    """The pid files of one stack's run directory, and the processes they name."""

    def __init__(self, run_dir: Path, log_dir: Path) -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir

    def pidfile(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def components(self) -> list[Component]:
        found = []
        if self.run_dir.is_dir():
            for pidfile in sorted(self.run_dir.glob("*.pid")):
                try:
                    pid = int(pidfile.read_text().strip())
                except ValueError:
                    continue
                found.append(Component(pidfile.stem, pid, self.log_dir / f"{pidfile.stem}.log"))
        return found

    def record(self, name: str, pid: int) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.pidfile(name).write_text(f"{pid}\n")

    def forget(self, name: str) -> None:
        self.pidfile(name).unlink(missing_ok=True)

    def spawn(self, name: str, module: str, env: dict[str, str], *, cwd: Path) -> int:
        """``python -m module`` in a session of its own, its output appended to ``<log dir>/<name>.log``; its pid."""
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-m", module],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(cwd), start_new_session=True,
            )
        self.record(name, proc.pid)
        return proc.pid

    def stop(self, group: list[Component], timeout_s: float) -> list[str]:
        """SIGTERM each of ``group``'s process groups, SIGKILL what is left after ``timeout_s``; their names."""
        for c in group:
            signal_group(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(c.alive for c in group):
            time.sleep(0.2)
        for c in group:
            if c.alive:
                signal_group(c.pid, signal.SIGKILL)
            self.forget(c.name)
        return [c.name for c in group]


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group our start_new_session gave the component (its children too)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        raise ConfigError(f"not allowed to stop pid {pid}: {exc}") from exc
