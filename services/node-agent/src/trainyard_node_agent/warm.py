"""A warm rank interpreter: ``python warm.py <module>`` (what ``TRAINYARD_WARM_RANKS`` keeps ready).

Most of a new attempt's start-up is the rank importing Python, torch and the trainer. A warm
interpreter has done that already: it imports ``<module>`` (default ``trainyard_trainer.__main__``),
calls its ``prewarm()`` if it has one (lazy imports a rank would make before its first step),
prints ``ready`` on stdout, and waits for one launch on stdin, a JSON line::

    {"env": {...}, "log": "<rank log>", "exitFile": "<attempt>/exit/rank-<r>.json", "argv0": "trainyard-train",
     "sandbox": "<the rank's SandboxPlan, JSON; on a sandboxed node only>"}

Then it becomes what :mod:`launcher` is for a cold start: its output goes to the rank log, it forks
the rank (which runs ``<module>.main()`` with the rank's environment), writes the rank's pid beside
the exit file, waits for it and records its exit status, and exits the same way. EOF on stdin
before a launch means the agent no longer needs it: it exits 0.

With ``sandbox`` the forked rank first does what the exec wrapper (:mod:`sandbox`) does for a cold rank —
it joins the attempt's cgroup, gets its own mount and PID namespaces showing only its paths (the forked child
stays outside as the namespace's supervisor, and writes the rank's pid), the job's uid/gid, no new
privileges, the seccomp filter — and only then runs ``main()``; the interpreter itself stays the agent's
user, to record the rank's exit as the launcher would.
A sandbox that cannot be entered ends the rank with the wrapper's exit status and message, so the agent
reports it the same way. What the interpreter imported before it knew its job is the platform's own code.

Run as root (an agent that can take priority back), an interpreter imports at the lowest CPU priority
(nice ``IMPORT_NICE``): refilling the pool is background work and must not slow the control plane or
running ranks on a small host. The agent sets the priority back to normal when it hands the interpreter
a launch (and the interpreter does so itself before it forks the rank), so the rank runs at normal priority.

Variables read while importing (``OMP_NUM_THREADS``, ``PYTHONHASHSEED``…) come from the
interpreter's own environment, which the agent sets like a rank's (one thread: the rank's share of
the cores is not known yet). The rank sets torch's threads from its ``TRAINYARD_CPU_THREADS`` when
it starts, which wins over what the interpreter imported torch with.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from types import ModuleType


def _load_sibling(name: str) -> ModuleType:
    """A sibling module (standard library only), loaded by path under a private name: this runs as a
    script, and importing the package would pull in the whole agent."""
    spec = importlib.util.spec_from_file_location(f"_trainyard_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


launcher = _load_sibling("launcher")  # the exit-file protocol
sandbox = _load_sibling("sandbox")  # entering a rank's sandbox


def _confine(plan_json: str) -> int | None:
    """Enter the rank's sandbox (in the forked rank, before anything of it runs); the wrapper's exit
    status when that fails, else None."""
    plan = sandbox.SandboxPlan.from_json(plan_json)
    try:
        sandbox.enter(plan)
    except OSError as exc:
        print(f"{sandbox.SANDBOX_FAILURE} the rank's sandbox: {exc}", file=sys.stderr, flush=True)
        return int(sandbox.SANDBOX_EXIT)
    os.environ.update(plan.env)
    return None


def _rank_writes_pid(plan_json: str, exit_file: str) -> bool:
    """Whether the sandbox writes the rank's pid itself (its rank runs in a PID namespace, a process further down)."""
    plan = sandbox.SandboxPlan.from_json(plan_json)
    return bool(plan.pid_namespace and plan.pid_file == launcher.pid_file_for(exit_file))


def _run_rank(module: object, argv0: str, plan_json: str | None = None) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    if plan_json is not None and (refused := _confine(plan_json)) is not None:
        return refused
    sys.argv = [argv0]
    try:
        code = module.main()  # type: ignore[attr-defined]  # an entry module imported by name
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - the process boundary
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - nothing left to report it to
            pass
    return code if isinstance(code, int) else (0 if code is None else 1)


IMPORT_NICE = 19


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a checkpoint request is the rank's business (see launcher)
    may_renice = os.geteuid() == 0  # only root takes the priority back afterwards
    if may_renice:
        os.setpriority(os.PRIO_PROCESS, 0, IMPORT_NICE)
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run as a script: our sibling modules must not shadow top-level names
    module = importlib.import_module(argv[0] if argv else "trainyard_trainer.__main__")
    prewarm = getattr(module, "prewarm", None)
    if callable(prewarm):  # what the rank would import lazily on its way to the first step
        prewarm()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    launch = json.loads(line)
    if may_renice:  # the rank (forked from this thread) runs at normal priority
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    log = os.open(launch["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)  # the rank holds its log as stdout/stderr only
    os.close(devnull)
    os.environ.clear()
    os.environ.update(launch["env"])
    exit_file = launch["exitFile"]
    os.makedirs(os.path.dirname(exit_file), exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # outlive the rank to record its end
        signal.signal(sig, lambda *_: None)
    plan = launch.get("sandbox")
    pid = os.fork()
    if pid == 0:
        os._exit(_run_rank(module, launch.get("argv0", "trainyard-train"), plan))
    if plan is None or not _rank_writes_pid(plan, exit_file):
        launcher.write_atomically(launcher.pid_file_for(exit_file), str(pid))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries already
            continue
    return launcher.record_exit(exit_file, os.waitstatus_to_exitcode(status), pid, writer="warm-launcher")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
