"""Versioned token datasets: how they are built, described and read.

A dataset version is a directory ``<artifact_root>/datasets/<name>/<version>/``::

    tokenizer.json        byte-level BPE (HF tokenizers), its sha256 recorded in the manifest
    shard-00000.bin …     token ids, little-endian uint16 (a vocabulary of at most 65,536) or
                          uint32 (larger; the manifest's ``dtype`` says which), concatenated
                          documents each followed by the end-of-document token (``separator``)
    manifest.json         written last and atomically; a directory without it is incomplete

Two builders write this layout: :func:`prepare_dataset` (the tinycorpus example below) and
``trainyard_trainer.data_import`` (``trainyard-data import``: the user's files and tokenizer).

The example corpus, ``tinycorpus``, is a fixed list of Python standard-library source files
(present on every machine with Python 3.11); each source's path relative to the stdlib and
its sha256 are recorded, so two machines with different patch releases produce datasets
that say how they differ.

Reading: :class:`TokenDataset` serves fixed windows of ``sequence_length + 1`` tokens. A
window never crosses a shard boundary (sample ``j`` of a shard covers tokens
``[j*L, j*L + L + 1)``), so a sample lives in exactly one shard; each shard's sha256 is
checked when the shard is first opened and a mismatch is a :class:`DataError`. With a
:class:`~trainyard.shardcache.ShardCache` (required for a dataset in an object store), shards are
read from verified node-local copies, and opening shard ``i`` prefetches shard ``i + 1``;
:meth:`TokenDataset.prefetch` prefetches the shards of samples the rank reads next.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import shutil
import sysconfig
from collections.abc import Callable, Iterable, Sequence, Sized
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from trainyard_contract.errors import DataError
from trainyard_contract.events import utcnow
from trainyard_contract.storage import (
    ArtifactLayout,
    Location,
    ObjectPath,
    as_location,
    atomic_write_bytes,
    fsync_dir,
    is_file,
    is_object_url,
    read_bytes,
    sha256_file,
    sha256_of,
    stat_size,
    upload_file,
)

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1
END_OF_TEXT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 1024  # gpt-tiny@v1 and gpt-small@v1
DEFAULT_SHARD_TOKENS = 1 << 18  # 512 KiB of uint16 per shard
TOKEN_DTYPE = np.dtype("<u2")  # what prepare_dataset writes
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
MAX_VOCAB_SIZE = 1 << 32

# The tinycorpus sources: ~3 MB of real, varied English-and-code text that every Python 3.11
# install ships (no package from a distribution's optional split: no tkinter, lib2to3, distutils).
STDLIB_SOURCES: tuple[str, ...] = (
    "argparse.py", "typing.py", "_pydecimal.py", "inspect.py", "pydoc.py", "subprocess.py",
    "tarfile.py", "logging/__init__.py", "mailbox.py", "doctest.py", "ssl.py", "datetime.py",
    "pathlib.py", "shutil.py", "zipfile.py", "asyncio/base_events.py",
    "email/_header_value_parser.py", "http/client.py", "urllib/request.py", "unittest/mock.py",
    "unittest/case.py", "threading.py", "collections/__init__.py", "configparser.py",
    "dataclasses.py", "enum.py", "difflib.py", "statistics.py", "pickle.py", "_pyio.py",
    "optparse.py", "imaplib.py", "smtplib.py", "platform.py", "socket.py", "tempfile.py",
    "traceback.py", "functools.py", "random.py", "textwrap.py",
)


# ----------------------------------------------------------------------------- manifest


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True, extra="ignore")


class TokenizerInfo(_Wire):
    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    vocab_size: int = Field(gt=0, le=MAX_VOCAB_SIZE)
    version: str = Field(description="bpe<vocab>-<first 12 hex of the tokenizer.json sha256>")
    kind: str = Field(default="byte-level-bpe",
                      description="byte-level-bpe (trained here) or hf-<model type> (a user's tokenizer.json)")


class ShardInfo(_Wire):
    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    num_tokens: int = Field(ge=0)


class SourceInfo(_Wire):
    path: str = Field(description="relative to the source root (the Python stdlib for tinycorpus)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)


class ImportInfo(_Wire):
    """How ``trainyard-data import`` read its inputs (absent from manifests written by ``prepare``)."""

    documents: int = Field(ge=0, description="documents encoded, each followed by the separator token")
    skipped_records: int = Field(ge=0, description="bad records skipped (--skip-bad); 0 without it")
    skip_bad: bool = False
    text_field: str = Field(description="the JSONL field holding each document's text")
    column: str = Field(description="the Parquet column holding each document's text")
    eos_token_id: int = Field(ge=0)
    tokenizer_source: Literal["user", "trained"]


# Fields added after format 1 was first written: left out of manifest.json while unset, so a
# manifest written before they existed re-serialises to the same bytes (and the same sha256).
_ADDITIVE_FIELDS = ("import_info",)


class DatasetManifest(_Wire):
    """``manifest.json`` of one dataset version."""

    format_version: int = FORMAT_VERSION
    name: str
    version: str
    dtype: Literal["uint16", "uint32"] = "uint16"
    byte_order: Literal["little"] = "little"
    separator: str = END_OF_TEXT
    tokenizer: TokenizerInfo
    shards: list[ShardInfo]
    num_tokens: int = Field(ge=0)
    sources: list[SourceInfo]
    source_kind: str = "python-stdlib"
    source_python: str | None = None
    created_at: datetime | None = Field(
        default=None,
        description="when prepare built it; None (left out) for an import, whose manifest is a function of its inputs",
    )
    import_info: ImportInfo | None = None

    @property
    def tokenizer_version(self) -> str:
        return self.tokenizer.version

    @property
    def token_dtype(self) -> np.dtype:
        return TOKEN_DTYPES[self.dtype]

    def to_bytes(self) -> bytes:
        unset = {f for f in (*_ADDITIVE_FIELDS, "created_at") if getattr(self, f) is None}
        return self.model_dump_json(by_alias=True, indent=2, exclude=unset).encode()


def _location(value: Path | str | ObjectPath) -> Path | ObjectPath:
    """A dataset file's location: an object-store URL, or a path as given (not resolved)."""
    return as_location(value) if is_object_url(value) else Path(value)  # type: ignore[arg-type]  # not a URL: a path


