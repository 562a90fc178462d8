"""One API process: uvicorn serving the FastAPI app next to a ServiceRuntime.

The API answers: commands (writing records, and the events they announce through the outbox relay) and
queries (reading the records and the read models). It ingests no stream into a read model: the telemetry
service (``trainyard_telemetry``) keeps every StepMetrics read model, and the routes read their keys with
:mod:`trainyard_telemetry.readmodels`. What the process still consumes runs in every process alike: its
outbox relay (JobSubmitted, JobControlRequested, NodeReinstated…), the ArtifactRegistered consumer of the
triggers (group ``api-triggers``, shared: Kafka gives each event to one process of the group) and the
live-updates hub (a consumer group of its own per process, see live.py). The listening socket is bound
before anything else, so a taken port is a clear error at once.
SIGTERM/SIGINT: stop accepting, finish in-flight requests, then close the runtime.

With ``api_workers`` > 1 this process also starts that many minus one HTTP workers (``python -m
trainyard_api`` with ``api_worker_index``): equal processes, each binding its own socket on the one port
(SO_REUSEPORT; the kernel spreads new connections over them, and no descriptor is handed down) and running
exactly what this process runs, each with its own outbox (``ty:outbox:api-w<i>``, relayed by that worker; a
worker restarted under the same index relays what its predecessor left). The index names the outbox, which
is why this process starts the others rather than uvicorn's ``--workers`` (whose workers have no stable
identity to relay a dead predecessor's outbox by); it is their only difference. What a request reads and writes
is in Redis, so any worker answers any request alike, idempotency keys included (the job id derives from
the key; the record is created under WATCH). A worker that exits is started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from trainyard_contract.errors import ConfigError, InfrastructureError
from trainyard_contract.settings import settings_env
from trainyard_runtime.service import ServiceRuntime, serve_until_signalled
from trainyard_telemetry.readmodels import MetricHistory

from trainyard_api.app import ApiContext, create_app
from trainyard_api.experiment_driver import ExperimentDriver
from trainyard_api.live import LiveHub
from trainyard_api.routes.dashboard import job_summaries
from trainyard_api.settings import ApiSettings
from trainyard_api.tenants import bootstrap_admin
from trainyard_api.triggers import TriggerFiring, TriggerStore

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """A bound, listening TCP socket; ConfigError saying what to do when the port is taken.

    SO_REUSEADDR only for a named port (a restarted API takes its port back at once). Port 0 goes without it:
    with it the kernel may hand out an ephemeral port that a client connection also holds, and listen()
    then fails with EADDRINUSE after the bind succeeded. ``shared``: SO_REUSEPORT, so that the API's HTTP
    workers, each binding its own socket, share the port (the kernel spreads new connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP, and
    # with Nagle on, a response written as headers then body waited for the client's delayed ACK: ~40 ms a request
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if port != 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # here, so a taken port is this clear error and not uvicorn's
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"the API cannot listen on {host}:{port}: {exc.strerror or exc}. If another process "
            f"(perhaps an API that is already running) holds the port, stop it "
            f"(`ss -ltnp 'sport = :{port}'` shows it) or choose another with TRAINYARD_API_PORT=<port>"
        ) from exc
    sock.set_inheritable(False)
    return sock


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the ApiServer owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer:
    """``start()`` binds, starts the runtime and serves; ``aclose()`` (idempotent) stops both."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self.primary = settings.api_worker_index == 0
        self.runtime = ServiceRuntime("api", settings,
                                      outbox_name=None if self.primary else f"api-w{settings.api_worker_index}")
        self.context = ApiContext(settings, self.runtime.store, self.runtime.outbox, self.runtime.bus)
        self.triggers = TriggerFiring(TriggerStore(self.runtime.redis), lambda: self.context.jobs)
        self.triggers.install(self.runtime)  # in every process: the group shares the events out
        if self.primary:  # the supervisor of the other HTTP workers
            self.runtime.add_loop("http-workers", self._keep_workers, every_s=1.0)
        self._workers: dict[int, subprocess.Popen[bytes]] = {}
        self._sock: socket.socket | None = None
        self.history = MetricHistory(self.runtime.redis)
        self.experiments = ExperimentDriver(self.runtime.redis, self.history.raw, lambda: self.context.jobs,
                                            self.runtime.instance)
        self.experiments.install(self.runtime)  # in every process: a lease per experiment picks its driver
        self.live = LiveHub(lambda ids: job_summaries(self.runtime.redis, ids))
        self.live.install(self.runtime.bus)
        self.app = create_app(self.context)
        self.app.state.live, self.app.state.history = self.live, self.history
        self._server: _EmbeddedServer | None = None
        self._serving: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._closed = False
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.settings.api_host}:{self.port or self.settings.api_port}"

    async def start(self) -> None:
        # every HTTP worker binds its own socket on the one port (SO_REUSEPORT): no descriptor is handed down
        sock = bind_socket(self.settings.api_host, self.settings.api_port, shared=self.settings.api_workers > 1)
        self._sock = sock
        self.port = sock.getsockname()[1]
        if self.settings.api_port == 0:  # Location headers must carry the real port
            self.context.settings = self.settings.model_copy(update={"api_port": self.port})
        try:
            await self.runtime.start()
            await self._maybe_bootstrap()
            self.live.start()
            config = uvicorn.Config(
                self.app, log_config=None, access_log=self.settings.api_access_log, lifespan="off",
                server_header=False, timeout_graceful_shutdown=10,
            )
            self._server = _EmbeddedServer(config)
            self._serving = asyncio.create_task(self._server.serve(sockets=[sock]), name="api:http")
            await self._wait_started()
        except BaseException:
            sock.close()
            await self.aclose()
            raise
        if self.primary:
            self._keep_workers_now()
        log.info("api %slistening on %s (public URL %s)",
                 "" if self.primary else f"HTTP worker {self.settings.api_worker_index} ", self.url,
                 self.context.settings.public_url)

    # ------------------------------------------------------------------ HTTP workers
    @property
    def worker_pids(self) -> dict[int, int]:
        """index → pid of the HTTP workers running now (not this process)."""
        return {i: p.pid for i, p in self._workers.items() if p.poll() is None}

    async def _keep_workers(self) -> None:
        self._keep_workers_now()

    def _keep_workers_now(self) -> None:
        """Start the HTTP workers that are not running (at start, and again when one exited)."""
        if self._sock is None or self._closed:
            return
        for index in range(1, self.settings.api_workers):
            proc = self._workers.get(index)
            if proc is not None and proc.poll() is None:
                continue
            if proc is not None:
                log.warning("API HTTP worker %d exited with %s; starting it again", index, proc.returncode)
            env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
            env.update(settings_env(self.settings))  # this process's settings, however they were given
            env.update({"TRAINYARD_API_WORKER_INDEX": str(index), "TRAINYARD_API_PORT": str(self.port)})
            for primary_only in ("TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE", "TRAINYARD_METRICS_PORT"):
                env.pop(primary_only, None)
            self._workers[index] = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-m", "trainyard_api"], env=env, stdin=subprocess.DEVNULL)

    async def _stop_workers(self, timeout_s: float = 15.0) -> None:
        for proc in self._workers.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(p.poll() is None for p in self._workers.values()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for proc in self._workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    async def _maybe_bootstrap(self) -> None:
        """The first platform-admin token, into TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE, when none exists."""
        path = self.settings.api_bootstrap_admin_token_file
        if path is None:
            return
        try:
            await bootstrap_admin(self.runtime.store, Path(path).expanduser(), self.settings.api_bootstrap_admin_tenant)
        except OSError as exc:
            raise ConfigError(f"cannot write the bootstrap admin token to {path} "
                              f"(TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE): {exc.strerror or exc}") from exc

    async def _wait_started(self, timeout_s: float = 30.0) -> None:
        assert self._server is not None and self._serving is not None
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises what stopped it
                raise InfrastructureError("the HTTP server stopped while starting", retryable=False)
            if asyncio.get_running_loop().time() > deadline:
                raise InfrastructureError(f"the HTTP server did not start within {timeout_s:.0f}s")
            await asyncio.sleep(0.02)

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT (or the HTTP server ends), then close: the services' one lifecycle
        (:func:`~trainyard_runtime.service.serve_until_signalled`)."""
        await serve_until_signalled(self, "api", self._stop, ended=lambda: self._serving)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._stop_workers()
        await self.live.aclose()  # ends the event streams, so the HTTP server's graceful stop is not held
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._serving
        await self.runtime.aclose()
        await self.history.aclose()

    async def __aenter__(self) -> ApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
