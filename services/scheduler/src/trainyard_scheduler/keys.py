"""Redis keys the scheduler owns (besides the shared ones in ``trainyard_runtime.store.Keys``)."""

from __future__ import annotations

from trainyard_runtime.store import Keys

from trainyard_scheduler.fencing import LeaderKeys


class SchedulerKeys:
    active = Keys.sched_active  # ids of jobs the scheduler has taken in that are not yet terminal
    leader = LeaderKeys.leader  # "<epoch> <instance>" of the scheduler that runs the tick
    leader_epoch = LeaderKeys.epoch  # incremented at every takeover
    queue_config = Keys.queue_config
    tenant_config = Keys.tenant_config  # hash tenant → TenantConfig JSON: the API's settings, and the seeds
