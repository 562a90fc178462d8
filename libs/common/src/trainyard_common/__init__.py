"""trainyard_common: the event contract, bus wiring, leases, tracing, settings and storage
shared by every trainyard service and by the trainer."""

from trainyard_common.bus import Bus, Deduper, ensure_topics
from trainyard_common.errors import TrainyardError
from trainyard_common.outbox import Outbox
from trainyard_common.service import ServiceRuntime, configure_logging, run_main
from trainyard_common.settings import ServiceSettings, load_settings
from trainyard_common.spec import TrainingSpec
from trainyard_common.store import Keys, StateStore, connect_redis

__all__ = [
    "Bus",
    "Deduper",
    "Keys",
    "Outbox",
    "ServiceRuntime",
    "ServiceSettings",
    "StateStore",
    "TrainingSpec",
    "TrainyardError",
    "configure_logging",
    "connect_redis",
    "ensure_topics",
    "load_settings",
    "run_main",
]
