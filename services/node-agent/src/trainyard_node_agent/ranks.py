"""Rank processes: spawn one (through :mod:`launcher`) in its own session, so its whole process
group can be signalled; wait for it, stop it (SIGTERM, then SIGKILL), or, after an agent
restart, adopt it and watch it through ``/proc`` and its exit file. Where a rank is in its life
(:class:`~trainyard_node_agent.supervision.RankState`) is decided in :mod:`supervision`.

The process group leader is the launcher (``pgid``); ``pid`` is the rank itself (what
WorkerStarted reports, what an operator would signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainyard_contract.rankfiles import RankFileRefused, open_rank_file, read_rank_file
from trainyard_contract.spool import SpoolReader

from trainyard_node_agent import launcher
from trainyard_node_agent.classify import parse_oom_kills
from trainyard_node_agent.clock import SYSTEM_CLOCK, Clock
from trainyard_node_agent.sandbox import wrapped_pid_file
from trainyard_node_agent.supervision import RankState
from trainyard_node_agent.watchdog import Liveness

LAUNCHER = Path(launcher.__file__).resolve()
LOG_TAIL_BYTES = 16 * 1024
NOTE_LIMIT = 64 * 1024  # an exit note, an exit file, a pid file: a few hundred bytes in practice


@dataclass
class RankProcess:
    """One rank this agent launched or adopted, and what it knows about it."""

    job_id: str
    tenant: str
    attempt: int
    allocation_id: str
    epoch: int
    rank: int
    local_rank: int
    pid: int  # the rank (the launcher's child); the launcher's pid until known
    log_path: Path
    spool: SpoolReader
    traceparent: str | None
    exit_file: Path
    device_index: int = 0
    pgid: int = 0  # the launcher: leader of the rank's process group
    start_ticks: int | None = None  # the launcher's start time (/proc), against pid reuse
    process: asyncio.subprocess.Process | None = None  # None when adopted (not our child)
    state: RankState = RankState.NEW  # changed only through supervision.transition
    stop_detail: str | None = None  # why the agent ends it: the reason behind REVOKED, HUNG, VIOLATED, STOPPING
    gone: bool = False  # an adopted rank's group leader has vanished (observed through /proc)
    oom_kills_at_start: int | None = None
    oom_files: tuple[Path, ...] = ()  # its attempt cgroup's memory.events / memory.oom_control (sandboxed nodes)
    # what the hang watchdog judges; its window starts at launch and adoption (supervisor.baseline)
    liveness: Liveness = field(default_factory=lambda: Liveness(0.0))
    last_step: int | None = None  # the step of the last StepMetrics relayed
    saved_step: int | None = None  # the step of the last ShardWritten relayed
    checkpoint_deadline: float | None = None  # monotonic; the watchdog leaves a saving rank alone until then
    code_archive: str | None = None  # sha256:<hex> of the user code it runs (None: the built-in trainer)
    environment: str | None = None  # sha256:<hex> of the lock of the environment it runs in (code.environment)
    start_manifest_uri: str | None = None  # the allocation's start checkpoint (a rank may refuse it)
    log_shipped: int = 0  # bytes of its log shipped to an object-store root (log_shipper)
    log_shipped_at: float | None = None  # monotonic time of the last shipment
    generation: int = 0  # faultTolerance: 0 as launched with the gang, n after the rank's n-th replacement
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        base = f"{self.allocation_id}/{self.rank}"
        return f"{base}@{self.generation}" if self.generation else base

    @property
    def progressed(self) -> bool:
        """It wrote at least one event to its spool."""
        return self.liveness.reported

    @property
    def adopted(self) -> bool:
        """An earlier agent launched it: not our child, watched through ``/proc``."""
        return self.process is None and self.state is not RankState.NEW

    @property
    def running(self) -> bool:
        if self.process is not None:
            return self.process.returncode is None
        return self.adopted and not self.gone

    def persisted(self, boot_id: str) -> dict[str, Any]:
        """What survives an agent restart (so a new agent can adopt the rank, or report it)."""
        return {
            "jobId": self.job_id, "tenant": self.tenant, "attempt": self.attempt,
            "allocationId": self.allocation_id, "epoch": self.epoch, "rank": self.rank,
            "localRank": self.local_rank, "deviceIndex": self.device_index,
            "pid": self.pid, "pgid": self.pgid, "startTicks": self.start_ticks,
            "spool": str(self.spool.path), "offset": self.spool.offset, "log": str(self.log_path),
            "exitFile": str(self.exit_file), "traceparent": self.traceparent, "boot": boot_id,
            "progressed": self.progressed, "lastStep": self.last_step, "savedStep": self.saved_step,
            "logShipped": self.log_shipped,
            **({"codeArchive": self.code_archive} if self.code_archive else {}),
            **({"environment": self.environment} if self.environment else {}),
            **({"startManifestUri": self.start_manifest_uri} if self.start_manifest_uri else {}),
            **({"generation": self.generation} if self.generation else {}),
        }

    @classmethod
    def from_persisted(cls, entry: Mapping[str, Any]) -> RankProcess:
        return cls(
            job_id=entry["jobId"], tenant=entry["tenant"], attempt=int(entry["attempt"]),
            allocation_id=entry["allocationId"], epoch=int(entry["epoch"]), rank=int(entry["rank"]),
            local_rank=int(entry.get("localRank", 0)), pid=int(entry["pid"]), log_path=Path(entry.get("log", "")),
            spool=SpoolReader(entry["spool"], int(entry.get("offset", 0))), traceparent=entry.get("traceparent"),
            exit_file=Path(entry.get("exitFile", "")), device_index=int(entry.get("deviceIndex", 0)),
            pgid=int(entry.get("pgid", entry["pid"])), start_ticks=entry.get("startTicks"),
            liveness=Liveness(0.0, reported=bool(entry.get("progressed", False))),
            last_step=entry.get("lastStep") if isinstance(entry.get("lastStep"), int) else None,
            saved_step=entry.get("savedStep") if isinstance(entry.get("savedStep"), int) else None,
            code_archive=entry.get("codeArchive"), environment=entry.get("environment"),
            start_manifest_uri=entry.get("startManifestUri"),
            log_shipped=int(entry.get("logShipped", 0)), generation=int(entry.get("generation", 0)),
        )

    @property
    def note_file(self) -> Path:
        return note_file_for(self.exit_file)


async def spawn(command: Sequence[str], env: Mapping[str, str], log_path: Path,
                exit_file: Path, *, cwd: Path | None = None) -> asyncio.subprocess.Process:
    """Start ``command`` under the launcher, in a new session, stdout+stderr appended to ``log_path``,
    in ``cwd`` (default: the agent's own)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    clear_exit_files(exit_file)
    # a sandboxed rank runs in a PID namespace under the wrapper: the wrapper writes the rank's own pid
    by_child = ["--pid-by-child"] if wrapped_pid_file(command) == launcher.pid_file_for(str(exit_file)) else []
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return await asyncio.create_subprocess_exec(
            # -I: the launcher runs as the agent's user; nothing in the rank's environment (PYTHONPATH…) may
            # make it import code it did not bring
            sys.executable, "-I", str(LAUNCHER), str(exit_file), *by_child, "--", *command, env=dict(env),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=cwd,
        )


def note_file_for(exit_file: Path) -> Path:
    """``…/rank-3.json`` → ``…/rank-3.note.json``: where the trainer notes how it ended (its last step)."""
    return exit_file.with_name(exit_file.stem + ".note.json") if exit_file.name else exit_file


def read_json(path: Path, what: str) -> tuple[Any, str | None]:
    """(the JSON in ``path``, None), or (None, why it was refused) for a file that is no small regular file
    (:func:`~trainyard_contract.rankfiles.read_rank_file`: a FIFO, a symlink, a huge file); (None, None) when
    it is missing or no JSON. Blocks on nothing a rank controls; still, call it off the event loop."""
    try:
        data = read_rank_file(path, limit=NOTE_LIMIT, what=what)
    except RankFileRefused as exc:
        return None, str(exc)
    except OSError:
        return None, None
    if data is None:
        return None, None
    try:
        return json.loads(data.decode("utf-8")), None
    except (ValueError, RecursionError):
        return None, None


def read_note(path: Path) -> tuple[int | None, str | None]:
    """(the ``globalStep`` of a trainer's exit note or None, why the note was refused or None)."""
    entry, refused = read_json(path, "exit note")
    step = entry.get("globalStep") if isinstance(entry, dict) else None
    return (step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None), refused


def read_note_step(path: Path) -> int | None:
    """The ``globalStep`` of a trainer's exit note, or None."""
    return read_note(path)[0]


def clear_exit_files(exit_file: Path) -> None:
    """Remove what an earlier launch of the same rank left (never the case for a new attempt)."""
    exit_file.parent.mkdir(parents=True, exist_ok=True)
    for stale in (exit_file, Path(launcher.pid_file_for(str(exit_file))), note_file_for(exit_file),
                  Path(launcher.start_error_file_for(str(exit_file)))):
        stale.unlink(missing_ok=True)


async def rank_pid(exit_file: Path, process: asyncio.subprocess.Process, timeout_s: float = 5.0, *,
                   clock: Clock = SYSTEM_CLOCK) -> int | None:
    """The rank's pid as the launcher wrote it; None if the launcher ended or was slow."""
    pid_file = Path(launcher.pid_file_for(str(exit_file)))
    deadline = clock.monotonic() + timeout_s
    while clock.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, RankFileRefused):  # a rank's file: never blocks
            written = read_rank_file(pid_file, limit=64, what="pid file")
            if written is not None:
                return int(written.strip())
        if process.returncode is not None:
            return None
        await clock.sleep(0.01)
    return None


