"""``trainyard-data import``: a dataset version from the user's own files and tokenizer.

Inputs are files, directories (walked recursively, hidden entries skipped) or globs, local or
fsspec URLs (``s3://…``, ``memory://…``; the filesystem's fsspec package must be installed):

    *.txt       one document per file
    *.jsonl     one document per line, its text in ``text_field`` (blank lines are not records)
    *.parquet   one document per row, its text in ``column``

``.txt`` and ``.jsonl`` may be compressed: ``.gz`` (gzip) or ``.zst``/``.zstd`` (zstandard).

Determinism: the documents are read in a fixed order (inputs in the order given; within a
directory or a glob, by path), encoded in chunks whose results are put back in that order,
and cut into shards of a fixed number of tokens. The manifest has no creation time, so the
same inputs + tokenizer + options give the same ``manifest.json`` bytes (and sha256) whatever
the number of workers; a source is recorded by its path below the input that named it, so
the same files elsewhere give the same version too.

Atomicity: shards, tokenizer and manifest are written into a hidden staging directory next to
the version and renamed into place at the end; any error removes the staging directory, so a
version is either complete or absent. An existing version is left alone when it was built from
the same tokenizer and inputs, and is an error otherwise (a published version is immutable).

Under an object-store root (``s3://bucket/prefix``) nothing is renamed (S3 has no rename): the
tokenizer and shards are uploaded straight under the version's prefix, each shard's sha256 and
size taken from the bytes as they stream up (:class:`~trainyard_contract.storage.HashingWriter`),
and ``manifest.json`` is written last with a create-only PUT: it is the commit point, and a prefix
without one is no version (what an interrupted import left is cleared by the next). Two imports
of one version at once are not coordinated beyond that PUT: the first manifest stands, and the
other import is judged against it as for an existing version.

Special tokens: a document is text, never markup. It is encoded with the tokenizer's special-token matching
off (``encode_special_tokens``), so a literal ``<|endoftext|>`` (or any special token's text) in a document
is spelled with ordinary tokens, and the shard holds exactly one separator per document. A tokenizer whose
model itself maps some text to a special id (a word-level vocabulary holding ``</s>`` as a word) has no
other spelling for it: that record is a bad record (:func:`documents_with_reserved_ids`).

Layout (split like the rest of the codebase): the parts that decide are pure functions
(:func:`classify`, :func:`choose_eos`, :func:`reserved_ids`, :func:`parse_records`,
:func:`documents_with_reserved_ids`, :func:`join_documents`); the shell reads files, runs the worker pool
and writes the version.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import gzip
import hashlib
import io
import json
import logging
import multiprocessing
import os
import shutil
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from trainyard_contract.errors import DataError
from trainyard_contract.storage import (
    ArtifactLayout,
    Location,
    ObjectPath,
    atomic_write_bytes,
    exists,
    fsync_dir,
    remove_tree,
    sha256_file,
    sha256_of,
    upload,
)

from trainyard.data import (
    DEFAULT_VOCAB_SIZE,
    END_OF_TEXT,
    MANIFEST_FILE,
    TOKEN_DTYPES,
    TOKENIZER_FILE,
    DatasetManifest,
    ImportInfo,
    ShardInfo,
    SourceInfo,
    TokenizerInfo,
    load_dataset_manifest,
    token_dtype_for,
    tokenizer_version,
    train_tokenizer,
    verify_dataset,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_IMPORT_SHARD_TOKENS",
    "EOS_CANDIDATES",
    "ImportOptions",
    "ImportResult",
    "InputFile",
    "choose_eos",
    "classify",
    "documents_with_reserved_ids",
    "expand_inputs",
    "import_dataset",
    "join_documents",
    "parse_records",
    "reserved_ids",
]

DEFAULT_IMPORT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16, 64 MiB of uint32
CHUNK_BYTES = 1 << 20  # a worker's task: about 1 MiB of input text
FORMATS: dict[str, Literal["txt", "jsonl", "parquet"]] = {
    ".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
}
COMPRESSIONS: dict[str, Literal["gzip", "zstd"]] = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
# End-of-document tokens of the common tokenizer families, in the order they are looked for among
# a tokenizer's special tokens (GPT-2/NeoX, Llama 3, Llama 2/Mistral/T5, Gemma).
EOS_CANDIDATES: tuple[str, ...] = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


# ----------------------------------------------------------------------------- options and results


@dataclass(frozen=True)
class ImportOptions:
    """Everything that, with the inputs and the tokenizer, determines the version's bytes."""

    text_field: str = "text"
    column: str = "text"
    skip_bad: bool = False
    eos_token: str | None = None  # None: the tokenizer's own (see EOS_CANDIDATES)
    vocab_size: int = DEFAULT_VOCAB_SIZE  # only when the tokenizer is trained on the corpus
    shard_tokens: int = DEFAULT_IMPORT_SHARD_TOKENS


