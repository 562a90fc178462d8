"""The lifecycle every trainyard service shares.

    runtime = ServiceRuntime("scheduler", settings)
    runtime.bus.subscribe(...); runtime.add_loop("tick", tick, every_s=1.0)
    await runtime.run()          # start → wait for SIGTERM/SIGINT → aclose

Every service process runs the same :func:`serve_until_signalled` over a :class:`Lifecycle` (``start()``
then ``aclose()``): the runtime itself, or a part that owns one (the API's HTTP server, the node agent).

start: logging, tracing, Redis ping, topics, subscriptions, outbox relay, health beacon,
background loops. aclose (idempotent): stop loops, stop the broker, flush traces, close
Redis. Background loops log and back off; one failure never kills them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from redis.exceptions import RedisError

from trainyard_runtime.bus import Bus, Deduper, KafkaAuth, ensure_topics
from trainyard_contract.errors import StateStoreError, TrainyardError
from trainyard_runtime.idlefetch import Doorbell, IdlePolicy
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.retry import Backoff, RetryPolicy
from trainyard_contract.settings import ServiceSettings, redacted

from trainyard_runtime.store import Keys, StateStore, connect_redis
from trainyard_contract.tracing import setup_tracing, shutdown_tracing

S = TypeVar("S", bound=ServiceSettings)
log = logging.getLogger(__name__)


class Lifecycle(Protocol):
    """What a service process runs: ``start()`` (may raise: the process exits 2), then ``aclose()`` (idempotent,
    also after a failed start)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


