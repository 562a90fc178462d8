"""One API process: uvicorn serving the FastAPI app next to a ServiceRuntime.

The runtime brings Redis, the bus, the outbox relay (which publishes JobSubmitted and
JobControlRequested, NodeReinstated), the consumer of ``trainyard.metrics`` (progress, which also
samples the planner's calibration; per-rank timing; rank 0's step ledger for goodput), the consumer
of StragglerDetected on ``trainyard.workers``, the consumer of ArtifactRegistered on ``trainyard.registry``
(group ``api-triggers``: new dataset versions start the jobs of the triggers that match), the calibration refit loop and the goodput gauges loop. The listening
socket is bound before anything else, so a taken port is a clear error at once.
SIGTERM/SIGINT: stop accepting, finish in-flight requests, then close the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from trainyard_common.errors import ConfigError, InfrastructureError
from trainyard_common.events import METRICS, WORKERS, StepMetrics, StragglerDetected
from trainyard_common.service import ServiceRuntime

from trainyard_api.accounting import GoodputAccountant
from trainyard_api.app import ApiContext, create_app
from trainyard_api.calibrator import Calibrator
from trainyard_api.progress import ProgressProjector
from trainyard_api.settings import ApiSettings
from trainyard_api.steptiming import StepTimingStore
from trainyard_api.tenants import bootstrap_admin
from trainyard_api.triggers import TriggerFiring, TriggerStore

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; ConfigError saying what to do when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
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
        self.runtime = ServiceRuntime("api", settings)
        self.calibrator = Calibrator(self.runtime.store, settings)
        self.projector = ProgressProjector(self.runtime.redis, calibrator=self.calibrator)
        self.timing = StepTimingStore(self.runtime.redis, max_points=settings.goodput_max_points)
        self.accounting = GoodputAccountant(self.runtime.store, self.timing)
        self.runtime.bus.subscribe(METRICS, {StepMetrics: self.on_step_metrics})
        self.runtime.bus.subscribe(WORKERS, {StragglerDetected: self.timing.on_straggler})
        self.runtime.add_loop("calibration", self.calibrator.refresh, every_s=settings.calibration_refresh_s)
        self.runtime.add_loop("goodput", self.accounting.refresh, every_s=settings.goodput_refresh_s)
        self.context = ApiContext(settings, self.runtime.store, self.runtime.outbox, self.runtime.bus)
        self.triggers = TriggerFiring(TriggerStore(self.runtime.redis), lambda: self.context.jobs)
        self.triggers.install(self.runtime)
        self.app = create_app(self.context)
        self._server: _EmbeddedServer | None = None
        self._serving: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._closed = False
        self.port: int | None = None

    async def on_step_metrics(self, m: StepMetrics) -> None:
        """Every rank's timing breakdown and rank 0's step ledger, then rank 0's progress."""
        await self.timing.on_step_metrics(m)
        await self.projector.on_step_metrics(m)

    @property
    def url(self) -> str:
        return f"http://{self.settings.api_host}:{self.port or self.settings.api_port}"

    async def start(self) -> None:
        sock = bind_socket(self.settings.api_host, self.settings.api_port)
        self.port = sock.getsockname()[1]
        if self.settings.api_port == 0:  # Location headers must carry the real port
            self.context.settings = self.settings.model_copy(update={"api_port": self.port})
        try:
            await self.runtime.start()
            await self._maybe_bootstrap()
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
        log.info("api listening on %s (public URL %s)", self.url, self.context.settings.public_url)

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

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT (or the HTTP server ends), then close."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            assert self._serving is not None
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait({stop, self._serving}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            log.info("api stopping")
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._serving
        await self.runtime.aclose()

    async def __aenter__(self) -> ApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
