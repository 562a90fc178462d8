"""trainyard_common: the event contract, bus wiring, leases, tracing, settings and storage
shared by every trainyard service and by the trainer.

Exports are resolved lazily so a torch rank that only needs the event models does not pay
for importing the broker client.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Bus": "trainyard_common.bus",
    "Deduper": "trainyard_common.bus",
    "ensure_topics": "trainyard_common.bus",
    "TrainyardError": "trainyard_common.errors",
    "Outbox": "trainyard_common.outbox",
    "ServiceRuntime": "trainyard_common.service",
    "configure_logging": "trainyard_common.service",
    "run_main": "trainyard_common.service",
    "ServiceSettings": "trainyard_common.settings",
    "load_settings": "trainyard_common.settings",
    "settings_help": "trainyard_common.settings",
    "TrainingSpec": "trainyard_common.spec",
    "Keys": "trainyard_common.store",
    "StateStore": "trainyard_common.store",
    "connect_redis": "trainyard_common.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'trainyard_common' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), name)
