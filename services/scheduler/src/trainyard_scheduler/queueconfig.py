"""Where the queue policy comes from: the document in Redis (wins) or the file, then each tenant's own settings.

The parsing and merging are pure (:mod:`trainyard_scheduler.policy`); this module reads them, seeds the tenants'
settings hash from the document and keeps the last good document when the current one cannot be read. Leader and
standbys load it alike (the standbys at ``reconcile_interval_s``), so a takeover starts with the policy in force.
"""

from __future__ import annotations

import logging
from pathlib import Path

from redis.asyncio import Redis

from trainyard_contract.errors import ConfigError

from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.policy import QueueConfig, parse_queue_config, tenant_seeds, with_tenant_settings

log = logging.getLogger(__name__)


class QueueConfigSource:
    """The queue policy in force (:attr:`config`), reloaded by :meth:`load`."""

    def __init__(self, redis: Redis, path: str | Path | None) -> None:
        self.redis, self.path = redis, path
        self.config = QueueConfig()
        self._base = QueueConfig()  # the last good queue-config document, before tenants' own settings
        self._source: str | None = None

    async def load(self) -> QueueConfig:
        """The queue policy: the document from Redis (wins) or the file (a bad one is logged and the last good
        kept), then each tenant's own settings from ``ty:sched:tenant-config`` over it — the document's
        tenants seed that hash for tenants without an entry (see policy.py)."""
        base, source = await self._document()
        stored: dict[str, str] = await self.redis.hgetall(SchedulerKeys.tenant_config)  # type: ignore[assignment]  # decoded: str
        seeds = tenant_seeds(base, stored)
        for tenant, doc in seeds.items():
            await self.redis.hsetnx(SchedulerKeys.tenant_config, tenant, doc)
        if seeds:
            log.info("seeded the settings of tenant(s) %s from %s", ", ".join(sorted(seeds)), source)
            stored = await self.redis.hgetall(SchedulerKeys.tenant_config)  # type: ignore[assignment]  # decoded: str
        config, problems = with_tenant_settings(base, stored)
        for problem in problems:
            log.error("ignoring unreadable stored settings of %s", problem)
        if config != self.config or source != self._source:
            log.info("queue config from %s and %d stored tenant setting(s): %d tenant(s), %d priority class(es)",
                     source, len(stored), len(config.tenants), len(config.priority_classes))
        self.config, self._source = config, source
        return config

    async def _document(self) -> tuple[QueueConfig, str | None]:
        """The queue-config document (Redis key, else the file, else the defaults); the last good one when the
        current one cannot be read or parsed."""
        text: str | None = await self.redis.get(SchedulerKeys.queue_config)  # type: ignore[assignment]  # decoded: str
        source = f"redis {SchedulerKeys.queue_config}"
        if text is None and self.path is not None:
            path = Path(self.path)
            try:
                text, source = path.read_text(), str(path)
            except OSError as exc:
                log.error("cannot read the queue config %s: %r", path, exc)
                return self._base, self._source
        if text is None:
            self._base = QueueConfig()
            return self._base, None
        try:
            self._base = parse_queue_config(text, source=source)
        except ConfigError as exc:
            log.error("keeping the previous queue config: %s", exc)
            return self._base, self._source
        return self._base, source
