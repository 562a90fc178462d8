"""Preparing a job's environment (``code.environment``) for its ranks on this node, and saying so: the plan (the
lock read from the verified code tree, layered over the base), the environment from the cache or built into it,
and an :class:`~trainyard_contract.events.EnvironmentPreparing` for the job as it goes — ``building`` with the
installer's latest line (at most every ``progress_s``, and at least every ``keepalive_s`` while nothing new is
printed: each one restarts the attempt's start time-out; every node of a large gang sends them, and each is a write
of the job's record, so they stay seconds apart), then ``ready`` (``cached`` when nothing was built) or
``failed`` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from trainyard_contract.errors import ConfigError
from trainyard_contract.events import EnvironmentPreparing, Event, GangAllocated
from trainyard_contract.spec import Environment

from trainyard_node_agent.envcache import EnvCache, EnvPlan
from trainyard_node_agent.sealedcache import Sealed

log = logging.getLogger(__name__)

Publish = Callable[[Event], Awaitable[None]]


@dataclass(frozen=True)
class Prepared:
    """The job's environment, verified and pinned in the cache until released."""

    entry: Sealed
    plan: EnvPlan

    @property
    def environment(self) -> str:
        return self.plan.environment


class EnvironmentPreparer:
    """Plans, builds or finds, and reports one job's environment on this node."""

    def __init__(self, cache: EnvCache, publish: Publish, *, node_id: str, progress_s: float = 5.0,
                 keepalive_s: float = 30.0) -> None:
        self.cache, self.publish, self.node_id = cache, publish, node_id
        self.progress_s, self.keepalive_s = progress_s, keepalive_s

    async def prepare(self, event: GangAllocated, environment: Environment, tree: Sealed) -> Prepared:
        """The environment, ready to run. ConfigError (the job's fault: reported ``failed``) or OSError (this
        node's: reported ``failed`` too) when it cannot be had."""
        started = time.monotonic()
        try:
            plan = await asyncio.to_thread(self.cache.plan, environment, tree.root)
        except ConfigError as exc:
            await self._say(event, environment.sha256 or environment.lock, "failed", started, detail=str(exc))
            raise
        reporter = _Reporter()
        ticker = None
        if not self.cache.cached(plan.hex):
            await self._say(event, plan.environment, "building", started, packages=plan.packages,
                            detail=f"installing {len(plan.pins)} package(s) over the node's base")
            ticker = asyncio.create_task(self._tick(event, plan, started, reporter))
        loop = asyncio.get_running_loop()

        def progress(line: str) -> None:  # from the build's thread
            loop.call_soon_threadsafe(reporter.note, line)

        try:
            entry = await self.cache.acquire(plan, progress)
        except (ConfigError, OSError) as exc:
            if ticker is not None:
                ticker.cancel()
            await self._say(event, plan.environment, "failed", started, packages=plan.packages, detail=str(exc))
            raise
        finally:
            if ticker is not None:
                ticker.cancel()
        await self._say(event, plan.environment, "ready", started, packages=plan.packages,
                        cached=not entry.materialised,
                        detail=None if not entry.materialised else reporter.line)
        log.info("environment %s of job %s: %s (%d package(s))", plan.environment, event.job_id,
                 "built" if entry.materialised else "cached", plan.packages)
        return Prepared(entry, plan)

    def release(self, prepared: Prepared) -> None:
        self.cache.release(prepared.entry.hex)

    async def _tick(self, event: GangAllocated, plan: EnvPlan, started: float, reporter: _Reporter) -> None:
        """While building: the installer's new lines (throttled), and a keep-alive when it prints nothing."""
        sent, sent_at = reporter.line, time.monotonic()
        while True:
            await asyncio.sleep(self.progress_s)
            now = time.monotonic()
            if reporter.line != sent or now - sent_at >= self.keepalive_s:
                sent, sent_at = reporter.line, now
                await self._say(event, plan.environment, "building", started, packages=plan.packages, detail=sent)

    async def _say(self, event: GangAllocated, environment: str, state: Literal["building", "ready", "failed"],
                   started: float, *, packages: int = 0, cached: bool = False, detail: str | None = None) -> None:
        try:
            await self.publish(EnvironmentPreparing(
                job_id=event.job_id, attempt=event.attempt, allocation_id=event.allocation_id, epoch=event.epoch,
                node_id=self.node_id, environment=environment, state=state, cached=cached, packages=packages,
                elapsed_seconds=round(time.monotonic() - started, 3), detail=detail[:2000] if detail else None))
        except Exception as exc:  # noqa: BLE001 - progress is best effort; the ranks' exits carry the outcome
            log.warning("could not publish the environment progress of job %s: %r", event.job_id, exc)


class _Reporter:
    """The installer's latest line (set from the event loop)."""

    def __init__(self) -> None:
        self.line: str | None = None

    def note(self, line: str) -> None:
        self.line = line
