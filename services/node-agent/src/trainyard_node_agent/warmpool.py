"""A pool of warm rank interpreters (:mod:`warm`), kept full in the background.

``take()`` hands out one that has finished importing; else the one that has been importing the
longest (the launch line waits in its stdin: it is never slower than a cold start, which would
import from scratch); else None (the caller then starts the rank cold). ``take()`` does not refill: importing torch
costs seconds of CPU, and refilling while a new attempt's ranks start would slow exactly the start-up the pool is for.
The agent calls ``fill()`` once its ranks have made their first progress. Each interpreter runs in its own session, so
once it becomes a rank it is signalled, watched and adopted exactly like a cold-started one.

On a sandboxed node (``TRAINYARD_NODE_SANDBOX=enforce``) the interpreters start as the agent's user, like the
launcher does; the launch line carries the rank's sandbox plan, and the forked rank enters it (mount namespace,
the job's uid, no new privileges) before it runs a line of the rank (:mod:`warm`).

How many (:func:`auto_size`, when ``TRAINYARD_WARM_RANKS`` is unset): one per device (a whole node's gang
restarts at once), at most as many as an eighth of the memory available when the agent starts holds at
``INTERPRETER_BYTES`` each (an idle interpreter with torch and the trainer imported measured ~330 MB RSS on CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from trainyard_node_agent import warm

log = logging.getLogger(__name__)
WARM = Path(warm.__file__).resolve()
INTERPRETER_BYTES = 512 * 2**20
MEMORY_SHARE = 8  # the pool takes at most 1/MEMORY_SHARE of the memory available at start


def auto_size(devices: int, mem_available_bytes: int | None) -> int:
    """The pool's size when none is configured. Pure."""
    if mem_available_bytes is None:
        return 0  # unknown memory: no pool rather than a guess
    return max(0, min(devices, mem_available_bytes // MEMORY_SHARE // INTERPRETER_BYTES))


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable of this host, or None where /proc/meminfo does not say it."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class WarmPool:
    def __init__(self, size: int, module: str, env: Mapping[str, str], log_path: Path) -> None:
        self.size = size
        self.module = module
        self.env = dict(env)
        self.log_path = log_path
        self._ready: list[asyncio.subprocess.Process] = []
        self._importing: list[asyncio.subprocess.Process] = []  # started, not ready yet, oldest first
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def ready(self) -> int:
        return len(self._ready)

    def fill(self) -> None:
        """Start the next interpreter while fewer than ``size`` are ready or starting — one at a time (each
        imports torch: several at once on a small host would take every core from everything else)."""
        if not self._closed and not self._starting and len(self._ready) < self.size:
            task = asyncio.create_task(self._start_one())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_path, "ab") as err:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, str(WARM), self.module, env=self.env, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                )
            assert proc.stdout is not None
            self._importing.append(proc)
            line = await proc.stdout.readline()
        except (OSError, asyncio.CancelledError) as exc:
            log.warning("could not start a warm interpreter: %r", exc)
            return
        if proc not in self._importing:
            return  # taken while it was still importing: it is a rank now
        self._importing.remove(proc)
        if line.strip() != b"ready" or self._closed:
            log.warning("a warm interpreter did not become ready (see %s)", self.log_path)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return
        self._ready.append(proc)

    def take(self) -> asyncio.subprocess.Process | None:
        """A ready interpreter, else the oldest still importing, or None (no replacement starts
        here: see ``fill``)."""
        for queue in (self._ready, self._importing):
            while queue:
                proc = queue.pop(0)
                if proc.returncode is None:
                    return proc
        return None

    @staticmethod
    async def launch(proc: asyncio.subprocess.Process, *, env: Mapping[str, str], log_path: Path,
                     exit_file: Path, sandbox: str | None = None) -> None:
        """Turn a ready interpreter into the rank (``sandbox``: the rank's plan, JSON, on a sandboxed node)."""
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # taken while still importing at low priority (see warm): finish at normal
            if os.geteuid() == 0:
                os.setpriority(os.PRIO_PROCESS, proc.pid, 0)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        exit_file.parent.mkdir(parents=True, exist_ok=True)
        launch: dict[str, object] = {"env": dict(env), "log": str(log_path), "exitFile": str(exit_file)}
        if sandbox is not None:
            launch["sandbox"] = sandbox
        line = json.dumps(launch) + "\n"
        proc.stdin.write(line.encode())
        await proc.stdin.drain()
        proc.stdin.close()

    async def aclose(self) -> None:
        """EOF to the idle ones (they exit 0); kill what does not go."""
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        idle, self._ready = self._ready + self._importing, []
        self._importing = []
        for proc in idle:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in idle:
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
