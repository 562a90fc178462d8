"""trainyard registry: verified dataset versions, artifacts (checkpoints, final models) and their lineage.

Pure record building is in :mod:`.lineage`, the checks a published dataset version must pass in
:mod:`.verification`, export decisions in :mod:`.exports`; :class:`Registry` is the I/O shell
(:class:`Exporter` its export worker);
:func:`build_service` wires it into a ``ServiceRuntime``.
"""

from trainyard_registry.exporter import Exporter
from trainyard_registry.exports import plan_export
from trainyard_registry.lineage import (
    artifact_id,
    build_lineage,
    checkpoint_artifact,
    dataset_conflict,
    model_artifact,
    model_config_ref,
)
from trainyard_registry.registry import Registry, build_service
from trainyard_registry.settings import RegistrySettings
from trainyard_registry.verification import version_problems

__all__ = [
    "Exporter",
    "Registry",
    "RegistrySettings",
    "artifact_id",
    "build_lineage",
    "build_service",
    "checkpoint_artifact",
    "dataset_conflict",
    "model_artifact",
    "model_config_ref",
    "plan_export",
    "version_problems",
]
