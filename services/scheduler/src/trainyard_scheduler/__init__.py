"""trainyard scheduler: node inventory, gang placement, epoch-fenced leases and job attempts.

The decisions are pure (:mod:`placement`, :mod:`planner`, :mod:`transitions`); the
:class:`Scheduler` shell applies them against Redis and the event bus.
"""

from trainyard_scheduler.placement import (
    ClusterSnapshot,
    GangRequest,
    NodeShare,
    NodeView,
    Placement,
    RankSlot,
    Unschedulable,
    place,
)
from trainyard_scheduler.planner import Admit, Decision, PendingJob, Wait, plan
from trainyard_scheduler.scheduler import Scheduler, SchedulerKeys
from trainyard_scheduler.settings import SchedulerSettings

__all__ = [
    "Admit",
    "ClusterSnapshot",
    "Decision",
    "GangRequest",
    "NodeShare",
    "NodeView",
    "PendingJob",
    "Placement",
    "RankSlot",
    "Scheduler",
    "SchedulerKeys",
    "SchedulerSettings",
    "Unschedulable",
    "Wait",
    "place",
    "plan",
]
