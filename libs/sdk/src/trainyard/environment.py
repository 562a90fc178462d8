"""A rank's environment: the node agent's contract (:class:`~trainyard.settings.RankSettings`),
the allocation file it points at, and local mode (a world of one on a laptop).

Local mode (``TRAINYARD_LOCAL=1`` or ``trainyard.init(local=True)``) stands in for the node agent:
rank 0 of a world of one, no process group, the spec read from ``TRAINYARD_LOCAL_SPEC`` (default
``spec.yaml`` beside the script), artifacts under ``TRAINYARD_ARTIFACT_ROOT`` when set (a dev
stack's, where its datasets are) or a new temporary directory. Checkpoints are written as on the
platform, but nothing makes them READY (there is no coordinator), so a local run always starts at
step 0.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from trainyard_contract.errors import ConfigError
from trainyard_contract.events import GangAllocated
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout, is_object_url

from trainyard.preemption import CHECKPOINT_REQUEST_FILE, CheckpointRequest
from trainyard.settings import RankSettings

__all__ = ["LOCAL_ENV", "NotInTrainyard", "apply_spec_choices", "checkpoint_request", "checkpoint_request_file",
           "local_settings", "missing_rank_variables", "read_allocation"]

LOCAL_ENV = "TRAINYARD_LOCAL"
LOCAL_SPEC_ENV = "TRAINYARD_LOCAL_SPEC"
_CONTRACT = ("RANK", "WORLD_SIZE", "MASTER_PORT", "TRAINYARD_JOB_ID", "TRAINYARD_ALLOCATION_FILE",
             "TRAINYARD_EVENTS_FILE")


class NotInTrainyard(ConfigError):
    """The script runs without the rank environment a trainyard node agent sets (and not in local mode)."""


def missing_rank_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    environ = os.environ if environ is None else environ
    return [name for name in _CONTRACT if name not in environ]


def not_in_trainyard_message(missing: list[str]) -> str:
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "this script"
    return (f"trainyard: {script} is not running under trainyard (missing {', '.join(missing)}: the rank "
            "environment a trainyard node agent sets). Submit it as a job (`trainyard submit spec.yaml`), or run "
            f"it here as a world of one with {LOCAL_ENV}=1 (spec from {LOCAL_SPEC_ENV}, default spec.yaml beside "
            "the script; artifacts under TRAINYARD_ARTIFACT_ROOT or a temporary directory).")


def read_allocation(settings: RankSettings) -> GangAllocated:
    """The GangAllocated event the node agent wrote for this attempt (spec, start checkpoint)."""
    try:
        return GangAllocated.model_validate_json(settings.allocation_file.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"TRAINYARD_ALLOCATION_FILE {settings.allocation_file} does not exist") from None
    except ValidationError as exc:
        raise ConfigError(f"TRAINYARD_ALLOCATION_FILE {settings.allocation_file} is not a GangAllocated: "
                          f"{exc}") from exc


def apply_spec_choices(settings: RankSettings, spec: TrainingSpec) -> RankSettings:
    """The spec's sharding, activation checkpointing, precision and checkpoint mode, where it sets
    them, win over the rank's environment (which supplies the defaults)."""
    t, c = spec.training, spec.checkpoint_policy
    chosen = {
        "sharding": t.sharding,
        "activation_checkpointing": t.activation_checkpointing,
        "autocast": {"fp32": "off"}.get(t.precision, t.precision) if t.precision else None,
        "checkpoint_mode": c.mode,
    }
    return settings.model_copy(update={k: v for k, v in chosen.items() if v is not None})


def checkpoint_request_file(settings: RankSettings) -> Path:
    """Where the node agent writes a checkpoint request for this attempt."""
    return settings.checkpoint_request_file or (
        ArtifactLayout(settings.local_root).attempt_dir(settings.tenant, settings.job_id, settings.attempt)
        / CHECKPOINT_REQUEST_FILE)


def checkpoint_request(settings: RankSettings, *, install: bool = True) -> CheckpointRequest:
    """This rank's checkpoint request (SIGUSR1 or the request file), its signal handler installed."""
    request = CheckpointRequest(checkpoint_request_file(settings), allocation_id=settings.allocation_id,
                                epoch=settings.epoch)
    return request.install() if install else request


def _local_spec(path: str | None) -> tuple[TrainingSpec, Path]:
    script_dir = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else Path.cwd()
    spec_path = Path(path) if path else script_dir / "spec.yaml"
    try:
        data = yaml.safe_load(spec_path.read_text())
        if isinstance(data, dict):
            data.pop("code", None)  # locally the code is what runs; its archive is filled in at submission
        return TrainingSpec.model_validate(data), spec_path
    except FileNotFoundError:
        raise ConfigError(f"local mode: no spec at {spec_path}; set {LOCAL_SPEC_ENV} to your job's spec.yaml") from None
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"local mode: {spec_path} is not a valid trainyard spec: {exc}") from exc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_settings(*, spec: TrainingSpec | str | None = None, root: Path | str | None = None,
                      environ: Mapping[str, str] | None = None) -> RankSettings:
    """Settings and an allocation file for a world of one, as a node agent would write them.

    ``spec``: a TrainingSpec or the path of a spec.yaml (default ``TRAINYARD_LOCAL_SPEC``, then
    ``spec.yaml`` beside the script)."""
    environ = os.environ if environ is None else environ
    if isinstance(spec, TrainingSpec):
        parsed = spec
    else:
        parsed, _ = _local_spec(spec or environ.get(LOCAL_SPEC_ENV))
    named = root or environ.get("TRAINYARD_ARTIFACT_ROOT")
    artifact_root: Path | str = str(named) if is_object_url(named) else Path(
        named or tempfile.mkdtemp(prefix="trainyard-local-"))
    # an object-store root keeps the attempt's own files (spool, run record) in a directory on this machine
    node_state_dir = None if isinstance(artifact_root, Path) else Path(
        environ.get("TRAINYARD_NODE_STATE_DIR") or tempfile.mkdtemp(prefix="trainyard-local-state-"))
    # a run of its own each time (checkpoint directories are never reused), unless the caller names one
    job_id = environ.get("TRAINYARD_JOB_ID") or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    attempt_dir = ArtifactLayout(node_state_dir or artifact_root).attempt_dir("local", job_id, 1)
    attempt_dir.mkdir(parents=True, exist_ok=True)
    allocation = GangAllocated(
        job_id=job_id, tenant="local", attempt=1, allocation_id=f"{job_id}-local", epoch=1, world_size=1, nodes=[],
        master_addr="127.0.0.1", master_port=29500, spec=parsed, spec_hash=parsed.spec_hash(),
    )
    allocation_file = attempt_dir / "allocation.json"
    allocation_file.write_bytes(allocation.to_bytes())
    return RankSettings(
        rank=0, world_size=1, master_port=_free_port(), job_id=job_id, tenant="local", attempt=1, epoch=1,
        allocation_id=allocation.allocation_id, artifact_root=artifact_root, node_state_dir=node_state_dir,
        allocation_file=allocation_file,
        events_file=attempt_dir / "events.rank0.jsonl", log_level=environ.get("TRAINYARD_LOG_LEVEL", "INFO"),
    )
