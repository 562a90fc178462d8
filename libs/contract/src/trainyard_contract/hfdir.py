"""A Hugging Face model directory as a start (``initFrom.huggingFace``) or an import: where it is
and what it holds.

No torch and no transformers: the API checks a directory reading JSON and file names only, the node
agent binds it into a rank's sandbox, the trainer and ``trainyard models import`` take the same
checks. The weights themselves are read by ``trainyard_trainer.hf.read_hf_model``.

A directory is usable when it resolves (symlinks followed) inside the tenant's prefix, has a
``config.json`` that :func:`~trainyard_contract.hfconfig.model_config_from_hf` accepts, and weights:
``model.safetensors``, or ``model.safetensors.index.json`` with every shard its ``weight_map`` names.
Under an object-store artifact root the "directory" is a prefix (no symlinks; the spec already refuses
``.`` and ``..``) and the same checks read its objects.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import ConfigError
from trainyard_contract.hfconfig import model_config_from_hf
from trainyard_contract.storage import ArtifactLayout, Location, ObjectPath, list_children, read_bytes

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
EXPORT_LISTING = "trainyard-export.json"  # written last by an export: every file with its sha256
MODEL_LISTING = "trainyard-model.json"  # written last by `trainyard models import` into an object store: the same

#: The fields of a model's shape, as the spec spells them: what a start's config.json must match.
SHAPE_FIELDS = ("architecture", "vocab_size", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_ff",
                "max_seq_len")
_WIRE = {"architecture": "architecture", "vocab_size": "vocabSize", "n_layers": "nLayers", "n_heads": "nHeads",
         "n_kv_heads": "nKvHeads", "d_model": "dModel", "d_ff": "dFf", "max_seq_len": "maxSeqLen"}
_MAX_JSON_BYTES = 16 * 1024 * 1024  # a config or index larger than this is no model directory


class HfDirError(ConfigError):
    """A directory that cannot start a job or be imported; the message says what to do."""


@dataclass(frozen=True)
class HfDir:
    """What a usable directory holds: its model's shape, and the fingerprint a job records."""

    path: Location  # resolved: a directory, or an object-store prefix
    config: ModelConfig
    config_sha256: str
    weight_files: tuple[tuple[str, int], ...]  # (name, size in bytes), sorted
    index_sha256: str | None  # of model.safetensors.index.json, when sharded
    export_sha256: str | None  # of trainyard-export.json, when the directory is a trainyard export


# ----------------------------------------------------------------------------- pure


def shape_of(config: ModelConfig) -> dict[str, Any]:
    """The shape fields of ``config`` (defaults filled in: ``dFf`` 4*dModel, ``nKvHeads`` nHeads)."""
    values = {f: getattr(config, f) for f in SHAPE_FIELDS}
    values["d_ff"] = config.ffn_width
    values["n_kv_heads"] = config.kv_heads
    return values


def shape_differences(expected: ModelConfig, found: ModelConfig) -> list[str]:
    """``"nLayers: 2 here, 4 in the directory"`` for every shape field that differs."""
    want, have = shape_of(expected), shape_of(found)
    return [f"{_WIRE[f]}: {want[f]} in the spec, {have[f]} in the directory" for f in SHAPE_FIELDS
            if want[f] != have[f]]


def inline_config(config: ModelConfig) -> str:
    """``config`` as the inline ``modelConfig`` object to paste into a spec (dropout left out)."""
    return json.dumps(config.model_dump(mode="json", by_alias=True, exclude={"dropout"}), separators=(", ", ": "))