@dataclass(frozen=True)
class ImportResult:
    manifest_path: Location  # an ObjectPath under an object-store root
    sha256: str
    manifest: DatasetManifest
    created: bool  # False: the version existed (same inputs and tokenizer) and was left alone
    seconds: float = 0.0


@dataclass(frozen=True)
class InputFile:
    """One file to read: ``url`` is what is opened (and named in errors), ``relative`` what the
    manifest records (its path below the input argument that named it)."""

    url: str
    relative: str
    format: Literal["txt", "jsonl", "parquet"]
    compression: Literal["gzip", "zstd"] | None
    remote: bool = False


# ----------------------------------------------------------------------------- pure decisions


def classify(name: str) -> tuple[Literal["txt", "jsonl", "parquet"], Literal["gzip", "zstd"] | None] | None:
    """``(format, compression)`` of a file name by its suffixes; None when not an input format."""
    lower = name.lower()
    compression = None
    for suffix, kind in COMPRESSIONS.items():
        if lower.endswith(suffix):
            compression, lower = kind, lower[: -len(suffix)]
            break
    for suffix, fmt in FORMATS.items():
        if lower.endswith(suffix):
            if fmt == "parquet" and compression is not None:
                return None  # Parquet compresses its pages itself
            return fmt, compression
    return None


def choose_eos(vocab: Mapping[str, int], special: Sequence[str], requested: str | None) -> tuple[str, int]:
    """The end-of-document token and its id: ``requested`` if given, else the first of
    :data:`EOS_CANDIDATES` among the tokenizer's ``special`` tokens."""
    if requested is not None:
        if requested not in vocab:
            raise DataError(f"--eos-token {requested!r} is not a token of the tokenizer")
        return requested, vocab[requested]
    for candidate in EOS_CANDIDATES:
        if candidate in special and candidate in vocab:
            return candidate, vocab[candidate]
    shown = ", ".join(sorted(special)) or "none"
    raise DataError(
        f"the tokenizer has no end-of-document token among its special tokens ({shown}); "
        f"looked for {', '.join(EOS_CANDIDATES)}: pass --eos-token TOKEN"
    )


def reserved_ids(special_ids: Iterable[int], eos_id: int, unk_id: int | None) -> frozenset[int]:
    """The ids no document may contain: the tokenizer's special tokens and the separator. The model's
    unknown token is not one of them (unless it is the separator): it is how the model spells text it has
    no tokens for, not markup."""
    reserved = set(special_ids) - ({unk_id} if unk_id is not None else set())
    return frozenset(reserved | {eos_id})


def documents_with_reserved_ids(joined: np.ndarray, lengths: Sequence[int],
                                reserved: frozenset[int]) -> list[tuple[int, int]]:
    """``(document index, first reserved id inside it)`` of each document holding a reserved id, in
    ``joined``: documents of ``lengths`` ids, each followed by its separator (as :func:`join_documents`
    writes them; the separators themselves are not inside a document)."""
    if not reserved or not len(lengths):
        return []
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64) + 1) - 1  # where the separators are
    hits = np.flatnonzero(np.isin(joined, np.fromiter(reserved, dtype=np.int64)))  # one vectorised pass
    inside = hits[~np.isin(hits, ends)]
    first: dict[int, int] = {}
    for document, position in zip(np.searchsorted(ends, inside).tolist(), inside.tolist()):
        first.setdefault(document, int(joined[position]))
    return sorted(first.items())


@dataclass
class Parsed:
    texts: list[str] = field(default_factory=list)
    places: list[str] = field(default_factory=list)  # where each text is, as errors name it
    skipped: int = 0
    error: str | None = None

    def add(self, text: str, place: str) -> None:
        self.texts.append(text)
        self.places.append(place)


def parse_records(task: Task, skip_bad: bool) -> Parsed:
    """The document texts of one task; a bad record is an error naming file and line (row), or
    is counted and skipped with ``skip_bad``. Stops at the first error."""
    out = Parsed()

    def bad(message: str) -> bool:
        if skip_bad:
            out.skipped += 1
            return False
        out.error = message
        return True

    if task.kind == "txt":
        for raw in task.items:
            try:
                out.add(raw.decode("utf-8"), task.label)
            except UnicodeDecodeError as exc:
                if bad(f"{task.label}: not valid UTF-8 at byte {exc.start}"):
                    return out
    elif task.kind == "jsonl":
        for offset, line in enumerate(task.items):
            where = f"{task.label}:{task.first + offset}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError as exc:
                if bad(f"{where}: not valid UTF-8 ({exc.reason})"):
                    return out
                continue
            except ValueError as exc:
                if bad(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})"):
                    return out
                continue
            if not isinstance(record, dict):
                if bad(f"{where}: a JSON {type(record).__name__}, not an object with a {task.field!r} field"):
                    return out
                continue
            if task.field not in record:
                fields = ", ".join(sorted(record)[:8]) or "none"
                if bad(f"{where}: no field {task.field!r} (its fields: {fields}); choose one with --text-field"):
                    return out
                continue
            text = record[task.field]
            if not isinstance(text, str):
                if bad(f"{where}: field {task.field!r} is {_json_kind(text)}, not a string"):
                    return out
                continue
            out.add(text, where)
    else:  # parquet: the column's values, row numbers from 1
        for offset, value in enumerate(task.items):
            if not isinstance(value, str):
                kind = "null" if value is None else type(value).__name__
                if bad(f"{task.label}: row {task.first + offset}: column {task.field!r} is {kind}, not a string"):
                    return out
                continue
            out.add(value, f"{task.label}: row {task.first + offset}")
    return out


