"""trainyard scheduler: inventory, topology-aware gang placement, queues with quotas, priorities,
fair sharing, backfill and preemption, epoch-fenced leases and a fenced leader lease.

The decisions are pure (:mod:`topology` and :mod:`placement`; :mod:`planner` with :mod:`quota`, :mod:`backfill`
and :mod:`preemption`; :mod:`transitions`, :mod:`policy`); the :class:`Scheduler` shell (its parts listed in
:mod:`scheduler`) applies them against Redis and the event bus; :mod:`simulation` drives
the same pure code in a discrete-event simulator (``bench/scheduler/run.py``).
"""

from trainyard_scheduler.fencing import FencedLeases, LeaderKeys, Leadership
from trainyard_scheduler.decisions import Admit, Decision, PendingJob, PlanStats, Preempt, RunningJob, Wait
from trainyard_scheduler.gang import GangRequest, NodeShare, Placement, RankSlot, Unschedulable, parse_topology
from trainyard_scheduler.keys import SchedulerKeys
from trainyard_scheduler.placement import place
from trainyard_scheduler.planner import plan
from trainyard_scheduler.policy import QueueConfig, parse_queue_config
from trainyard_scheduler.scheduler import Scheduler
from trainyard_scheduler.topology import ClusterSnapshot, NodeView
from trainyard_scheduler.settings import SchedulerSettings

__all__ = [
    "Admit",
    "ClusterSnapshot",
    "Decision",
    "FencedLeases",
    "GangRequest",
    "LeaderKeys",
    "Leadership",
    "NodeShare",
    "NodeView",
    "PendingJob",
    "PlanStats",
    "Placement",
    "Preempt",
    "QueueConfig",
    "RankSlot",
    "RunningJob",
    "Scheduler",
    "SchedulerKeys",
    "SchedulerSettings",
    "Unschedulable",
    "Wait",
    "parse_queue_config",
    "parse_topology",
    "place",
    "plan",
]