def read_start_error(path: Path) -> str | None:
    """The launcher's OSError when it could not start the command at all, or None."""
    entry, _ = read_json(path, "exit file")
    error = entry.get("error") if isinstance(entry, dict) and entry.get("pid") is None else None
    return str(error) if error else None


def read_exit_file(path: Path) -> int | None:
    """The exit code the launcher recorded, or None."""
    return read_exit(path)[0]


def read_exit(path: Path) -> tuple[int | None, str | None]:
    """(the exit code the launcher recorded or None, why the exit file was refused or None)."""
    entry, refused = read_json(path, "exit file")
    try:
        return int(entry["exitCode"]), None
    except (ValueError, KeyError, TypeError, OverflowError):
        return None, refused


async def wait_exited(process: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait up to ``timeout_s``; True once the process has exited."""
    if process.returncode is not None:
        return True
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Signal a whole process group; False when nothing is left in it."""
    if pgid <= 1:  # 0 or 1 would mean our own group or every process: never
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def stop(rank: RankProcess, grace_s: float, *, clock: Clock = SYSTEM_CLOCK) -> None:
    """SIGTERM the rank's process group, SIGKILL whatever is left after ``grace_s`` (at once if 0)."""
    if rank.running and grace_s > 0:
        signal_group(rank.pgid, signal.SIGTERM)
        await _wait_until_ended(rank, grace_s, clock)
    # SIGKILL works on stopped processes too; children that outlive the rank (dataloader workers, …) go too.
    signal_group(rank.pgid, signal.SIGKILL)
    await _wait_until_ended(rank, 5.0, clock)


async def _wait_until_ended(rank: RankProcess, timeout_s: float, clock: Clock) -> None:
    if rank.process is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(rank.process.wait(), timeout_s)
        return
    deadline = clock.monotonic() + timeout_s
    while clock.monotonic() < deadline and same_process(rank.pgid, rank.start_ticks):
        await clock.sleep(0.05)


# ----------------------------------------------------------------------------- /proc


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, process group, start time in clock ticks) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    # after "pid (comm)": state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice num_threads itrealvalue starttime …
    return fields[0], int(fields[2]), int(fields[19])