def _json_kind(value: Any) -> str:
    return "null" if value is None else {dict: "an object", list: "an array", bool: "a boolean"}.get(
        type(value), "a number")


def join_documents(id_lists: Iterable[Sequence[int]], eos_id: int) -> np.ndarray:
    """Each document's ids followed by the end-of-document id, as one uint32 array."""
    id_lists = list(id_lists)
    total = sum(len(ids) for ids in id_lists) + len(id_lists)
    out = np.empty(total, dtype=np.uint32)
    pos = 0
    for ids in id_lists:
        n = len(ids)
        out[pos : pos + n] = ids
        out[pos + n] = eos_id
        pos += n + 1
    return out


# ----------------------------------------------------------------------------- tasks (main → worker)


@dataclass(frozen=True)
class Task:
    kind: Literal["txt", "jsonl", "parquet"]
    label: str  # the file, as errors name it
    first: int  # line (jsonl) or row (parquet) number of items[0], from 1
    items: list[Any]  # bytes (txt: one file, jsonl: lines) or column values (parquet)
    field: str = "text"
    raw_bytes: int = 0  # input bytes (as stored) read for this task, for the progress bar


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray
    documents: int
    skipped: int
    error: str | None
    raw_bytes: int


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str, eos_id: int, reserved: frozenset[int], skip_bad: bool) -> None:
    """Pool initializer: one single-threaded tokenizer per worker process (the pool is the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True  # a document's "<|endoftext|>" is text, not the separator
    _WORKER.update(tokenizer=tokenizer, eos_id=eos_id, reserved=reserved, skip_bad=skip_bad)


def _encode(task: Task) -> Encoded:
    parsed = parse_records(task, _WORKER["skip_bad"])
    tokenizer, reserved = _WORKER["tokenizer"], _WORKER["reserved"]
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # the same ids, no offsets
    id_lists = [e.ids for e in encode(parsed.texts, add_special_tokens=False)]
    ids = join_documents(id_lists, _WORKER["eos_id"])
    error, skipped = parsed.error, parsed.skipped
    if found := documents_with_reserved_ids(ids, [len(x) for x in id_lists], reserved):
        if not _WORKER["skip_bad"]:  # these records come before any parse error: theirs is the first
            index, token_id = found[0]
            error = (f"{parsed.places[index]}: the text encodes to the special token "
                     f"{tokenizer.id_to_token(token_id)!r} (id {token_id}) even with special-token matching "
                     "off: this tokenizer has no other spelling for it")
        dropped = {index for index, _ in found}
        id_lists = [x for i, x in enumerate(id_lists) if i not in dropped]
        ids = join_documents(id_lists, _WORKER["eos_id"])
        skipped += len(dropped)
    if error is not None:
        return Encoded(np.empty(0, np.uint32), 0, skipped, error, task.raw_bytes)
    return Encoded(ids, len(id_lists), skipped, None, task.raw_bytes)


# ----------------------------------------------------------------------------- reading inputs (I/O)


def _is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


def expand_inputs(inputs: Sequence[str]) -> list[InputFile]:
    """The files named by ``inputs`` (files, directories, globs; local or fsspec URLs), in a
    deterministic order: inputs as given, each directory's or glob's files by path; a file
    named twice is read once."""
    if not inputs:
        raise DataError("no inputs: name files, directories or globs of .txt, .jsonl or .parquet")
    files: list[InputFile] = []
    seen: set[str] = set()
    for inp in inputs:
        found = _expand_url(inp) if _is_url(inp) else _expand_local(inp)
        for f in found:
            key = f.url if f.remote else str(Path(f.url).resolve())
            if key not in seen:
                seen.add(key)
                files.append(f)
    if not files:
        raise DataError(f"no .txt, .jsonl or .parquet files (optionally .gz/.zst) in {', '.join(inputs)}")
    return files


def _expand_local(inp: str) -> list[InputFile]:
    text = inp.removeprefix("file://")
    path = Path(text)
    if globlib.has_magic(text):
        base = _glob_base(text)
        matches = sorted(m for m in globlib.glob(text, recursive=True) if Path(m).is_file())
        pairs = [(m, os.path.relpath(m, base)) for m in matches]
        if not pairs:
            raise DataError(f"input {inp}: the glob matches no file")
    elif path.is_dir():
        pairs = [
            (str(p), p.relative_to(path).as_posix())
            for p in sorted(path.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
    elif path.is_file():
        if classify(path.name) is None:
            raise DataError(
                f"input {inp}: not a .txt, .jsonl or .parquet file (optionally .gz/.zst; Parquet uncompressed)"
            )
        pairs = [(text, path.name)]
    else:
        raise DataError(f"input {inp} not found (no such file, directory or glob match)")
    out = []
    for url, rel in pairs:
        if (kind := classify(url)) is not None:
            out.append(InputFile(url=url, relative=Path(rel).as_posix(), format=kind[0], compression=kind[1]))
    return out


def _glob_base(pattern: str) -> str:
    parts = Path(pattern).parts
    static = []
    for part in parts:
        if globlib.has_magic(part):
            break
        static.append(part)
    return str(Path(*static)) if static else "."


def _expand_url(inp: str) -> list[InputFile]:
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise DataError(f"input {inp}: URLs need the fsspec package (pip install fsspec)") from None
    try:
        fs, root = url_to_fs(inp)
        if globlib.has_magic(root):
            base = _glob_base(root)
            paths = sorted(p for p in fs.glob(root) if fs.isfile(p))
        elif fs.isdir(root):
            base, paths = root, sorted(fs.find(root))
        elif fs.isfile(root):
            base, paths = os.path.dirname(root.rstrip("/")), [root]
        else:
            raise DataError(f"input {inp} not found")
    except DataError:
        raise
    except (ImportError, ValueError) as exc:
        raise DataError(f"input {inp}: no filesystem for this URL ({exc})") from None
    except OSError as exc:
        raise DataError(f"input {inp}: cannot list ({exc})") from None
    out = []
    for p in paths:
        rel = os.path.relpath(p, base) if base else p
        if any(part.startswith(".") for part in Path(rel).parts):
            continue
        if (kind := classify(p)) is not None:
            out.append(InputFile(url=fs.unstrip_protocol(p), relative=Path(rel).as_posix(),
                                 format=kind[0], compression=kind[1], remote=True))
    return out


class _HashingReader(io.RawIOBase):
    """Reads through ``raw``, hashing and counting the stored bytes (the source's sha256)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.sha, self.count, self._reported = raw, hashlib.sha256(), 0, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.sha.update(data)
        self.count += n
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def take_progress(self) -> int:
        delta, self._reported = self.count - self._reported, self.count
        return delta


def _open(f: InputFile) -> IO[bytes]:
    if f.remote:
        import fsspec

        return fsspec.open(f.url, "rb").open()
    return open(f.url, "rb")


def _decompressed(f: InputFile, raw: io.RawIOBase) -> io.BufferedIOBase:
    if f.compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if f.compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{f.url}: zstd input needs the zstandard package (pip install zstandard)") from None
        return io.BufferedReader(_ChunkReader(_zstd_chunks(zstandard, raw, f.url)), buffer_size=1 << 20)
    return io.BufferedReader(raw, buffer_size=1 << 20)


def _zstd_chunks(zstandard: Any, raw: io.RawIOBase, label: str) -> Iterator[bytes]:
    """Decompressed bytes of every zstd frame in ``raw``; a truncated last frame is an error
    (zstandard's stream reader ends silently there)."""
    dctx = zstandard.ZstdDecompressor()
    obj, in_frame = dctx.decompressobj(), False
    while chunk := raw.read(1 << 20):
        while chunk:
            in_frame = True
            yield obj.decompress(chunk)
            if obj.eof:
                chunk, obj, in_frame = obj.unused_data, dctx.decompressobj(), False
            else:
                chunk = b""
    if in_frame:
        raise DataError(f"{label}: cannot read (zstd stream ends inside a frame: truncated?)")


class _ChunkReader(io.RawIOBase):
    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.rest = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.rest:
            try:
                self.rest = next(self.chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self.rest))
        buffer[:n], self.rest = self.rest[:n], self.rest[n:]
        return n


