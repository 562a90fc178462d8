"""``python -m trainyard_scheduler`` / ``trainyard-scheduler``: run the scheduler until SIGTERM."""

from __future__ import annotations

from trainyard_runtime.service import service_main

from trainyard_scheduler.scheduler import build_service
from trainyard_scheduler.settings import SchedulerSettings

SUMMARY = (
    "trainyard scheduler: builds the node inventory (device type, count, memory, rack, NVLink domain, "
    "network tier) from NodeHeartbeat; queues jobs with per-tenant quotas (guaranteed + borrowable), "
    "priority classes, fair sharing, aging, backfill and checkpoint-first preemption; places whole gangs "
    "topology-aware (TP groups inside one NVLink domain, the fewest racks); takes epoch-fenced device "
    "leases in Redis; publishes GangAllocated; and drives job attempts to succeeded, failed or cancelled. "
    "Several instances may run: one leads (a fenced leader lease), the others stand by. "
    "Topology and queue configuration: services/scheduler/README.md."
)


async def serve(settings: SchedulerSettings) -> None:
    """Run one scheduler until SIGTERM/SIGINT; closing gives up the leader lease first."""
    await build_service(settings).run()


def main(argv: list[str] | None = None) -> None:
    service_main(argv, prog="trainyard-scheduler", description=SUMMARY, settings_cls=SchedulerSettings,
                 serve=serve, service="scheduler")


if __name__ == "__main__":
    main()
