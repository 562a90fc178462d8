"""Our networks' weights <-> a Hugging Face model directory, and a checkpoint's full model state.

Export (:func:`write_hf_model`) writes what ``transformers.AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load offline::

    config.json                      GPT2LMHeadModel (gpt2) or LlamaForCausalLM (llama)
    generation_config.json           bos / eos token ids
    model.safetensors                or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json                   the dataset's, byte for byte
    tokenizer_config.json            PreTrainedTokenizerFast, eos/bos token, model_max_length
    trainyard-export.json            written last: every other file with its size and sha256

The directory is written under a temporary sibling and renamed into place, so it appears whole
or not at all; its identity (``ExportListing.sha256``) is the sha256 of the listing's bytes.

The mapping of names and layouts (:func:`to_hf_state_dict`, :func:`from_hf_state_dict`) is pure:

- ``llama``: our names map 1:1 (:func:`~trainyard_trainer.model.hf_llama_name`), same layouts.
- ``gpt2``: our fused ``qkv`` is a ``Linear`` with head-major rows ``[q0 k0 v0 | q1 k1 v1 | ...]``;
  HF's ``c_attn`` is a ``Conv1D`` (weight stored ``[in, out]``, i.e. transposed) whose columns are
  ``[q all heads | k all | v all]``. Every other projection is a transpose; the head is tied to
  ``wte`` and written once.

A checkpoint (:func:`checkpoint_model_state`) is verified against its manifest first, then its
``model`` entries are read with ``torch.distributed.checkpoint`` in this one process (no process
group), whatever layout wrote them: DCP reassembles FSDP and TP shards by name, and pipeline
stages each saved their own parameters under the full model's names.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import CheckpointCorruptError, CheckpointError, ConfigError
from trainyard_contract.hfconfig import hf_config, model_config_from_hf
from trainyard_contract.manifest import CheckpointManifest
from trainyard_contract.storage import fsync_dir, path_to_uri, sha256_file, uri_to_path

from trainyard_trainer.model import hf_llama_name, model_class

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
LISTING_FILE = "trainyard-export.json"
LISTING_VERSION = 1
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
MANIFEST_FILE = "manifest.json"
#: Prefixes parallel wrappers may leave on a parameter name (checkpoints normally have none).
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

_GPT2_RENAMES = (  # our block-local name -> HF's, for the modules that are not the fused qkv
    ("ln1.", "ln_1."), ("ln2.", "ln_2."), ("attn.out.", "attn.c_proj."),
    ("mlp.fc.", "mlp.c_fc."), ("mlp.proj.", "mlp.c_proj."),
)
_GPT2_FUSED = ("attn.c_attn.weight", "attn.c_attn.bias")
_GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
#: Entries HF GPT-2 / Llama directories may hold that are buffers, not weights.
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


# ----------------------------------------------------------------------------- pure mappings


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state-dict names and shapes for ``config`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_state(config: ModelConfig, state: Mapping[str, torch.Tensor], *, source: str = "the state") -> None:
    """ConfigError naming the first parameter that is missing, unexpected or of another shape."""
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    if missing or unexpected:
        raise ConfigError(
            f"{source} does not hold a {config.architecture} model of this config: "
            + (f"missing {missing[:3]}{' …' if len(missing) > 3 else ''}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {unexpected[:3]}{' …' if len(unexpected) > 3 else ''}" if unexpected else "")
            + " (is the model config the one the job trained?)"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"{source} has {name} of shape {tuple(state[name].shape)}; the model config "
                              f"needs {shape} (is the model config the one the job trained?)")


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Head-major ``[q0 k0 v0 | q1 …]`` rows -> ``[q all | k all | v all]`` (weight rows or bias)."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def gpt2_hf_name(name: str) -> str:
    """A :class:`~trainyard_trainer.model.GPT` name as ``GPT2LMHeadModel`` spells it."""
    if name.startswith("blocks."):
        _, index, local = name.split(".", 2)
        local = "attn.c_attn." + local[len("attn.qkv."):] if local.startswith("attn.qkv.") else local
        for ours, theirs in _GPT2_RENAMES:
            if local.startswith(ours):
                local = theirs + local[len(ours):]
        return f"transformer.h.{index}.{local}"
    return "transformer." + name


def to_hf_state_dict(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ``GPT``/``Llama`` state (names and layouts) as transformers' model of ``config`` holds it;
    every tensor contiguous and detached, the tied GPT-2 head written once (as ``transformer.wte``)."""
    check_state(config, state)
    if config.architecture == "llama":
        return {hf_llama_name(n): t.detach().contiguous() for n, t in state.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        hf_name = gpt2_hf_name(name)
        t = tensor.detach()
        if hf_name.endswith(_GPT2_FUSED):
            t = _qkv_to_hf(t, config.n_heads)
        if hf_name.endswith(_GPT2_TRANSPOSED):
            t = t.t()
        out[hf_name] = t.contiguous()
    return out


def _ours_from_hf_name(config: ModelConfig) -> dict[str, str]:
    """HF name -> our name, for every parameter of ``config``."""
    names = expected_shapes(config)
    to_hf = hf_llama_name if config.architecture == "llama" else gpt2_hf_name
    return {to_hf(n): n for n in names}


def _normalise_hf_names(config: ModelConfig, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop buffers and a tied GPT-2 head; accept GPT-2 names without the ``transformer.`` prefix
    (the original OpenAI checkpoints' spelling)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if name.endswith(_HF_BUFFERS):
            continue
        if config.architecture == "gpt2":
            if name == "lm_head.weight":
                continue  # tied: it is transformer.wte.weight (checked below when present)
            if not name.startswith("transformer."):
                name = "transformer." + name
        out[name] = tensor
    head, embedding = hf_state.get("lm_head.weight"), out.get("transformer.wte.weight")
    gpt2 = config.architecture == "gpt2"
    if gpt2 and head is not None and embedding is not None and not torch.equal(head, embedding):
        raise ConfigError("lm_head.weight differs from transformer.wte.weight: trainyard's gpt2 ties them")
    return out


def from_hf_state_dict(config: ModelConfig, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state of ``config``'s model -> ours (the inverse of :func:`to_hf_state_dict`)."""
    ours_of = _ours_from_hf_name(config)
    hf_state = _normalise_hf_names(config, hf_state)
    unknown = sorted(n for n in hf_state if n not in ours_of)
    if unknown:
        raise ConfigError(f"the weights hold {unknown[:3]}{' …' if len(unknown) > 3 else ''}, which a "
                          f"{config.architecture} model of this config has no place for")
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf_state.items():
        t = tensor.detach()
        if config.architecture == "gpt2":
            if hf_name.endswith(_GPT2_TRANSPOSED):
                t = t.t()
            if hf_name.endswith(_GPT2_FUSED):
                t = _qkv_from_hf(t, config.n_heads)
        out[ours_of[hf_name]] = t.contiguous()
    check_state(config, out, source="the Hugging Face weights")
    return out


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in order, into shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own). One group means one ``model.safetensors``."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def tokenizer_config(*, eos_token: str | None, max_seq_len: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for a dataset's ``tokenizer.json`` (the fast tokenizer, no template)."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if eos_token is not None:
        config |= {"eos_token": eos_token, "bos_token": eos_token}
    return config


def _dtype_name(state: Mapping[str, torch.Tensor]) -> str:
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) > 1:
        raise ConfigError(f"the state mixes dtypes {sorted(str(d) for d in dtypes)}; export one dtype")
    return str(dtypes.pop() if dtypes else torch.float32).removeprefix("torch.")


# ----------------------------------------------------------------------------- the directory


@dataclass(frozen=True)
class ExportedFile:
    path: str  # relative to the export directory
    size_bytes: int
    sha256: str

    def wire(self) -> dict[str, Any]:
        return {"path": self.path, "sizeBytes": self.size_bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class ExportListing:
    """A written export directory: where it is, its files, and its identity."""

    directory: Path
    sha256: str  # of the listing file's bytes
    files: tuple[ExportedFile, ...]

    @property
    def uri(self) -> str:
        return path_to_uri(self.directory)

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def wire(self) -> dict[str, Any]:
        return {"uri": self.uri, "sha256": self.sha256, "files": [f.wire() for f in self.files]}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _listing_bytes(files: list[ExportedFile]) -> bytes:
    body = {"listingVersion": LISTING_VERSION, "files": [f.wire() for f in files]}
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


def _save_weights(directory: Path, hf_state: dict[str, torch.Tensor], max_shard_bytes: int,
                  progress: Callable[[str], None]) -> None:
    from safetensors.torch import save_file

    sizes = {n: t.numel() * t.element_size() for n, t in hf_state.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    if len(shards) == 1:
        progress(f"writing {WEIGHTS_FILE} ({sum(sizes.values()) / 2**20:.1f} MiB)")
        save_file(hf_state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        file = shard_file_name(i, len(shards))
        progress(f"writing {file} ({i}/{len(shards)})")
        save_file({n: hf_state[n] for n in names}, str(directory / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in names}
    _write_json(directory / WEIGHTS_INDEX_FILE,
                {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})


def _token_id(tokenizer_json: Path, token: str | None) -> int | None:
    if token is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).token_to_id(token)


def write_hf_model(
    out_dir: Path, config: ModelConfig, state: Mapping[str, torch.Tensor], *,
    tokenizer_json: Path | None = None, eos_token: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] = lambda _: None,
) -> ExportListing:
    """Write ``state`` (ours) as a transformers model directory at ``out_dir``, atomically.

    ``eos_token`` (the dataset's separator) becomes the eos/bos token when the tokenizer has it.
    Refuses (ConfigError) an ``out_dir`` that already exists: an export is written once.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ConfigError(f"{out_dir} already exists; an export is written once: choose another directory "
                          "or remove it")
    if tokenizer_json is not None and not Path(tokenizer_json).is_file():
        raise ConfigError(f"tokenizer file {tokenizer_json} does not exist")
    hf_state = to_hf_state_dict(config, state)
    token_id = _token_id(Path(tokenizer_json), eos_token) if tokenizer_json is not None else None
    if token_id is None:
        eos_token = None  # not in the vocabulary (or no tokenizer): no eos/bos declared
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        _write_json(tmp / CONFIG_FILE, hf_config(config, bos_token_id=token_id, eos_token_id=token_id,
                                                 torch_dtype=_dtype_name(hf_state)))
        _write_json(tmp / GENERATION_CONFIG_FILE, {"bos_token_id": token_id, "eos_token_id": token_id})
        _save_weights(tmp, hf_state, max_shard_bytes, progress)
        if tokenizer_json is not None:
            shutil.copyfile(tokenizer_json, tmp / TOKENIZER_FILE)
            _write_json(tmp / TOKENIZER_CONFIG_FILE,
                        tokenizer_config(eos_token=eos_token, max_seq_len=config.max_seq_len))
        progress("hashing the files")
        files = [ExportedFile(path=p.name, size_bytes=p.stat().st_size, sha256=sha256_file(p))
                 for p in sorted(tmp.iterdir())]
        listing = _listing_bytes(files)
        (tmp / LISTING_FILE).write_bytes(listing)
        for p in tmp.iterdir():
            _fsync(p)
        fsync_dir(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError as exc:  # another writer finished first: theirs stands
            if out_dir.exists():
                raise ConfigError(f"{out_dir} was written meanwhile by another export; it is kept") from exc
            raise
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportListing(directory=out_dir, sha256=hashlib.sha256(listing).hexdigest(), files=tuple(files))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_hf_model(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A transformers GPT-2 / Llama directory as our config and state (our names and layouts).

    ConfigError names the file or key that trainyard cannot use; CheckpointError a weights file
    that cannot be read.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    try:
        data = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path} does not exist: a Hugging Face model directory has a config.json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config_path} is not a JSON object")
    config = model_config_from_hf(data)
    files = _weight_files(directory)
    hf_state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            hf_state |= load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file} cannot be read as safetensors: {exc}") from exc
    try:
        return config, from_hf_state_dict(config, hf_state)
    except ConfigError as exc:
        raise ConfigError(f"{directory}: {exc.message}") from None


def _weight_files(directory: Path) -> list[Path]:
    index = directory / WEIGHTS_INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index} is not a safetensors index (no weight_map): {exc}") from None
        files = [directory / n for n in names]
        if bad := [n for n in names if Path(n).name != n or not (directory / n).is_file()]:
            raise CheckpointError(f"{index} names {bad[0]!r}, which is not a file in {directory}")
        return files
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    if (directory / "pytorch_model.bin").exists():
        raise ConfigError(f"{directory} holds pytorch_model.bin; trainyard reads safetensors only "
                          "(convert it: model.save_pretrained(dir, safe_serialization=True))")
    raise ConfigError(f"{directory} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")


# ----------------------------------------------------------------------------- checkpoints


def _manifest_path(ref: str | Path) -> Path:
    path = uri_to_path(ref) if isinstance(ref, str) and ref.startswith("file:") else Path(ref)
    return path / MANIFEST_FILE if path.is_dir() else path


def checkpoint_model_state(manifest_uri_or_dir: str | Path) -> tuple[CheckpointManifest, dict[str, torch.Tensor]]:
    """Verify every file of a READY checkpoint against its manifest, then gather its full model state
    (our plain names) in this process, whatever parallel layout wrote it.

    CheckpointCorruptError: no manifest (not READY), a malformed one, or a file that fails it (named).
    """
    from pydantic import ValidationError
    from trainyard.checkpoint import verified_checkpoint_dir

    path = _manifest_path(manifest_uri_or_dir)
    try:
        manifest = CheckpointManifest.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} does not exist: the checkpoint is not READY (only a checkpoint the "
                                     "coordinator verified has a manifest)") from None
    except (ValidationError, ValueError) as exc:
        raise CheckpointCorruptError(f"checkpoint manifest {path} is malformed: {exc}") from exc
    directory = verified_checkpoint_dir(manifest, path_to_uri(path))
    return manifest, load_model_entries(directory)  # type: ignore[arg-type]  # a local manifest's directory


def load_model_entries(directory: Path) -> dict[str, torch.Tensor]:
    """The ``model`` entries of a DCP checkpoint directory as full plain tensors (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(directory)
    try:
        metadata = reader.read_metadata()
        flat = {key: torch.empty(md.size, dtype=md.properties.dtype)
                for key, md in metadata.state_dict_metadata.items()
                if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
        if not flat:
            raise CheckpointError(f"checkpoint {directory} has no model weights")
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(flat, storage_reader=reader, no_dist=True)
    except CheckpointError:
        raise
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError, EOFError, AttributeError,
            ImportError, pickle.UnpicklingError) as exc:
        # the files match the manifest, but DCP cannot read them (a truncated or foreign .metadata)
        raise CheckpointError(f"could not read the model of checkpoint {directory}: "
                              f"{type(exc).__name__}: {exc}") from exc
    return {strip_wrappers(key[len("model."):]): tensor for key, tensor in flat.items()}


def strip_wrappers(name: str) -> str:
    """``module._orig_mod.blocks.0.…`` -> ``blocks.0.…`` (prefixes anywhere in the name)."""
    return ".".join(part for part in name.split(".") if part + "." not in WRAPPER_PREFIXES)