def load_dataset_manifest(path: Path | str | ObjectPath) -> DatasetManifest:
    """Parse a ``manifest.json`` (a path, or an object-store URL); a missing or malformed manifest is a
    :class:`DataError`."""
    path = _location(path)
    try:
        return DatasetManifest.model_validate_json(read_bytes(path))
    except FileNotFoundError:
        raise DataError(f"dataset manifest not found: {path}") from None
    except (ValidationError, ValueError) as exc:
        raise DataError(f"dataset manifest {path} is malformed: {exc}") from exc


def verify_dataset(directory: Location, manifest: DatasetManifest) -> list[str]:
    """Every problem with the tokenizer and shard files of ``manifest`` in ``directory`` (a directory, or a
    prefix in an object store: sizes listed, sha256 streamed); empty when intact."""
    files = [(manifest.tokenizer.file, None, manifest.tokenizer.sha256)] + [
        (s.file, s.size_bytes, s.sha256) for s in manifest.shards
    ]
    problems = []
    for name, size, sha in files:
        location = directory / name
        if not is_file(location):
            problems.append(f"{name} is missing")
        elif size is not None and (actual := stat_size(location)) != size:
            problems.append(f"{name} has {actual} bytes, manifest says {size}")
        elif (digest := sha256_of(location)) != sha:
            problems.append(f"{name} sha256 {digest[:12]}… does not match manifest {sha[:12]}…")
    return problems


# ----------------------------------------------------------------------------- building (pure parts)


def split_into_shards(ids: np.ndarray, shard_tokens: int) -> list[np.ndarray]:
    """Cut a token stream into consecutive shards of at most ``shard_tokens`` tokens."""
    if shard_tokens <= 0:
        raise ValueError("shard_tokens must be positive")
    return [ids[i : i + shard_tokens] for i in range(0, len(ids), shard_tokens)] or [ids[:0]]


def tokenizer_version(vocab_size: int, tokenizer_sha256: str) -> str:
    return f"bpe{vocab_size}-{tokenizer_sha256[:12]}"


