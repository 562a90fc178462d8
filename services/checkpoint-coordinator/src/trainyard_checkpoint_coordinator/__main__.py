"""``python -m trainyard_checkpoint_coordinator`` / ``trainyard-checkpoint-coordinator``."""

from __future__ import annotations

from trainyard_runtime.service import service_main

from trainyard_checkpoint_coordinator.coordinator import build_service
from trainyard_checkpoint_coordinator.settings import CoordinatorSettings

DESCRIPTION = """\
trainyard checkpoint coordinator: collects every rank's ShardWritten per (job, attempt,
global step) from trainyard.checkpoints, verifies each shard's size and sha256, writes
manifest.json atomically into the checkpoint directory, marks the checkpoint READY in
Redis and publishes CheckpointReady (or CheckpointFailed with the reasons). Runs until
SIGTERM or SIGINT."""


def main(argv: list[str] | None = None) -> None:
    """Parse the settings once, then serve until SIGTERM."""

    async def serve(settings: CoordinatorSettings) -> None:
        await build_service(settings).run()

    service_main(argv, prog="trainyard-checkpoint-coordinator", description=DESCRIPTION,
                 settings_cls=CoordinatorSettings, serve=serve, service="checkpoint-coordinator")


if __name__ == "__main__":
    main()
