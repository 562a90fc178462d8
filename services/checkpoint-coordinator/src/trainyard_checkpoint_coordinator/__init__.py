"""trainyard checkpoint coordinator: shard reports → verified manifest → READY.

The pure protocol decisions are in :mod:`.assembly`; :class:`Coordinator` is the I/O shell;
:func:`build_service` wires it into a ``ServiceRuntime``.
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
from trainyard_checkpoint_coordinator.coordinator import PENDING_INDEX, Coordinator, build_service
from trainyard_checkpoint_coordinator.retention import retention_candidates
from trainyard_checkpoint_coordinator.settings import CoordinatorSettings

__all__ = [
    "MANIFEST_NAME",
    "PENDING_INDEX",
    "CheckpointKey",
    "Complete",
    "Coordinator",
    "CoordinatorSettings",
    "JobDefaults",
    "Rejected",
    "ShardReport",
    "ShardVerdict",
    "Waiting",
    "assess",
    "build_manifest",
    "build_service",
    "classify_shard",
    "retention_candidates",
]