def token_dtype_for(vocab_size: int) -> Literal["uint16", "uint32"]:
    """The narrowest stored dtype for ids ``0 .. vocab_size - 1``."""
    if not 0 < vocab_size <= MAX_VOCAB_SIZE:
        raise DataError(f"a vocabulary of {vocab_size} tokens cannot be stored (at most {MAX_VOCAB_SIZE})")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> str:
    """Train a byte-level BPE on ``texts`` (a sequence, or any iterable: it is streamed); returns
    the tokenizer as canonical JSON text, its one special token :data:`END_OF_TEXT`.

    Deterministic for the same texts and vocabulary size (checked by the tests).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    length = len(texts) if isinstance(texts, Sized) else None
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    if tokenizer.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, wanted at most {vocab_size}")
    return tokenizer.to_str()


def encode_documents(tokenizer_json: str, texts: Sequence[str]) -> np.ndarray:
    """Token ids of ``texts`` joined by the end-of-text token, as uint16 little-endian."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True  # a source's literal "<|endoftext|>" is text, not a separator
    eot = tokenizer.token_to_id(END_OF_TEXT)
    if eot is None:
        raise DataError(f"tokenizer has no {END_OF_TEXT} token")
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts)):
        stream.extend(encoding.ids)
        stream.append(eot)
    if stream and max(stream) >= 1 << 16:
        raise DataError("token ids do not fit in uint16")
    return np.asarray(stream, dtype=TOKEN_DTYPE)


# ----------------------------------------------------------------------------- building (I/O)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_sources(root: Path, relative_paths: Sequence[str]) -> tuple[list[str], list[SourceInfo]]:
    """Read each source as UTF-8 text and describe it; a missing source is a DataError."""
    texts, infos = [], []
    for rel in relative_paths:
        path = root / rel
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"source file {rel} not found under {root}") from None
        texts.append(raw.decode("utf-8"))
        infos.append(SourceInfo(path=rel, sha256=hashlib.sha256(raw).hexdigest(), size_bytes=len(raw)))
    return texts, infos


def prepare_dataset(
    root: Path | str,
    name: str,
    version: str,
    *,
    sources: Sequence[str] = STDLIB_SOURCES,
    source_root: Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    clock: Callable[[], datetime] = utcnow,
) -> tuple[Path, str, DatasetManifest]:
    """Build dataset ``name@version`` under the artifact ``root``; idempotent.

    Returns ``(manifest_path, sha256 of manifest.json, manifest)``. When the version already
    exists and verifies, nothing is written. An existing version that fails verification is a
    :class:`DataError` (a published version is immutable; delete it by hand to rebuild). The
    files are built in a temporary sibling directory that is renamed into place, so a crash
    or a concurrent builder never leaves a half-written version behind.
    """
    final = ArtifactLayout(root).dataset_dir(name, version)
    manifest_path = final / MANIFEST_FILE
    if manifest_path.exists():
        return _existing(final)
    if final.exists():  # an interrupted build of an older trainyard; never had a manifest
        shutil.rmtree(final)

    src_root = source_root or stdlib_root()
    texts, source_infos = read_sources(src_root, sources)
    tokenizer_json = train_tokenizer(texts, vocab_size)
    ids = encode_documents(tokenizer_json, texts)

    staging = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    tokenizer_bytes = tokenizer_json.encode()
    tok_sha = hashlib.sha256(tokenizer_bytes).hexdigest()
    shard_infos = _stage_files(staging, tokenizer_bytes, ids, shard_tokens)
    manifest = DatasetManifest(
        name=name,
        version=version,
        tokenizer=TokenizerInfo(
            file=TOKENIZER_FILE, sha256=tok_sha, vocab_size=vocab_size,
            version=tokenizer_version(vocab_size, tok_sha),
        ),
        shards=shard_infos,
        num_tokens=int(len(ids)),
        sources=source_infos,
        source_kind="python-stdlib" if source_root is None else "files",
        source_python=platform.python_version() if source_root is None else None,
        created_at=clock(),
    )
    atomic_write_bytes(staging / MANIFEST_FILE, manifest.to_bytes())
    try:
        os.rename(staging, final)
    except OSError:  # another builder won the race; keep theirs if it verifies
        shutil.rmtree(staging, ignore_errors=True)
        if manifest_path.exists():
            return _existing(final)
        raise
    fsync_dir(final.parent)
    log.info("dataset %s@%s: %d tokens in %d shards, tokenizer %s",
             name, version, manifest.num_tokens, len(shard_infos), manifest.tokenizer.version)
    return manifest_path, sha256_file(manifest_path), manifest


