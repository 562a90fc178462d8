"""A Redis primary, its replica and one Sentinel (quorum 1, fast failure detection) on free 127.0.0.1
ports in a temporary directory, for the failover tests (trainyard_cli.redisha does the work); and the
failures a ``TRAINYARD_REDIS_HA`` local stack's Redis is put through in tests/e2e/test_redis_failover_stack.py."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainyard_cli import infra, redisha
from trainyard_cli.stack import LocalStack, pid_alive


@contextmanager
def redis_ha(root: Path) -> Iterator[redisha.RedisHA]:
    """Started and in sync; stopped (every process) on exit."""
    ha = redisha.RedisHA(root, root / "logs", (infra.free_port(), infra.free_port()), (infra.free_port(),))
    try:
        ha.start(timings=redisha.FAST, quorum=1)
        yield ha
    finally:
        ha.stop()


def kill_stack_primary(stack: LocalStack, timeout_s: float = 60.0) -> tuple[int, int]:
    """kill -9 the primary of a ``TRAINYARD_REDIS_HA`` stack (its pid file names the process); once the
    Sentinels promoted the replica, start the old one again as its replica, recorded in the stack's pid
    file so that ``down`` stops it. Returns (old, new) primary ports once all is in sync again."""
    ha = stack.redis_ha()
    old = ha.wait_ready(timeout_s)
    deadline = time.monotonic() + timeout_s
    pidfile = stack.s.run_dir / f"redis-{old}.pid"
    pid = int(pidfile.read_text().strip())
    os.kill(pid, signal.SIGKILL)
    while infra.port_in_use(old) or pid_alive(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server :{old} (pid {pid}) did not die")
        time.sleep(0.05)
    new = ha._wait_named(old, deadline)
    launched = ha.start_server(old, replica_of=new, force_replica_of=True)
    pidfile.write_text(f"{launched.process.pid}\n")
    return old, ha.wait_ready(max(1.0, deadline - time.monotonic()))