_READ_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)


def _read_errors() -> tuple[type[BaseException], ...]:
    with contextlib.suppress(ImportError):
        import zstandard

        return (*_READ_ERRORS, zstandard.ZstdError)
    return _READ_ERRORS


def _tasks(f: InputFile, options: ImportOptions, sources: list[SourceInfo]) -> Iterator[Task]:
    """Tasks of about :data:`CHUNK_BYTES` from one file; appends its :class:`SourceInfo` when read to the end."""
    errors = _read_errors()
    try:
        if f.format == "parquet":
            yield from _parquet_tasks(f, options, sources)
            return
        with _open(f) as raw_file:
            hashing = _HashingReader(raw_file)
            stream = _decompressed(f, hashing)
            if f.format == "txt":
                data = stream.read()
                yield Task("txt", f.url, 1, [data], raw_bytes=hashing.take_progress())
            else:
                lines: list[bytes] = []
                first, size = 1, 0
                for number, line in enumerate(stream, start=1):
                    lines.append(line)
                    size += len(line)
                    if size >= CHUNK_BYTES:
                        yield Task("jsonl", f.url, first, lines, options.text_field, hashing.take_progress())
                        lines, first, size = [], number + 1, 0
                if lines:
                    yield Task("jsonl", f.url, first, lines, options.text_field, hashing.take_progress())
            hashing.drain()
            sources.append(SourceInfo(path=f.relative, sha256=hashing.sha.hexdigest(), size_bytes=hashing.count))
    except DataError:
        raise
    except errors as exc:
        raise DataError(f"{f.url}: cannot read ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return str(exc) or type(exc).__name__


def _parquet_tasks(f: InputFile, options: ImportOptions, sources: list[SourceInfo]) -> Iterator[Task]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{f.url}: Parquet input needs the pyarrow package (pip install pyarrow)") from None
    with _open(f) as raw_file:
        try:
            parquet = pq.ParquetFile(raw_file)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{f.url}: cannot read as Parquet ({exc})") from None
        names = parquet.schema_arrow.names
        if options.column not in names:
            raise DataError(
                f"{f.url}: no column {options.column!r} (its columns: {', '.join(names[:8])}); choose one with --column"
            )
        total = max(1, parquet.metadata.num_rows)
        size = _size(f)
        row = 1
        try:
            for batch in parquet.iter_batches(columns=[options.column], batch_size=4096):
                values = batch.column(0).to_pylist()
                yield Task("parquet", f.url, row, values, options.column, raw_bytes=size * len(values) // total)
                row += len(values)
        except pa.ArrowException as exc:
            raise DataError(f"{f.url}: row {row}: cannot read ({exc})") from None
    with _open(f) as raw_file:  # the stored bytes' sha256 (Parquet is read by random access)
        hashing = _HashingReader(raw_file)
        hashing.drain()
    sources.append(SourceInfo(path=f.relative, sha256=hashing.sha.hexdigest(), size_bytes=hashing.count))


def _size(f: InputFile) -> int:
    if f.remote:
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(f.url)
        return int(fs.size(path) or 0)
    return os.stat(f.url).st_size


def hash_sources(files: Sequence[InputFile]) -> list[SourceInfo]:
    """Each file's stored bytes described (what a version built from them records)."""
    out = []
    for f in files:
        try:
            with _open(f) as raw_file:
                hashing = _HashingReader(raw_file)
                hashing.drain()
        except OSError as exc:
            raise DataError(f"{f.url}: cannot read ({_reason(exc)})") from None
        out.append(SourceInfo(path=f.relative, sha256=hashing.sha.hexdigest(), size_bytes=hashing.count))
    return out


# ----------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class _Tokenizer:
    json_text: str
    file_bytes: bytes
    vocab_size: int  # one more than the largest id
    eos: str
    eos_id: int
    kind: str
    source: Literal["user", "trained"]
    reserved: frozenset[int] = frozenset()  # ids no document may contain (see reserved_ids)


def load_tokenizer(path: str, eos_token: str | None) -> _Tokenizer:
    """A user's ``tokenizer.json`` (local path or fsspec URL), its end-of-document token resolved."""
    from tokenizers import Tokenizer

    try:
        if _is_url(path):
            import fsspec

            with fsspec.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = Path(path.removeprefix("file://")).read_bytes()
    except (OSError, ValueError, ImportError) as exc:
        raise DataError(f"tokenizer {path}: cannot read ({_reason(exc)})") from None
    try:
        text = raw.decode("utf-8")
        tokenizer = Tokenizer.from_str(text)
        model_type = str(json.loads(text).get("model", {}).get("type", "unknown")).lower()
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise DataError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({exc})") from None
    return _resolve(tokenizer, text, raw, eos_token, kind=f"hf-{model_type}", source="user")


def _resolve(tokenizer: Any, text: str, raw: bytes, eos_token: str | None, *, kind: str,
             source: Literal["user", "trained"]) -> _Tokenizer:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    eos, eos_id = choose_eos(vocab, list(added.values()), eos_token)
    vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=0) + 1)
    reserved = reserved_ids(added, eos_id, _unknown_id(text, vocab))
    return _Tokenizer(text, raw, vocab_size, eos, eos_id, kind, source, reserved)