def within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def index_shards(index: Any) -> list[str]:
    """The shard file names an index's ``weight_map`` names; HfDirError when it is no index."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HfDirError(f"{WEIGHTS_INDEX} has no weight_map (parameter name -> shard file): write it with "
                         "transformers' save_pretrained")
    shards = sorted({str(v) for v in weight_map.values()})
    bad = [s for s in shards if "/" in s or s in ("", ".", "..")]
    if bad:
        raise HfDirError(f"{WEIGHTS_INDEX} names shard {bad[0]!r} outside the directory")
    return shards


# ----------------------------------------------------------------------------- reading the directory


def resolve_start(layout: ArtifactLayout, tenant: str, relative: str) -> Location:
    """``tenants/<tenant>/<relative>`` with symlinks resolved; HfDirError when it leaves the tenant's prefix."""
    if layout.remote:
        parts = [p for p in relative.split("/") if p]
        if not parts or {".", ".."} & set(parts):
            raise HfDirError(f"{relative!r} is not a directory under your tenant's prefix: name one, e.g. "
                             "models/<name> (trainyard models import) or an export's "
                             "jobs/<job>/exports/<checkpoint>/hf")
        found: Location = layout.tenant_dir(tenant)
        for part in parts:
            found = found / part
        return found
    prefix = layout.tenant_dir(tenant).resolve()
    path = (prefix / relative).resolve()
    if not within(path, prefix) or path == prefix:
        raise HfDirError(f"{relative!r} resolves to {path}, outside your tenant's prefix {prefix}: name a "
                         "directory under it, e.g. models/<name> (trainyard models import) or an export's "
                         "jobs/<job>/exports/<checkpoint>/hf")
    return path


def _read_json(path: Location, size: int | None) -> tuple[Any, str]:
    """The JSON file at ``path`` and its sha256; ``size`` as the directory's listing gave it (no second stat)."""
    try:
        if (size or 0) > _MAX_JSON_BYTES:
            raise HfDirError(f"{path.name} is larger than {_MAX_JSON_BYTES} bytes: not a model's {path.name}")
        raw = read_bytes(path)
    except OSError as exc:
        raise HfDirError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    try:
        return json.loads(raw), hashlib.sha256(raw).hexdigest()
    except ValueError as exc:
        raise HfDirError(f"{path.name} is not JSON ({exc})") from exc


def inspect_dir(path: Location) -> HfDir:
    """Check a model directory or object-store prefix (config.json, weights present) without reading the
    weights."""
    entries = {c.name: c for c in list_children(path) if not c.is_dir}
    exists = bool(entries) if isinstance(path, ObjectPath) else path.is_dir()  # a prefix exists when it holds objects
    if not exists:
        raise HfDirError(f"{path} is not a directory: bring a Hugging Face model in with `trainyard models import "
                         "<dir> --name <name>` (then initFrom.huggingFace: models/<name>), or name an export")
    if CONFIG_FILE not in entries:
        raise HfDirError(f"{path} has no {CONFIG_FILE}: a Hugging Face model directory (save_pretrained, or a "
                         "trainyard export) has one")
    data, config_sha = _read_json(path / CONFIG_FILE, entries[CONFIG_FILE].size)
    if not isinstance(data, dict):
        raise HfDirError(f"{CONFIG_FILE} is not a JSON object")
    config = model_config_from_hf(data)  # ConfigError naming the key
    index_sha: str | None = None
    if WEIGHTS_INDEX in entries:
        index, index_sha = _read_json(path / WEIGHTS_INDEX, entries[WEIGHTS_INDEX].size)
        names = index_shards(index)
    elif WEIGHTS_FILE in entries:
        names = [WEIGHTS_FILE]
    else:
        other = sorted(n for n in entries if n.endswith(".bin") or ".pt" in n)
        hint = (f" (it has {', '.join(other[:3])}: save it again with safe_serialization=True)" if other else "")
        raise HfDirError(f"{path} has no weights: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}{hint}")
    files = []
    for name in names:
        if name not in entries:
            raise HfDirError(f"{WEIGHTS_INDEX} names {name}, which is not in the directory")
        files.append((name, entries[name].size or 0))
    export_sha = None
    if EXPORT_LISTING in entries:
        export_sha = hashlib.sha256(read_bytes(path / EXPORT_LISTING)).hexdigest()
    return HfDir(path=path, config=config, config_sha256=config_sha, weight_files=tuple(sorted(files)),
                 index_sha256=index_sha, export_sha256=export_sha)
