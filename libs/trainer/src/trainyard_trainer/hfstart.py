"""``initFrom.huggingFace``: a job's first weights from a Hugging Face model directory.

The directory (named in the spec, relative to the tenant's prefix) is read when the job starts with
no checkpoint of its own: every rank reads it (``trainyard_trainer.hf.read_hf_model``: config.json
checked, the safetensors mapped to our names) and loads the full state into its part of the
parallelised model (``set_model_state_dict`` with a full state dict: FSDP2 and TP shards are cut from
it, a pipeline stage takes the entries it has). A later attempt resumes from its own READY checkpoint
as any job does; the optimizer, schedule, data position and step counter start fresh.

Under an object-store artifact root the directory is a prefix: :func:`fetch_hf_dir` downloads the files a
start reads (config, index, weights) once per node into the node's state directory — the node's ranks
take turns on a lock, the first downloads — checking each against the directory's listing
(``trainyard-model.json`` of an import, ``trainyard-export.json`` of an export) when it has one, and
the ranks read that copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
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
from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import CheckpointError, ConfigError
from trainyard_contract.hfdir import (
    CONFIG_FILE,
    EXPORT_LISTING,
    MODEL_LISTING,
    WEIGHTS_INDEX,
    inline_config,
    inspect_dir,
    resolve_start,
    shape_differences,
)
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import (
    ArtifactLayout,
    ListedFile,
    Location,
    ObjectPath,
    download_file,
    export_listing,
    is_file,
    location_uri,
    read_bytes,
)

from trainyard_trainer.hf import read_hf_model

__all__ = ["hugging_face_dir", "load_full_state", "maybe_init_from_hugging_face"]

log = logging.getLogger("trainyard_trainer")


def hugging_face_dir(spec: TrainingSpec, layout: ArtifactLayout, tenant: str) -> Location | None:
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
    for name, entry in expected.items():
        local: Any = entry  # a model state dict's entries are tensors (torch types any state value)
        tensor = full[name]
        if tuple(tensor.shape) != tuple(local.shape):
            raise CheckpointError(f"initFrom.huggingFace: {name} has shape {tuple(tensor.shape)} in the directory, "
                                  f"the model's is {tuple(local.shape)}")
        mine[name] = tensor.to(dtype=local.dtype)
    set_model_state_dict(model, mine, options=StateDictOptions(full_state_dict=True, strict=True))


def maybe_init_from_hugging_face(spec: TrainingSpec, config: ModelConfig, model: torch.nn.Module,
                                 restored: RestoreRecord, layout: ArtifactLayout, tenant: str,
                                 cache_dir: Path | None = None) -> bool:
    """At a start without a checkpoint of the job's own (``restored`` loaded none), load the spec's
    ``initFrom.huggingFace`` weights into ``model`` and say so in ``restored``. Whether it did.
    ``cache_dir``: where a directory in an object store is downloaded to (required then)."""
    directory = hugging_face_dir(spec, layout, tenant)
    if directory is None or restored.manifest_uri is not None:
        return False
    assert spec.init_from is not None and spec.init_from.hugging_face is not None
    name, started = spec.init_from.hugging_face, time.perf_counter()
    if isinstance(directory, ObjectPath):
        if cache_dir is None:
            raise ConfigError("initFrom.huggingFace: the directory is in an object store and this rank has no "
                              "node-local directory to fetch it into (TRAINYARD_NODE_STATE_DIR)")
        local = fetch_hf_dir(directory, cache_dir)
    else:
        local = directory
    found, state = read_hf_model(local)
    check_shape(config, found, name)
    load_full_state(model, state)
    restored.hugging_face_uri = location_uri(directory)
    restored.reason = (f"initialised from the Hugging Face directory {name} (weights only; optimizer, schedule, "
                       "data position and step counter start fresh)")
    restored.seconds += time.perf_counter() - started
    log.info("restore: %s", restored.reason)
    return True


def fetch_hf_dir(directory: ObjectPath, cache_dir: Path) -> Path:
    """A node-local copy of the files a start reads from ``directory`` (an object-store prefix): config,
    index and weights, each checked against the directory's listing when it has one (CheckpointError
    on a mismatch: nothing of it is used). Downloaded once per node and content: the copy's name is a
    digest of the URI and what :func:`inspect_dir` saw, and ``.complete`` marks a copy in full."""
    found = inspect_dir(directory)
    names = [CONFIG_FILE, *([WEIGHTS_INDEX] if found.index_sha256 else []), *(n for n, _ in found.weight_files)]
    listed = _listing(directory)
    key = hashlib.sha256(json.dumps([str(directory), found.config_sha256, found.index_sha256, found.weight_files,
                                     sorted((f.name, f.sha256) for f in listed.values())]).encode()).hexdigest()
    target = cache_dir / key[:32]
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait for the first one's download
        if (target / ".complete").exists():
            return target
        sizes = dict(found.weight_files)
        for name in names:
            tmp = target / f".{name}.{os.getpid()}"
            size, digest = download_file(directory / name, tmp)
            expected = listed.get(name)
            if (expected is not None and (size, digest) != (expected.size, expected.sha256)) or \
                    (name in sizes and size != sizes[name]):
                tmp.unlink(missing_ok=True)
                raise CheckpointError(f"initFrom.huggingFace: {directory / name} has {size} bytes, sha256 "
                                      f"{digest[:12]}…, not what the directory lists: refused (import it again)")
            os.replace(tmp, target / name)
        (target / ".complete").write_text(json.dumps(names) + "\n")
    log.info("restore: fetched %s (%d files) into %s", directory, len(names), target)
    return target


def _listing(directory: ObjectPath) -> dict[str, ListedFile]:
    """What the directory's listing (an import's or an export's) says of its files; empty without one."""
    for name in (MODEL_LISTING, EXPORT_LISTING):
        if is_file(directory / name):
            try:
                return {f.name: f for f in export_listing(read_bytes(directory / name))}
            except ValueError as exc:
                raise CheckpointError(f"initFrom.huggingFace: {directory / name} is not a listing: {exc}") from None
    return {}
