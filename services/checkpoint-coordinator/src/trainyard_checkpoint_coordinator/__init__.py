"""trainyard checkpoint coordinator: shard reports → verified manifest → READY; retention and
garbage collection; Young/Daly checkpoint-interval advice.

The pure decisions are in :mod:`.assembly` (the protocol), :mod:`.retention` (what to remove) and
:mod:`.advice` (the interval); :class:`Coordinator`, :class:`GarbageCollector` and
:class:`Measurements` are the I/O shells; :func:`build_service` wires them into a ``ServiceRuntime``.
"""

from trainyard_checkpoint_coordinator.assembly import (
    MANIFEST_NAME,
    CheckpointKey,
    Complete,
    JobDefaults,
    Rejected,
    ShardReport,
    ShardVerdict,
    Waiting,
    assess,
    build_manifest,
    classify_shard,
)
from trainyard_checkpoint_coordinator.coordinator import Coordinator, build_service
from trainyard_checkpoint_coordinator.ledger import PENDING_INDEX, CheckpointLedger
from trainyard_checkpoint_coordinator.advice import CheckpointAdvice, FailureStats, advise, device_mtbf
from trainyard_checkpoint_coordinator.collector import JOBS_INDEX, GarbageCollector
from trainyard_checkpoint_coordinator.measurements import Measurements
from trainyard_checkpoint_coordinator.protection import Protection, assess_protection, protection_key
from trainyard_checkpoint_coordinator.retention import Collect, Retire, Sweep, plan_gc, retention_candidates
from trainyard_checkpoint_coordinator.settings import CoordinatorSettings
from trainyard_checkpoint_coordinator.watch import ProtectionWatch

__all__ = [
    "Protection",
    "ProtectionWatch",
    "assess_protection",
    "protection_key",
    "JOBS_INDEX",
    "MANIFEST_NAME",
    "PENDING_INDEX",
    "CheckpointAdvice",
    "CheckpointKey",
    "Collect",
    "Complete",
    "CheckpointLedger",
    "Coordinator",
    "CoordinatorSettings",
    "FailureStats",
    "GarbageCollector",
    "Measurements",
    "Retire",
    "Sweep",
    "JobDefaults",
    "Rejected",
    "ShardReport",
    "ShardVerdict",
    "Waiting",
    "advise",
    "assess",
    "build_manifest",
    "build_service",
    "classify_shard",
    "device_mtbf",
    "plan_gc",
    "retention_candidates",
]
