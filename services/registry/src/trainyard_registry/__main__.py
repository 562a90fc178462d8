"""``python -m trainyard_registry`` / ``trainyard-registry``."""

from __future__ import annotations

from trainyard_runtime.service import service_main

from trainyard_registry.registry import build_service
from trainyard_registry.settings import RegistrySettings

DESCRIPTION = """\
trainyard registry: records every dataset version (trainyard.datasets), every READY
checkpoint (trainyard.checkpoints) and the final model of every succeeded job
(trainyard.jobs) as artifacts with lineage (spec hash, code revision, dataset manifest and
sha256, tokenizer, model config, parent checkpoint, producing attempt, content hash), and
announces each record and retirement on trainyard.registry (ArtifactRegistered, ArtifactRetired).
On ExportRequested (trainyard.exports: POST /v1/registry/artifacts/{id}/export, or a spec's
export) it converts a READY checkpoint into a Hugging Face model directory with trainyard-export
(TRAINYARD_EXPORT_COMMAND, TRAINYARD_EXPORT_TIMEOUT_S) and records it as an export artifact, or
announces ExportFailed. The API serves them at GET /v1/registry/artifacts?jobId=. Runs until
SIGTERM or SIGINT."""


def main(argv: list[str] | None = None) -> None:
    """Parse the settings once, then serve until SIGTERM."""

    async def serve(settings: RegistrySettings) -> None:
        await build_service(settings).run()

    service_main(argv, prog="trainyard-registry", description=DESCRIPTION, settings_cls=RegistrySettings, serve=serve,
                 service="registry")


if __name__ == "__main__":
    main()