async def serve_until_signalled(service: Lifecycle, name: str, stop: asyncio.Event, *,
                                ended: Callable[[], Awaitable[object] | None] | None = None) -> None:
    """Start ``service``; serve until SIGTERM/SIGINT sets ``stop`` (or what ``ended()`` returns after the start
    completes, e.g. an HTTP server's task); then close it, whatever happened."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        stopped = asyncio.ensure_future(stop.wait())
        other = ended() if ended is not None else None
        waiting = {stopped} | ({asyncio.ensure_future(other)} if other is not None else set())
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        log.info("%s stopping", name)
    finally:
        await service.aclose()


def configure_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("faststream"):
            logging.getLogger(name).setLevel(logging.WARNING)


class ServiceRuntime:
    """Redis + bus + outbox + loops for one service process."""

    def __init__(self, name: str, settings: ServiceSettings, *, outbox_name: str | None = None) -> None:
        self.name = name
        self.settings = settings
        self.instance = settings.instance_id or f"{socket.gethostname()}:{os.getpid()}"
        self.redis = connect_redis(settings.redis_url)
        self.store = StateStore(self.redis)
        self.bus = Bus(
            settings.kafka_bootstrap,
            service_name=name,
            group_prefix=settings.group_prefix,
            topic_namespace=settings.topic_namespace,
            session_timeout_ms=settings.consumer_session_timeout_ms,
            fetch_max_wait_ms=settings.consumer_fetch_max_wait_ms,
            background_fetch_max_wait_ms=settings.consumer_background_fetch_max_wait_ms,
            auth=KafkaAuth.from_settings(settings),
            idle=(IdlePolicy(pause_s=settings.consumer_idle_pause_s, poll_s=settings.consumer_idle_poll_s)
                  if settings.consumer_idle_pause_s else None),
            doorbell=Doorbell(self.redis) if settings.consumer_idle_pause_s else None,
        )
        # One outbox per writer identity: instances of a per-node service must not relay each other's.
        self.outbox = Outbox(self.redis, outbox_name or name)
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._loops: list[tuple[str, Callable[[], Awaitable[None]], float, asyncio.Event | None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._closed = False
        self._started = False
        self._metrics_server: Any = None  # metrics_server.serve's, while the metrics port is open
        self._reported_stuck = True  # a previous process of this instance may have left the key: delete it once

    def deduper(self, group: str) -> Deduper:
        return Deduper(self.redis, self.name, group)

    def add_loop(self, name: str, fn: Callable[[], Awaitable[None]], every_s: float, *,
                 wake: asyncio.Event | None = None) -> None:
        """Run ``fn`` every ``every_s`` seconds once started — or as soon as ``wake`` is set
        (it is cleared before each run, so a wake-up during a run causes one more run)."""
        self._loops.append((name, fn, every_s, wake))

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        setup_tracing(f"trainyard-{self.name}", instance_id=self.instance)
        try:
            await self.redis.ping()
        except (RedisError, OSError) as exc:
            raise StateStoreError(f"cannot reach Redis at {redacted(self.settings.redis_url)}: {exc!r}") from exc
        if self.settings.create_topics:
            await ensure_topics(
                self.settings.kafka_bootstrap,
                partitions=self.settings.topic_partitions,
                replication=self.settings.topic_replication,
                namespace=self.settings.topic_namespace,
                auth=KafkaAuth.from_settings(self.settings),
            )
        await self.bus.start()
        if self.settings.metrics_port:
            from trainyard_runtime import metrics_server

            token = self.settings.metrics_token
            self._metrics_server = metrics_server.serve(
                self.settings.metrics_port, addr=self.settings.metrics_addr,
                token=token.get_secret_value() if token else None)
        self._spawn("outbox-relay", self.outbox.relay_forever(self.bus))
        self._spawn("health", self._periodic("health", self._beacon, self.settings.health_interval_s))
        for name, fn, every_s, wake in self._loops:
            self._spawn(name, self._periodic(name, fn, every_s, wake))
        log.info("%s started (instance %s)", self.name, self.instance)

    def _spawn(self, name: str, coro: Awaitable[None]) -> None:
        self._tasks.append(asyncio.create_task(coro, name=f"{self.name}:{name}"))  # type: ignore[arg-type]  # a coroutine

    async def _beacon(self) -> None:
        """The liveness key, and beside it the consumers stuck on one record (read by the API's ``/healthz``)."""
        ttl = max(int(self.settings.health_interval_s * 5), 5)
        await self.redis.set(Keys.health(self.name, self.instance), str(os.getpid()), ex=ttl)
        stuck = self.bus.stuck()
        if stuck:
            await self.redis.set(Keys.stuck(self.name, self.instance),
                                 json.dumps([s.as_dict() for s in stuck]), ex=ttl)
        elif self._reported_stuck:
            await self.redis.delete(Keys.stuck(self.name, self.instance))
        self._reported_stuck = bool(stuck)

    async def _periodic(self, name: str, fn: Callable[[], Awaitable[None]], every_s: float,
                        wake: asyncio.Event | None = None) -> None:
        # after a failure: twice the period, doubling up to 30 s
        backoff = Backoff(RetryPolicy(initial_interval_s=2 * every_s, maximum_interval_s=30.0))
        while True:
            try:
                if wake is not None:
                    wake.clear()
                await fn()
                backoff.succeeded()
                if wake is None:
                    await asyncio.sleep(every_s)
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(every_s):
                            await wake.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - loops back off, never die
                delay = backoff.failed()
                level = logging.WARNING if isinstance(exc, TrainyardError) and exc.retryable else logging.ERROR
                log.log(level, "%s loop %r failed (%d in a row), retry in %.1fs: %r",
                        self.name, name, backoff.failures, delay, exc, exc_info=level == logging.ERROR)
                await asyncio.sleep(delay)

    def add_closer(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` first when closing (before loops and the bus stop), e.g. to stop child processes."""
        self._closers.append(fn)

    async def run(self) -> None:
        """Start, then serve until SIGTERM or SIGINT, then close (:func:`serve_until_signalled`)."""
        await serve_until_signalled(self, self.name, self._stopping)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.bus.stopping = True
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception:  # noqa: BLE001 - closing goes on whatever one step does
                log.exception("%s: closer %r failed", self.name, closer)
        for task in self._tasks:
            task.cancel()
        await _bounded(asyncio.gather(*self._tasks, return_exceptions=True), 10.0, f"{self.name} loops")
        # faststream's stop waits for in-flight handlers; a stuck one must not hang shutdown
        # (its message stays uncommitted and is re-delivered: at-least-once holds).
        await _bounded(self.bus.aclose(), 15.0, f"{self.name} broker connection")
        try:
            await self.redis.delete(Keys.health(self.name, self.instance), Keys.stuck(self.name, self.instance))
        except (RedisError, OSError):
            pass
        await self.redis.aclose()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        shutdown_tracing()

    async def __aenter__(self) -> ServiceRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _bounded(aw: Awaitable[object], timeout_s: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await aw
    except TimeoutError:
        log.warning("closing %s took over %.0fs; abandoned", what, timeout_s)


def service_main(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    settings_cls: type[S],
    serve: Callable[[S], Awaitable[None]],
    service: str,
) -> None:
    """The ``main()`` of every service: ``--help`` lists the variables; settings are parsed once;
    a bad variable or an unreachable dependency at start-up exits 2 with a message."""
    import argparse

    from trainyard_contract.settings import load_settings, settings_help

    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=settings_help(settings_cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = load_settings(settings_cls)
    except TrainyardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(getattr(settings, "log_level", "INFO"), service)
    run_main(lambda: serve(settings))


def run_main(coro_factory: Callable[[], Awaitable[None]]) -> None:
    """Entry point helper: run the service; a TrainyardError at start-up exits 2 with its message."""
    try:
        asyncio.run(coro_factory())  # type: ignore[arg-type]  # the factory returns a coroutine
    except TrainyardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        pass