def _unknown_id(text: str, vocab: Mapping[str, int]) -> int | None:
    """The id of the model's unknown token (``unk_token`` of BPE/WordLevel/WordPiece, ``unk_id`` of Unigram)."""
    try:
        model = json.loads(text).get("model") or {}
    except ValueError:
        return None
    if isinstance(unk := model.get("unk_token"), str):
        return vocab.get(unk)
    pieces = model.get("vocab")
    if isinstance(unk := model.get("unk_id"), int) and isinstance(pieces, list) and 0 <= unk < len(pieces):
        piece = pieces[unk]
        return vocab.get(piece[0]) if isinstance(piece, list) and piece else None
    return None


# ----------------------------------------------------------------------------- the pipeline


class _ShardWriter:
    """Cuts the token stream into shards of ``shard_tokens`` tokens, written into ``directory`` (a
    local directory, or an object-store prefix: each shard uploaded and hashed as it streams)."""

    def __init__(self, directory: Location, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens <= 0:
            raise DataError("shard_tokens must be positive")
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[ShardInfo] = []
        self.num_tokens = 0

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.pending_tokens += len(ids)
        self.num_tokens += len(ids)
        while self.pending_tokens >= self.shard_tokens:
            buffer = np.concatenate(self.pending)
            self._write(buffer[: self.shard_tokens])
            rest = buffer[self.shard_tokens :]
            self.pending, self.pending_tokens = [rest], len(rest)

    def close(self) -> list[ShardInfo]:
        if self.pending_tokens or not self.shards:
            self._write(np.concatenate(self.pending) if self.pending else np.empty(0, np.uint32))
        self.pending, self.pending_tokens = [], 0
        return self.shards

    def _write(self, ids: np.ndarray) -> None:
        name = f"shard-{len(self.shards):05d}.bin"
        if isinstance(self.directory, ObjectPath):
            with upload(self.directory / name) as stream:
                stream.write(np.ascontiguousarray(ids.astype(self.dtype, copy=False)))
            self.shards.append(ShardInfo(file=name, sha256=stream.hexdigest(), size_bytes=stream.size,
                                         num_tokens=len(ids)))
            return
        data = ids.astype(self.dtype, copy=False).tobytes()
        atomic_write_bytes(self.directory / name, data)
        self.shards.append(ShardInfo(file=name, sha256=hashlib.sha256(data).hexdigest(),
                                     size_bytes=len(data), num_tokens=len(ids)))


class _Encoder:
    """Encodes tasks in task order on ``workers`` processes, a bounded window of tasks in flight.

    The workers are forked, and all of them before anything else starts a thread (the progress
    bar): a spawned worker would re-import the trainer and torch (seconds each), a fork copies
    the loaded modules. Tokenizer threads the parent may have used (training) are not touched in
    the workers, which run their tokenizer single-threaded. One worker encodes in this process.
    """

    def __init__(self, tokenizer: _Tokenizer, skip_bad: bool, workers: int) -> None:
        self.tokenizer, self.skip_bad, self.workers = tokenizer, skip_bad, workers
        self._pool: ProcessPoolExecutor | None = None
        self._saved_env: str | None = None

    def __enter__(self) -> _Encoder:
        # Set before the fork too: tokenizers warns in a forked child unless its parallelism is configured.
        self._saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if self.workers <= 1:
            _init_worker(*self._init_args())  # one core, as asked
            return self
        try:
            context = multiprocessing.get_context("fork")
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=context, initializer=_init_worker,
                initargs=self._init_args())
            self._pool.submit(os.getpid).result()  # a fork context starts every worker at the first submit
        except BaseException:
            self.__exit__()
            raise
        return self

    def _init_args(self) -> tuple[str, int, frozenset[int], bool]:
        tok = self.tokenizer
        return tok.json_text, tok.eos_id, tok.reserved, self.skip_bad

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        _WORKER.clear()
        if self._saved_env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self._saved_env

    def encode(self, tasks: Iterable[Task]) -> Iterator[Encoded]:
        if self._pool is None:
            for task in tasks:
                yield _encode(task)
            return
        window: deque[Future[Encoded]] = deque()
        try:
            for task in tasks:
                window.append(self._pool.submit(_encode, task))
                if len(window) >= 2 * self.workers:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        except BrokenProcessPool:
            raise DataError(
                f"a worker process died (out of memory?); try fewer --workers than {self.workers}") from None


