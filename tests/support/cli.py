"""The `trainyard` CLI as a user types it: :class:`LocalCli` against a local stack of its own (a fresh
state directory and free ports; the commands run in that directory, so the CLI finds the stack's URL and
token in its .trainyard/, as it does in a checkout), and :func:`trainyard` against a running
:class:`LocalStack` (its URL, and its dev token or another)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainyard_cli import infra, redisacl
from trainyard_cli.stack import LocalStack

REPO = Path(__file__).resolve().parents[2]


class LocalCli:
    """``trainyard …`` subprocesses for a stack under ``root`` with ``nodes`` node agents."""

    def __init__(self, root: Path, *, nodes: int = 2) -> None:
        self.root = root
        redis_port = infra.free_port()
        self.redis_port = redis_port
        self.env = {**os.environ, "TRAINYARD_STATE_DIR": str(root / ".trainyard"),
                    "TRAINYARD_KAFKA_PORT": str(infra.free_port()), "TRAINYARD_REDIS_PORT": str(redis_port),
                    "TRAINYARD_API_PORT": str(infra.free_port()), "TRAINYARD_NODES": str(nodes),
                    "TRAINYARD_READY_TIMEOUT_S": "180", "COLUMNS": "200"}
        self.env.pop("TRAINYARD_TOKEN", None)
        self.env.pop("TRAINYARD_API_URL", None)

    @property
    def redis_url(self) -> str:
        """The stack's Redis as its operator (the password `up` generated; see trainyard_cli.redisacl)."""
        passwords = redisacl.load_or_create(self.root / ".trainyard" / "redis-users.json")
        return redisacl.url_for(redisacl.OPERATOR, passwords[redisacl.OPERATOR], host="127.0.0.1",
                                port=self.redis_port)

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trainyard_cli", *args], cwd=self.root, env=self.env,  # noqa: S603 - our own CLI
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def trainyard(stack: LocalStack, *args: str, token: str | None = None, cwd: Path = REPO,
              timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``trainyard --api-url <stack> --token <token> ARGS`` (the stack's dev token by default); the
    caller's TRAINYARD_TOKEN / TRAINYARD_API_URL are not inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINYARD_TOKEN", "TRAINYARD_API_URL")}
    token = token if token is not None else stack.token_file.read_text().strip()
    return subprocess.run(  # noqa: S603 - the CLI as a user runs it
        [sys.executable, "-m", "trainyard_cli", "--api-url", stack.s.api_url, "--token", token, *args],
        cwd=cwd, env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=timeout_s,
        stdin=subprocess.DEVNULL)
