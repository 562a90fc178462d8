"""``initFrom.huggingFace``: a job's first weights from a Hugging Face model directory.

The directory (named in the spec, relative to the tenant's prefix) is read when the job starts with
no checkpoint of its own: every rank reads it (``trainyard_trainer.hf.read_hf_model``: config.json
checked, the safetensors mapped to our names) and loads the full state into its part of the
parallelised model (``set_model_state_dict`` with a full state dict: FSDP2 and TP shards are cut from
it, a pipeline stage takes the entries it has). A later attempt resumes from its own READY checkpoint
as any job does; the optimizer, schedule, data position and step counter start fresh.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from trainyard.runrecord import RestoreRecord
from trainyard_common.catalog import ModelConfig
from trainyard_common.errors import CheckpointError, ConfigError
from trainyard_common.hfdir import inline_config, resolve_start, shape_differences
from trainyard_common.spec import TrainingSpec
from trainyard_common.storage import ArtifactLayout, path_to_uri

from trainyard_trainer.hf import read_hf_model

__all__ = ["hugging_face_dir", "load_full_state", "maybe_init_from_hugging_face"]

log = logging.getLogger("trainyard_trainer")


def hugging_face_dir(spec: TrainingSpec, layout: ArtifactLayout, tenant: str) -> Path | None:
    """The spec's ``initFrom.huggingFace`` directory, resolved inside the tenant's prefix (HfDirError,
    a ConfigError, when it leaves it); None when the spec starts from none."""
    init = spec.init_from
    if init is None or init.hugging_face is None:
        return None
    return resolve_start(layout, tenant, init.hugging_face)


def check_shape(expected: ModelConfig, found: ModelConfig, directory: str) -> None:
    """ConfigError ``config: ...`` naming what differs between the job's model and the directory's."""
    differences = shape_differences(expected, found)
    if differences:
        raise ConfigError(f"config: initFrom.huggingFace {directory!r} holds another model than the job's: "
                          f"{'; '.join(differences)} (the directory's is {inline_config(found)})")


def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state in our names into ``model`` as parallelised: the entries it holds
    (a pipeline stage holds some), each cut to its shard. CheckpointError naming what does not fit."""
    expected = get_model_state_dict(model)
    missing = sorted(set(expected) - set(full))
    if missing:
        raise CheckpointError(f"initFrom.huggingFace: the directory has no weights for {', '.join(missing[:5])}"
                              f"{' …' if len(missing) > 5 else ''}")
    mine: dict[str, Any] = {}
    for name, local in expected.items():
        tensor = full[name]
        if tuple(tensor.shape) != tuple(local.shape):
            raise CheckpointError(f"initFrom.huggingFace: {name} has shape {tuple(tensor.shape)} in the directory, "
                                  f"the model's is {tuple(local.shape)}")
        mine[name] = tensor.to(dtype=local.dtype)
    set_model_state_dict(model, mine, options=StateDictOptions(full_state_dict=True, strict=True))


def maybe_init_from_hugging_face(spec: TrainingSpec, config: ModelConfig, model: torch.nn.Module,
                                 restored: RestoreRecord, layout: ArtifactLayout, tenant: str) -> bool:
    """At a start without a checkpoint of the job's own (``restored`` loaded none), load the spec's
    ``initFrom.huggingFace`` weights into ``model`` and say so in ``restored``. Whether it did."""
    directory = hugging_face_dir(spec, layout, tenant)
    if directory is None or restored.manifest_uri is not None:
        return False
    assert spec.init_from is not None and spec.init_from.hugging_face is not None
    name, started = spec.init_from.hugging_face, time.perf_counter()
    found, state = read_hf_model(directory)
    check_shape(config, found, name)
    load_full_state(model, state)
    restored.hugging_face_uri = path_to_uri(directory)
    restored.reason = (f"initialised from the Hugging Face directory {name} (weights only; optimizer, schedule, "
                       "data position and step counter start fresh)")
    restored.seconds += time.perf_counter() - started
    log.info("restore: %s", restored.reason)
    return True