class _Progress:
    """A rich progress bar over input bytes, with tokens and tokens/s; silent when disabled."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.enabled, self.total, self.tokens, self.start = enabled, total_bytes, 0, time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            console = Console(stderr=True)
            if console.is_terminal:
                self._bar = Progress(
                    TextColumn("importing"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                    TextColumn("{task.fields[tokens]} tokens"), TextColumn("{task.fields[rate]} tokens/s"),
                    TimeRemainingColumn(), console=console, transient=False,
                )
                self._bar.__enter__()
                self._task = self._bar.add_task("import", total=max(1, self.total), tokens="0", rate="-")
        return self

    def advance(self, raw_bytes: int, tokens: int) -> None:
        self.tokens += tokens
        if self._bar is not None:
            rate = self.tokens / max(1e-9, time.monotonic() - self.start)
            self._bar.update(self._task, advance=raw_bytes, tokens=_human(self.tokens), rate=_human(rate))

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def import_dataset(
    root: Path | str | ObjectPath,
    name: str,
    version: str,
    inputs: Sequence[str],
    *,
    tokenizer: str | None = None,
    options: ImportOptions = ImportOptions(),
    workers: int | None = None,
    progress: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    tenant: str | None = None,
) -> ImportResult:
    """Build dataset ``name@version`` under the artifact ``root`` (a directory, or an object-store URL)
    from ``inputs``.

    ``tokenizer``: a ``tokenizer.json`` path or URL; None trains a byte-level BPE of
    ``options.vocab_size`` on the inputs (a first pass over them). ``workers`` defaults to
    ``os.cpu_count()``; the result does not depend on it. Bad input is a :class:`DataError`
    naming the file and line, after which no trace of the version remains.
    """
    started = time.monotonic()
    workers = max(1, workers or os.cpu_count() or 1)
    final = ArtifactLayout(root).dataset_dir(name, version, tenant)  # a tenant's under its prefix
    manifest_path = final / MANIFEST_FILE

    # 1. inputs and tokenizer
    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer, options.eos_token) if tokenizer is not None else None

    # 2. an existing version: the same tokenizer and inputs, or an error
    if exists(manifest_path):
        return _existing(final, files, tok)
    if isinstance(final, ObjectPath):
        remove_tree(final)  # what an interrupted import uploaded (it never had a manifest): not a version
    elif final.exists():  # an interrupted build (never had a manifest): not a version
        shutil.rmtree(final)

    if tok is None:
        tok = _train(files, options)
    resolved = tok

    def build(target: Location) -> DatasetManifest:
        """Tokenizer and shards written into ``target``; the manifest that lists them (not written)."""
        _write_bytes(target / TOKENIZER_FILE, resolved.file_bytes)
        encoded = _encode_into(target, files, resolved, options, workers=workers, progress=progress,
                               on_progress=on_progress)
        if encoded.documents == 0:
            raise DataError(f"no documents in {', '.join(inputs)}"
                            + (f" ({encoded.skipped} bad records skipped)" if encoded.skipped else ""))
        return _manifest_of(name, version, resolved, options, encoded)

    # 3. encode, then 4. the manifest, last: the version appears at once
    committed = _write_objects(final, build) if isinstance(final, ObjectPath) else _write_directory(final, build)
    if committed is None:  # another import committed this version first: theirs stands if it is the same
        return _existing(final, files, tok)
    manifest, sha256 = committed
    seconds = time.monotonic() - started
    info: Any = manifest.import_info  # an import's manifest always has one (the build wrote it)
    log.info("dataset %s@%s: %d documents, %d tokens (%s) in %d shards, %d bad records skipped, "
             "%.0f tokens/s with %d workers", name, version, info.documents, manifest.num_tokens,
             manifest.dtype, len(manifest.shards), info.skipped_records,
             manifest.num_tokens / max(seconds, 1e-9), workers)
    return ImportResult(manifest_path, sha256, manifest, created=True, seconds=seconds)


@dataclass(frozen=True)
class _Version:
    """What encoding the inputs into a version's directory produced."""

    dtype: Literal["uint16", "uint32"]
    shards: list[ShardInfo]
    num_tokens: int
    sources: list[SourceInfo]
    documents: int
    skipped: int


