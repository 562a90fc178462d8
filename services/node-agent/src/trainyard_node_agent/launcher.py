"""The rank launcher: ``python launcher.py <exit-file> [--pid-by-child] -- <command…>``. Standard library only.

It runs the rank's command as its child, writes the child's pid beside the exit file
(``rank-<r>.pid``) as soon as it runs (with ``--pid-by-child`` the child writes it: the sandbox's exec
wrapper, whose rank runs in a PID namespace one process further down, writes the rank's own pid), waits
for it, and writes its exit status to ``<attempt dir>/exit/rank-<r>.json`` (``{"exitCode": n, "pid": p,
"writer": "launcher"}``, negative n = killed by signal -n) before exiting with the same status. Why: a node agent that
restarts while ranks run adopts them instead of killing them, but they are no longer its
children, so it cannot wait() for them; it reads the exit file instead.

SIGUSR1 (a checkpoint request, see ``trainyard.preemption``) is ignored here, and the
child inherits that until the trainer installs its handler: a request that arrives while the rank
is still importing must not kill it (the request file the agent writes covers that window).

SIGTERM, SIGINT and SIGHUP get a no-op handler here (not SIG_IGN, which the child would
inherit): the node agent signals the whole process group, so the rank receives them directly,
and the launcher must outlive the rank to record how it ended. SIGKILL ends both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


def write_atomically(path: str, text: str) -> None:
    # A fresh name, never an existing one or a symlink: a sandboxed rank may create files in the exit directory.
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with open(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def pid_file_for(exit_file: str) -> str:
    """``…/rank-3.json`` → ``…/rank-3.pid``."""
    return exit_file[: -len(".json")] + ".pid" if exit_file.endswith(".json") else exit_file + ".pid"


def start_error_file_for(exit_file: str) -> str:
    """``…/rank-3.json`` → ``…/rank-3.start-error``: where the sandbox notes a command it could not exec."""
    return exit_file[: -len(".json")] + ".start-error" if exit_file.endswith(".json") else exit_file + ".start-error"


def read_start_error(exit_file: str) -> str | None:
    """What the sandbox (the launcher's child) noted when it could not exec the command, or None."""
    try:
        with open(start_error_file_for(exit_file), encoding="utf-8", errors="replace") as fh:
            return fh.read(4096).strip() or None
    except OSError:
        return None


def main(argv: list[str]) -> int:
    pid_by_child = len(argv) > 1 and argv[1] == "--pid-by-child"
    if pid_by_child:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: launcher.py <exit-file> [--pid-by-child] -- <command…>", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    os.makedirs(os.path.dirname(os.path.abspath(exit_file)), exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        child = subprocess.Popen(command)  # noqa: S603 - the node agent's configured rank command
    except OSError as exc:
        print(f"launcher: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        write_atomically(exit_file, json.dumps({"exitCode": 127, "pid": None, "writer": "launcher",
                                                 "error": str(exc), "errno": exc.errno}))
        return 127
    if not pid_by_child:
        write_atomically(pid_file_for(exit_file), str(child.pid))
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries already
            continue
    error = read_start_error(exit_file) if code == 127 else None
    if error is not None:  # the sandbox ran, the command did not: recorded as the launcher's own start failure
        print(f"launcher: {error}", file=sys.stderr, flush=True)
        write_atomically(exit_file, json.dumps({"exitCode": 127, "pid": None, "writer": "launcher", "error": error}))
        return 127
    return record_exit(exit_file, code, child.pid, writer="launcher")


def record_exit(exit_file: str, code: int, pid: int, *, writer: str) -> int:
    """Write the rank's exit status to ``exit_file``, then end the same way (negative = that signal),
    so a waiting parent sees the rank's status too. Shared with :mod:`warm`."""
    write_atomically(exit_file, json.dumps({"exitCode": code, "pid": pid, "writer": writer}))
    if code < 0:  # die the way the child died
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
