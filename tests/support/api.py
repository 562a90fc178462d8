"""The API as tests run it: the tenants' tokens, the example dataset, clients, example specs, and the
whole API process (uvicorn + ServiceRuntime), with the telemetry service beside it, over the real broker and
Redis.

``python -m tests.support.api [--port N]`` serves the same API over a broker and a Redis of its own (the
local binaries, as the test fixtures start them) until SIGINT or SIGTERM, for running a tool such as
schemathesis against it by hand (see tests/contract/schemathesis.toml); it prints the URL and the tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import queue
import signal
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from trainyard_api import ApiServer, ApiSettings
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.records import DatasetRecord
from trainyard_runtime.store import StateStore
from trainyard_telemetry import TelemetryService, TelemetrySettings

TOKEN_A, TOKEN_B = "token-tenant-a", "token-tenant-b"
TOKEN_ADMIN = "token-admin"
HISTORY_JOB = "job-c0a7c0a7c0a7"
"""tenant-a's finished job with a metric history (:func:`seed_history`): schemathesis reads it by this id."""


async def seed(store: StateStore, *, admin: bool = False) -> None:
    """Two tenants and the example dataset in the registry (and, with ``admin``, an operator's token)."""
    await store.add_token(TOKEN_A, "tenant-a", "alice")
    await store.add_token(TOKEN_B, "tenant-b", "bob")
    if admin:
        await store.add_token(TOKEN_ADMIN, "ops", "olga", admin=True)
    await store.put_dataset(DatasetRecord(
        name="tinycorpus", version="v1", manifest_uri="file:///data/tinycorpus/v1/manifest.json",
        sha256="ab" * 32, tokenizer="bpe-1024@v1", num_tokens=123_456,
    ))


async def seed_history(store: StateStore, *, steps: int = 300) -> None:
    """:data:`HISTORY_JOB`, which ran on two ranks and succeeded, with ``steps`` steps of metric history on each
    (the built-in series and a custom one), as the ingest writes it: the metrics routes answer with data, not
    empty. Finished, so that following its logs (``follow=true``) ends at once, as a request has to."""
    from trainyard_telemetry.metrics_history import MetricHistory
    from trainyard_contract import events as ev
    from trainyard_contract.records import AttemptRecord, JobRecord, utcnow
    from trainyard_contract.spec import TrainingSpec

    spec = TrainingSpec.model_validate(spec_with())
    await store.create_job(JobRecord(
        job_id=HISTORY_JOB, tenant="tenant-a", spec=spec, spec_hash=spec.spec_hash(), state="succeeded",
        attempts=[AttemptRecord(attempt=1, allocation_id="a1", epoch=1, world_size=2, state="succeeded",
                                ended_at=utcnow())]))
    history = MetricHistory(store.redis)
    try:
        for step in range(1, steps + 1):
            for rank in (0, 1):
                await history.on_step_metrics(ev.StepMetrics(
                    job_id=HISTORY_JOB, tenant="tenant-a", attempt=1, rank=rank, step=step,
                    loss=5.0 / step + (step % 7) * 0.01, lr=1e-3, tokens_per_second=1000.0 + step % 13,
                    consumed_tokens=step * 1024, step_seconds=0.5 + rank * 0.1 + (step % 5) * 0.01,
                    compute_seconds=0.4, metrics={"gradNorm": 1.0 + (step % 11) / 10}))
    finally:
        await history.aclose()


def client_for(base_url: str, token: str | None, **kwargs: Any) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=10.0, **kwargs)


def spec_with(**changes: Any) -> dict[str, Any]:
    """The example spec with dotted-path changes: ``spec_with(**{"training.maxSteps": 5})``."""
    spec = copy.deepcopy(EXAMPLE_SPEC)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = spec
        for p in parents:
            node = node[p]
        node[leaf] = value
    return spec


@contextlib.asynccontextmanager
async def running_api(env: dict[str, object], *, admin: bool = False, history: bool = False, telemetry: bool = True,
                      **settings: Any) -> AsyncIterator[ApiServer]:
    """The whole API process in-process (uvicorn on a free port unless ``api_port`` is given, a started
    ServiceRuntime) over ``env``'s broker and Redis, seeded (see :func:`seed`; with ``history``,
    :func:`seed_history` too). With ``telemetry`` (the default) the telemetry service runs beside it, as in
    every deployment: it keeps the StepMetrics read models the API's routes serve (``settings`` go to both;
    each takes its own)."""
    merged = {**env, "api_port": 0, **settings}
    async with contextlib.AsyncExitStack() as stack:
        if telemetry:
            await stack.enter_async_context(TelemetryService(TelemetrySettings(**merged)))
        api = await stack.enter_async_context(ApiServer(ApiSettings(**merged)))
        await seed(api.runtime.store, admin=admin)
        if history:
            await seed_history(api.runtime.store)
        yield api


@contextlib.contextmanager
def api_in_thread(env: dict[str, object], **options: Any) -> Iterator[str]:
    """:func:`running_api` on an event loop of its own in a thread, for synchronous clients; yields its URL."""
    started: queue.Queue[str | BaseException] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        try:
            async with running_api(env, **options) as api:
                started.put(api.url)
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            started.put(exc)
            raise

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="api", daemon=True)
    thread.start()
    try:
        first = started.get(timeout=60)
        if isinstance(first, BaseException):
            raise RuntimeError("the API did not start") from first
        yield first
    finally:
        stop.set()
        thread.join(timeout=30)


async def _serve(port: int) -> None:
    from trainyard_cli import infra

    with tempfile.TemporaryDirectory(prefix="trainyard-api-") as tmp:
        root = Path(tmp)
        broker = infra.start_broker(infra.free_port(), root / "broker.log")
        redis = infra.start_redis(infra.free_port(), root / "redis", root / "redis.log")
        try:
            env = {"kafka_bootstrap": broker.address, "redis_url": redis.address, "artifact_root": root / "artifacts",
                   "topic_partitions": 1}
            async with running_api(env, admin=True, history=True, api_port=port) as api:
                print(f"API {api.url}  (schema {api.url}/openapi.json)\ntokens: {TOKEN_A} (tenant-a), "
                      f"{TOKEN_B} (tenant-b), {TOKEN_ADMIN} (admin)", flush=True)
                stop = asyncio.Event()
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
                await stop.wait()
        finally:
            redis.stop()
            broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