def _encode_into(target: Location, files: Sequence[InputFile], tok: _Tokenizer, options: ImportOptions, *,
                 workers: int, progress: bool, on_progress: Callable[[int, int], None] | None) -> _Version:
    """Encode every input in order and write the shards into ``target``."""
    dtype_name = token_dtype_for(tok.vocab_size)
    total_bytes = sum(_size(f) for f in files)
    writer = _ShardWriter(target, TOKEN_DTYPES[dtype_name], options.shard_tokens)
    sources: list[SourceInfo] = []
    tasks = (task for f in files for task in _tasks(f, options, sources))
    documents = skipped = 0
    with _Encoder(tok, options.skip_bad, workers) as encoder, _Progress(total_bytes, progress) as bar:
        for encoded in encoder.encode(tasks):
            if encoded.error is not None:
                raise DataError(encoded.error + ("" if options.skip_bad else "; --skip-bad skips bad records"))
            writer.add(encoded.ids)
            documents += encoded.documents
            skipped += encoded.skipped
            bar.advance(encoded.raw_bytes, len(encoded.ids))
            if on_progress is not None:
                on_progress(encoded.raw_bytes, len(encoded.ids))
    if documents == 0:
        return _Version(dtype_name, [], 0, sources, 0, skipped)
    return _Version(dtype_name, writer.close(), writer.num_tokens, sources, documents, skipped)


