"""Queue policy: tenants, quotas, priority classes, fair-share weights, aging and preemption.

Written as YAML or JSON (JSON is YAML), camelCase keys; read from the file named by
``TRAINYARD_QUEUE_CONFIG`` and, when present, from the Redis key ``ty:sched:queue-config``
(which wins, so an admin can change it without a restart). Without either, every tenant has
unlimited quota and the default priority classes apply.

A tenant's own settings (one ``TenantConfig`` JSON per tenant in the hash ``ty:sched:tenant-config``,
which ``PATCH /v1/admin/tenants/{tenant}`` writes) win over the document's entry for it: the document's
``tenants`` are only the seed, written into the hash for a tenant that has no entry there yet
(:func:`tenant_seeds`, :func:`with_tenant_settings`). Example::

    priorityClasses:              # a job's class: the highest whose value <= its priority
      - {name: low, value: -100}
      - {name: normal, value: 0}
      - {name: high, value: 100}
      - {name: critical, value: 1000}
    tenants:
      research:
        cohort: lab               # tenants of one cohort share the cohort's limits
        weight: 2                 # fair-share weight (DRF): twice the share of a weight-1 tenant
        maxPriority: 100          # a higher spec.priority is lowered to this
        quotas:
          h100-80gb: {guaranteed: 512, borrowLimit: 256}
          "*": {guaranteed: 0}    # every other device type: borrow only
    defaultTenant:                # tenants not listed
      quotas: {"*": {guaranteed: 0, borrowLimit: 64}}
    cohorts:
      lab: {limits: {h100-80gb: 1024}}
    aging: {everySeconds: 3600, step: 10}     # +10 priority per hour waited (ordering only)
    preemption: {enabled: true, checkpointGraceSeconds: 300, maxPerPass: 2, minRuntimeSeconds: 600}
    backfill: true

Semantics (in the spirit of Kueue cohorts): ``guaranteed`` devices are the tenant's own — when
it wants them back, jobs of tenants running above their guarantee are preempted (reclaim).
Above its guarantee a tenant *borrows* idle capacity, at most ``borrowLimit`` more
(``null`` = no limit); borrowed devices can be reclaimed. ``guaranteed: null`` means unlimited
(the default). A cohort's ``limits`` cap what its members use together.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from trainyard_contract.errors import ConfigError
from trainyard_contract.records import is_deleted_tenant

UNLIMITED = 1 << 62


class _Cfg(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class QuotaConfig(_Cfg):
    guaranteed: int | None = Field(default=None, ge=0, description="devices reserved to the tenant; null = unlimited")
    borrow_limit: int | None = Field(default=None, ge=0,
                                     description="devices above guaranteed it may borrow; null = no limit")


class TenantConfig(_Cfg):
    cohort: str = "default"
    weight: float = Field(default=1.0, gt=0, description="fair-share weight")
    max_priority: int | None = Field(default=None, description="spec.priority is capped at this")
    quotas: dict[str, QuotaConfig] = Field(default_factory=dict, description="device type (or '*') -> quota")


class CohortConfig(_Cfg):
    limits: dict[str, int] = Field(default_factory=dict, description="device type (or '*') -> combined cap")


class PriorityClass(_Cfg):
    name: str
    value: int


class AgingConfig(_Cfg):
    every_seconds: float = Field(default=3600.0, gt=0)
    step: int = Field(default=10, ge=0, description="priority added per everySeconds waited (ordering only)")
    max_boost: int | None = Field(default=None, ge=0, description="cap on the boost; null = none (nothing starves)")


class PreemptionConfig(_Cfg):
    enabled: bool = True
    checkpoint_grace_seconds: float = Field(
        default=300.0, ge=0, description="how long a victim may take to write a READY checkpoint before it is revoked"
    )
    max_per_pass: int = Field(default=2, ge=0, description="new preemptions one scheduling pass may start")
    min_runtime_seconds: float = Field(
        default=600.0, ge=0, description="a job that started less than this ago is not preempted (no thrash)"
    )


DEFAULT_CLASSES = (
    PriorityClass(name="low", value=-100),
    PriorityClass(name="normal", value=0),
    PriorityClass(name="high", value=100),
    PriorityClass(name="critical", value=1000),
)


class QueueConfig(_Cfg):
    """The whole queue policy (see the module docstring)."""

    priority_classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    default_tenant: TenantConfig = TenantConfig()
    cohorts: dict[str, CohortConfig] = Field(default_factory=dict)
    aging: AgingConfig = AgingConfig()
    preemption: PreemptionConfig = PreemptionConfig()
    backfill: bool = True
    reservations: int = Field(
        default=1, ge=1, le=64,
        description="blocked jobs per device type, in queue order, whose start is protected by a reservation")

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name, self.default_tenant)

    def quota(self, tenant: str, kind: str) -> QuotaConfig:
        quotas = self.tenant(tenant).quotas
        return quotas.get(kind) or quotas.get("*") or QuotaConfig()

    def guaranteed(self, tenant: str, kind: str) -> int:
        g = self.quota(tenant, kind).guaranteed
        return UNLIMITED if g is None else g

    def cap(self, tenant: str, kind: str) -> int:
        """The most ``kind`` devices the tenant may hold: guaranteed + borrow limit."""
        q = self.quota(tenant, kind)
        if q.guaranteed is None or q.borrow_limit is None:
            return UNLIMITED
        return q.guaranteed + q.borrow_limit

    def cohort_limit(self, cohort: str, kind: str) -> int:
        cfg = self.cohorts.get(cohort)
        if cfg is None:
            return UNLIMITED
        return cfg.limits.get(kind, cfg.limits.get("*", UNLIMITED))

    def priority(self, tenant: str, requested: int) -> int:
        """The job's base priority: its spec's, capped by the tenant's ``maxPriority``."""
        top = self.tenant(tenant).max_priority
        return requested if top is None else min(requested, top)

    def class_of(self, priority: int) -> str:
        """The highest class whose value is at most ``priority`` (the lowest class otherwise)."""
        classes = sorted(self.priority_classes, key=lambda c: c.value)
        if not classes:
            return "default"
        chosen = classes[0].name
        for c in classes:
            if c.value <= priority:
                chosen = c.name
        return chosen

    def boost(self, waited_s: float) -> int:
        """Aging: priority added after waiting ``waited_s`` (ordering only, never preemption rights)."""
        if waited_s <= 0 or not self.aging.step:
            return 0
        boost = int(waited_s // self.aging.every_seconds) * self.aging.step
        return boost if self.aging.max_boost is None else min(boost, self.aging.max_boost)


def parse_queue_config(text: str, *, source: str = "queue config") -> QueueConfig:
    """YAML or JSON text → :class:`QueueConfig`; a bad document raises ConfigError naming the field."""
    try:
        import yaml

        data: Any = yaml.safe_load(text) if text.strip() else {}
    except Exception as exc:  # noqa: BLE001 - yaml's errors have no common useful base
        raise ConfigError(f"{source}: not valid YAML/JSON: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return QueueConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{source}: {problems}") from exc


def tenant_seeds(config: QueueConfig, stored: Collection[str]) -> dict[str, str]:
    """The tenants of ``config`` with no stored settings, as the JSON to store for each (pure)."""
    return {name: json.dumps(tenant.model_dump(mode="json", by_alias=True))
            for name, tenant in config.tenants.items() if name not in stored}


def with_tenant_settings(config: QueueConfig, stored: Mapping[str, str]) -> tuple[QueueConfig, list[str]]:
    """``config`` with each stored tenant's settings in place of its own entry, and a problem for each stored
    entry that is not a valid TenantConfig (that tenant keeps ``config``'s entry) (pure)."""
    tenants, problems = dict(config.tenants), []
    for name, raw in sorted(stored.items()):
        if is_deleted_tenant(raw):  # deleted through the API: the document's entry no longer applies
            tenants.pop(name, None)
            continue
        try:
            tenants[name] = TenantConfig.model_validate_json(raw)
        except ValidationError as exc:
            problems.append(f"tenant {name!r}: {exc.errors()[0]['msg']} at "
                            f"{'.'.join(str(p) for p in exc.errors()[0]['loc']) or 'the top'}")
    return (config if tenants == config.tenants else config.model_copy(update={"tenants": tenants})), problems


def dump_queue_config(config: QueueConfig) -> str:
    """As JSON (what the Redis key holds)."""
    return json.dumps(config.model_dump(mode="json", by_alias=True, exclude_defaults=True))