def start_ticks(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat[2] if stat else None


def proc_state(pid: int) -> str | None:
    stat = proc_stat(pid)
    return stat[0] if stat else None


def same_process(pid: int, ticks: int | None) -> bool:
    """Whether ``pid`` is still the process we knew (not reused, not a zombie)."""
    stat = proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return ticks is None or stat[2] == ticks


def alive(pid: int, pgid: int) -> bool:
    """Whether ``pid`` still runs in process group ``pgid``."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X") and stat[1] == pgid


def log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a rank log (for the failure classification)."""
    try:
        fd = open_rank_file(path, what="rank log")  # the rank may have put a FIFO or a link in its place
        if fd is None:
            return ""
        with open(fd, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - limit, 0))
            return fh.read(limit).decode(errors="replace")
    except (OSError, RankFileRefused) as exc:
        return f"(no log: {exc})" if isinstance(exc, RankFileRefused) else ""


def file_size(path: Path) -> int:
    """The size of a spool or log file (0 when it does not exist yet)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def oom_kills(pid: int | None = None, attempt_files: Sequence[Path] = ()) -> int | None:
    """The kernel OOM-kill counter of the rank's attempt cgroup when it has one (``attempt_files``), else of
    ``pid``'s memory cgroup (v2 or v1), best effort; None if unknown."""
    base = Path("/sys/fs/cgroup")
    existing = [f for f in attempt_files if f.exists()]
    for candidate in existing or _cgroup_files(base, pid or os.getpid()):
        with contextlib.suppress(OSError):
            count = parse_oom_kills(candidate.read_text())
            if count is not None:
                return count
    return None


def _cgroup_files(base: Path, pid: int) -> list[Path]:
    files = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if hierarchy == "0":
                files.append(base / rel / "memory.events")
            elif "memory" in controllers.split(","):
                files.append(base / "memory" / rel / "memory.oom_control")
    files += [base / "memory.events", base / "memory" / "memory.oom_control"]
    return files