def _manifest_of(name: str, version: str, tok: _Tokenizer, options: ImportOptions, v: _Version) -> DatasetManifest:
    tok_sha = hashlib.sha256(tok.file_bytes).hexdigest()
    return DatasetManifest(
        name=name, version=version, dtype=v.dtype, separator=tok.eos,
        tokenizer=TokenizerInfo(file=TOKENIZER_FILE, sha256=tok_sha, vocab_size=tok.vocab_size,
                                version=tokenizer_version(tok.vocab_size, tok_sha), kind=tok.kind),
        shards=v.shards, num_tokens=v.num_tokens, sources=v.sources, source_kind="import",
        source_python=None, created_at=None,
        import_info=ImportInfo(documents=v.documents, skipped_records=v.skipped, skip_bad=options.skip_bad,
                               text_field=options.text_field, column=options.column,
                               eos_token_id=tok.eos_id, tokenizer_source=tok.source),
    )


def _write_bytes(location: Location, data: bytes) -> None:
    if isinstance(location, ObjectPath):
        with upload(location) as stream:
            stream.write(data)
    else:
        atomic_write_bytes(location, data)


Build = Callable[[Location], DatasetManifest]


def _write_directory(final: Path, build: Build) -> tuple[DatasetManifest, str] | None:
    """Build into a hidden staging directory, write its manifest, rename it into place; None when
    another import renamed this version into place first."""
    staging = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    created = _missing_directories(final.parent)
    staging.mkdir(parents=True)
    try:
        manifest = build(staging)
        atomic_write_bytes(staging / MANIFEST_FILE, manifest.to_bytes())
        try:
            os.rename(staging, final)
        except OSError:  # another importer won the race
            if (final / MANIFEST_FILE).exists():
                return None
            raise
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for directory in reversed(created):  # the dataset's <name>/ (and its tenant's prefix) made for this one
            with contextlib.suppress(OSError):  # not empty: another import of the name is in it
                directory.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest, sha256_file(final / MANIFEST_FILE)


def _missing_directories(directory: Path) -> list[Path]:
    """``directory`` and those of its ancestors that do not exist yet, outermost first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing[::-1]


def _write_objects(final: ObjectPath, build: Build) -> tuple[DatasetManifest, str] | None:
    """Upload tokenizer and shards under the version's prefix, then its manifest, last, create-only (the
    commit point: its sha256 is that of the bytes sent); None when another import committed first. On
    an error the objects go again (unless a manifest stands)."""
    manifest_path = final / MANIFEST_FILE
    try:
        manifest = build(final)
        try:
            with upload(manifest_path, exclusive=True) as stream:
                stream.write(manifest.to_bytes())
        except FileExistsError:
            return None
    except BaseException:
        with contextlib.suppress(Exception):
            if not exists(manifest_path):
                remove_tree(final)
        raise
    return manifest, stream.hexdigest()


def _train(files: Sequence[InputFile], options: ImportOptions) -> _Tokenizer:
    """A byte-level BPE trained on the inputs' documents (a first pass; bad records as in the second)."""
    from tokenizers import Tokenizer

    def texts() -> Iterator[str]:
        for f in files:
            for task in _tasks(f, options, []):
                parsed = parse_records(task, options.skip_bad)
                if parsed.error is not None:
                    raise DataError(parsed.error + ("" if options.skip_bad else "; --skip-bad skips bad records"))
                yield from parsed.texts

    text = train_tokenizer(texts(), options.vocab_size)
    eos = options.eos_token or END_OF_TEXT
    return _resolve(Tokenizer.from_str(text), text, text.encode(), eos, kind="byte-level-bpe", source="trained")


def _existing(directory: Location, files: Sequence[InputFile], tok: _Tokenizer | None) -> ImportResult:
    manifest_path = directory / MANIFEST_FILE
    manifest = load_dataset_manifest(manifest_path)
    label = f"dataset {manifest.name}@{manifest.version}"
    if problems := verify_dataset(directory, manifest):
        raise DataError(f"{label} at {directory} exists but does not verify: " + "; ".join(problems))
    differences = []
    if tok is not None and hashlib.sha256(tok.file_bytes).hexdigest() != manifest.tokenizer.sha256:
        differences.append("another tokenizer")
    if hash_sources(files) != manifest.sources:
        differences.append("other inputs")
    if differences:
        raise DataError(f"{label} already exists, built from {' and '.join(differences)}; "
                        "a published version is immutable: import under a new --version")
    return ImportResult(manifest_path, sha256_of(manifest_path), manifest, created=False)
