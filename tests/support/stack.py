"""A whole local stack (broker, Redis, the services, two node agents) on free ports, with the example
dataset published: what e2e and security modules share as their module-scoped ``stack`` fixture."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainyard_cli import infra
from trainyard_cli.devstack import prepare_and_publish
from trainyard_cli.stack import LocalStack, StackSettings


@contextmanager
def local_stack(state_dir: Path, *, nodes: int = 2, devices_per_node: int = 4,
                extra_env: dict[str, str] | None = None, **settings: Any) -> Iterator[LocalStack]:
    """A whole local stack on free ports under ``state_dir``, tinycorpus@v1 published; down afterwards, whatever
    happened. ``extra_env``: settings every service gets (the node agents' package index, say); ``settings``:
    more of the stack's own (``prometheus=True``, say)."""
    chosen = StackSettings(
        state_dir=state_dir, kafka_port=infra.free_port(), redis_port=infra.free_port(), api_port=infra.free_port(),
        nodes=nodes, devices_per_node=devices_per_node, ready_timeout_s=180, **settings,
    )
    stack = LocalStack(chosen, extra_env=extra_env)
    try:
        stack.up()
        prepare_and_publish(stack)
        yield stack
    finally:
        stack.down()


def running_stack(tmp_path_factory: pytest.TempPathFactory, name: str, *,
                  extra_env: dict[str, str] | None = None) -> Iterator[LocalStack]:
    """Up (two nodes of four CPU devices), tinycorpus@v1 published: a module-scoped fixture's body."""
    with local_stack(tmp_path_factory.mktemp(name) / ".trainyard", extra_env=extra_env) as stack:
        yield stack


def api_client(stack: LocalStack) -> Iterator[httpx.Client]:
    """An HTTP client of the stack's API with the tenant's token: a module-scoped ``client`` fixture's body."""
    token = stack.token_file.read_text().strip()
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        yield c


def rank_entries(stack: LocalStack, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """(node, entry) of every rank of ``job_id`` in the node agents' rank tables in Redis (running or adopted)."""
    import json

    import redis

    found = []
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        for node in range(stack.s.nodes):
            for raw in client.hgetall(f"ty:agent:node-{node}:ranks").values():
                entry = json.loads(raw)
                if entry["jobId"] == job_id:
                    found.append((f"node-{node}", entry))
    finally:
        client.close()
    return found