def _stage_files(staging: Path, tokenizer_bytes: bytes, ids: np.ndarray, shard_tokens: int) -> list[ShardInfo]:
    """Write the tokenizer and the token shards into a fresh ``staging`` directory; what each shard holds."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    atomic_write_bytes(staging / TOKENIZER_FILE, tokenizer_bytes)
    shard_infos = []
    for i, shard in enumerate(split_into_shards(ids, shard_tokens)):
        data = shard.astype(TOKEN_DTYPE, copy=False).tobytes()
        file = f"shard-{i:05d}.bin"
        atomic_write_bytes(staging / file, data)
        shard_infos.append(ShardInfo(
            file=file, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), num_tokens=len(shard)
        ))
    return shard_infos


def _existing(directory: Path) -> tuple[Path, str, DatasetManifest]:
    _, sha, manifest = existing_dataset(directory)
    return directory / MANIFEST_FILE, sha, manifest


def existing_dataset(directory: Location) -> tuple[Location, str, DatasetManifest]:
    """A published version (a directory or an object-store prefix) once it verifies: (manifest location,
    sha256 of manifest.json, manifest). DataError without a manifest, or when it does not verify (a
    published version is immutable: delete it by hand to rebuild)."""
    manifest_path = directory / MANIFEST_FILE
    manifest = load_dataset_manifest(manifest_path)
    if problems := verify_dataset(directory, manifest):
        raise DataError(
            f"dataset {manifest.name}@{manifest.version} at {directory} exists but does not verify: "
            + "; ".join(problems)
        )
    return manifest_path, sha256_of(manifest_path), manifest


def upload_dataset(directory: Path, destination: ObjectPath) -> ObjectPath:
    """Copy the dataset version in ``directory`` to the object-store prefix ``destination``: tokenizer and
    shards (each upload's size and sha256 checked against the manifest as it streams), then
    ``manifest.json``, the commit point, with a create-only PUT. Nothing is copied when the store already
    holds the same manifest; another manifest there is a :class:`DataError` (a published version is
    immutable). Returns the manifest's location."""
    raw = (directory / MANIFEST_FILE).read_bytes()
    target = destination / MANIFEST_FILE
    try:
        if read_bytes(target) == raw:
            return target
        raise DataError(f"{target} holds another manifest than {directory}: a published version is immutable")
    except FileNotFoundError:
        pass
    manifest = load_dataset_manifest(directory / MANIFEST_FILE)
    expected = [(manifest.tokenizer.file, None, manifest.tokenizer.sha256),
                *((s.file, s.size_bytes, s.sha256) for s in manifest.shards)]
    for name, size, sha in expected:
        sent = upload_file(directory / name, destination / name)
        if sent[1] != sha or (size is not None and sent[0] != size):
            raise DataError(f"{directory / name} does not match its manifest ({sent[0]} bytes, sha256 "
                            f"{sent[1][:12]}…): not uploading {manifest.name}@{manifest.version}")
    try:
        upload_file(directory / MANIFEST_FILE, target, exclusive=True)
    except FileExistsError:  # another uploader committed first: fine when it is the same version
        if read_bytes(target) != raw:
            raise DataError(f"{target} holds another manifest than {directory}: a published version is "
                            "immutable") from None
    log.info("dataset %s@%s uploaded to %s", manifest.name, manifest.version, destination)
    return target


# ----------------------------------------------------------------------------- reading


def samples_in_shard(num_tokens: int, sequence_length: int) -> int:
    """How many windows of ``sequence_length + 1`` tokens, stride ``sequence_length``, fit."""
    return max(0, (num_tokens - 1) // sequence_length)


class TokenDataset:
    """Fixed windows of ``sequence_length + 1`` tokens over the shards of one dataset version."""

    OPEN_CACHED = 8  # shards read through a cache kept mapped (reopening one is a cheap cache hit)

    def __init__(self, manifest_path: Path | str | ObjectPath, sequence_length: int, *,
                 cache: Any = None) -> None:
        self.manifest_path: Any = _location(manifest_path)
        self.directory = self.manifest_path.parent
        self.manifest = load_dataset_manifest(self.manifest_path)
        self.cache = cache  # a trainyard.shardcache.ShardCache
        if cache is None and isinstance(self.manifest_path, ObjectPath):
            raise DataError(f"dataset {self.manifest_path} is in an object store: read it through a ShardCache")
        self.sequence_length = sequence_length
        counts = [samples_in_shard(s.num_tokens, sequence_length) for s in self.manifest.shards]
        self._starts = np.cumsum([0, *counts]).tolist()
        self.num_samples = int(self._starts[-1])
        if self.num_samples == 0:
            raise DataError(
                f"dataset {self.manifest.name}@{self.manifest.version} has no window of "
                f"{sequence_length + 1} tokens"
            )
        self._open: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def shard(self, index: int) -> np.ndarray:
        """The tokens of shard ``index``, memory-mapped after its size and sha256 check out."""
        if (tokens := self._open.pop(index, None)) is not None:
            self._open[index] = tokens  # most recently used last
            return tokens
        info = self.manifest.shards[index]
        dtype = self.manifest.token_dtype
        if self.cache is not None:  # a verified node-local copy: size and sha256 checked as it was fetched
            tokens = self._map_cached(index)
            if index + 1 < len(self.manifest.shards):
                self._prefetch_shard(index + 1)
            self._open[index] = tokens
            while len(self._open) > self.OPEN_CACHED:  # the cache may delete the others: let their disk go
                self._open.pop(next(iter(self._open)))
            return tokens
        path = cast(Path, self.directory) / info.file  # no cache: a local dataset (__init__ refuses others)
        if not path.is_file():
            raise DataError(f"dataset shard {info.file} is missing: {path}")
        if (size := path.stat().st_size) != info.size_bytes or size != info.num_tokens * dtype.itemsize:
            raise DataError(f"dataset shard {info.file} has {size} bytes, manifest says {info.size_bytes}")
        if (digest := sha256_file(path)) != info.sha256:
            raise DataError(
                f"dataset shard {info.file} sha256 {digest[:12]}… does not match manifest {info.sha256[:12]}…"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r") if info.num_tokens else np.empty(0, dtype)
        self._open[index] = tokens
        return tokens

    def _map_cached(self, index: int) -> np.ndarray:
        """Shard ``index`` from the cache, memory-mapped; fetched again if another rank's eviction
        deleted it between the lookup and the mapping."""
        info, dtype = self.manifest.shards[index], self.manifest.token_dtype
        if not info.num_tokens:
            return np.empty(0, dtype)
        for _ in range(3):
            path = self.cache.get(self.directory / info.file, info.sha256, info.size_bytes)
            try:
                return np.memmap(path, dtype=dtype, mode="r")
            except FileNotFoundError:
                continue
        raise DataError(f"dataset shard {info.file} keeps disappearing from the shard cache {self.cache.directory}: "
                        "is it too small for the shards the node's ranks read at once? Raise "
                        "TRAINYARD_SHARD_CACHE_MAX_GB")

    def prefetch(self, samples: Sequence[int]) -> None:
        """Start fetching the shards of ``samples`` (what this rank reads next) into the cache."""
        if self.cache is not None:
            for index in sorted({self.locate(s)[0] for s in samples}):
                self._prefetch_shard(index)

    def _prefetch_shard(self, index: int) -> None:
        if index not in self._open:
            info = self.manifest.shards[index]
            self.cache.prefetch(self.directory / info.file, info.sha256, info.size_bytes)

    def locate(self, sample: int) -> tuple[int, int]:
        """``(shard index, first token offset)`` of a sample id."""
        if not 0 <= sample < self.num_samples:
            raise IndexError(f"sample {sample} out of range 0..{self.num_samples - 1}")
        shard = bisect.bisect_right(self._starts, sample) - 1
        return shard, (sample - self._starts[shard]) * self.sequence_length

    def window(self, sample: int) -> np.ndarray:
        shard, offset = self.locate(sample)
        return self.shard(shard)[offset : offset + self.sequence_length + 1]

    def windows(self, samples: Sequence[int]) -> np.ndarray:
        """A ``(len(samples), sequence_length + 1)`` int64 array."""
        return np.stack([self.window(s) for s in samples]).astype(np.int64)


def describe(manifest: DatasetManifest) -> str:
    return json.dumps({
        "name": manifest.name, "version": manifest.version, "numTokens": manifest.num_tokens,
        "shards": len(manifest.shards), "tokenizer": manifest.tokenizer.version,
    })
