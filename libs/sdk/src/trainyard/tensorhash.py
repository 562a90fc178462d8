"""A digest of every entry a rank saves into its checkpoint shard, independent of DCP's metadata.

The files of two bitwise-identical checkpoints differ (DCP's ``.metadata`` holds a fresh save id), so
the manifest's ``contentHash`` names files, not values. Each rank therefore hashes, for every entry
it writes (``WriteItem`` of its final save plan, after DCP's de-duplication), a canonical encoding::

    canonical JSON header  {"key", "offset", "kind": "tensor", "dtype", "shape", "size"}   (sorted keys)
    b"\\n"
    the chunk's values: contiguous, row-major, little-endian bytes

or, for an entry that is not a tensor (a counter, Python's RNG state), the header
``{"key", "kind": "object", "serialization": "torch.save"}`` and the bytes DCP writes for it.
``key`` is the entry's fully qualified key (``model.wte.weight``, ``rng.rank_1.torch``); ``offset``
and ``shape`` are the saved chunk's offset and shape within the whole tensor of shape ``size`` (an
unsharded tensor: offset zeros, shape = size). The dtype, the shape and the key are part of the
hash: the same bytes as another dtype or shape are another entry.

The coordinator sorts the ranks' digests by key and offset and hashes them into ``tensorsHash``
(:func:`trainyard_contract.manifest.tensors_hash`). What it depends on:

* equal for two saves of the same values, whichever files or DCP metadata they were written with,
  and whichever rank wrote a replicated entry (DCP picks one);
* different when one element of one tensor differs (or its dtype, shape or key);
* absent (``tensorsHash`` null) when a rank's digests would not fit in its ShardWritten
  (:data:`MAX_REPORTED_BYTES`), or when a rank did not report them (an older SDK);
* **not** independent of the number of ranks: every rank saves its own RNG state
  (``rng.rank_<r>``), and FSDP/TP shards are hashed per chunk, whose offsets change with the layout.
  Under pure data parallelism the ``model.*`` and ``optimizer.*`` entries of the manifest's
  ``tensors`` list do not depend on the number of ranks; compare those to compare across world sizes.

Recomputing it: :func:`read_tensor_digests` reads a local checkpoint's entries back from its files
and digests them the same way, so a reader can check that ``tensors`` (and so ``tensorsHash``) names
what the files hold. The platform does not run it: it unpickles DCP's ``.metadata``, a file a rank
wrote, which only a reader who trusts that rank's code may do (as any load does).

Cost: one more pass over the saved bytes (sha256, ~1–2 GB/s per core, in the save's background
thread for an asynchronous save); a tensor still on a GPU (a synchronous save) is copied to the host
for it. Hashing while DCP serializes would avoid the second pass but needs DCP's private
``_write_item``; this uses the public ``StorageWriter.write_data`` and ``SavePlanner.resolve_data``.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import TypeAdapter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from trainyard_contract.events import TensorDigest
from trainyard_contract.spec import canonical_json

__all__ = ["MAX_REPORTED_BYTES", "DigestingWriter", "entry_digest", "plan_digests", "read_tensor_digests",
           "reportable", "tensor_header"]


def tensor_header(key: str, offset: Sequence[int], dtype: torch.dtype, shape: Sequence[int],
                  size: Sequence[int]) -> bytes:
    """The canonical header of a tensor chunk (see the module docstring)."""
    return canonical_json({"key": key, "offset": list(offset), "kind": "tensor", "dtype": str(dtype),
                           "shape": list(shape), "size": list(size)}) + b"\n"


def object_header(key: str) -> bytes:
    return canonical_json({"key": key, "kind": "object", "serialization": "torch.save"}) + b"\n"


def little_endian_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a flat uint8 tensor: on the host, contiguous, row-major, little-endian."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    width = tensor.element_size()
    if sys.byteorder == "big" and width > 1:
        flat = flat.reshape(-1, width).flip(1).reshape(-1)
    return flat


def entry_digest(item: WriteItem, data: torch.Tensor | io.BytesIO) -> TensorDigest:
    """The digest of one entry this rank writes: ``data`` is what the planner resolved for ``item``."""
    key = item.index.fqn
    digest = hashlib.sha256()
    if item.type == WriteItemType.BYTE_IO:
        assert isinstance(data, io.BytesIO)
        digest.update(object_header(key))
        digest.update(data.getbuffer())
        return TensorDigest(key=key, offset=[], sha256=digest.hexdigest())
    assert isinstance(data, torch.Tensor) and item.tensor_data is not None
    chunk = item.tensor_data.chunk
    digest.update(tensor_header(key, chunk.offsets, data.dtype, data.shape, item.tensor_data.size))
    if data.numel():
        digest.update(little_endian_bytes(data).numpy().data)
    return TensorDigest(key=key, offset=list(chunk.offsets), sha256=digest.hexdigest())


MAX_REPORTED_BYTES = 768 * 1024
"""The most JSON the entry digests may add to one ShardWritten: the event travels as one spool line
(at most 1 MiB, ``trainyard_contract.spool.MAX_LINE_BYTES``) and one Kafka record (1 MiB by default).
About 5,000 entries of ~150 bytes: a 70B dense model with Adam under FSDP has ~2,900 per rank."""

_DIGESTS = TypeAdapter(list[TensorDigest])


def reportable(digests: Sequence[TensorDigest] | None, *,
               limit: int = MAX_REPORTED_BYTES) -> list[TensorDigest] | None:
    """``digests`` when they fit in a ShardWritten (``limit`` bytes of JSON), else None: the
    checkpoint then has no tensorsHash, but its shard report still goes out. Pure."""
    if digests is None:
        return None
    listed = list(digests)
    return listed if len(_DIGESTS.dump_json(listed, by_alias=True)) <= limit else None


def plan_digests(items: Sequence[WriteItem], resolve: Callable[[WriteItem], Any]) -> list[TensorDigest]:
    """The digest of every item of a rank's final save plan, in the plan's order."""
    return [entry_digest(item, resolve(item)) for item in items]


class DigestingWriter:
    """Mixin for a DCP ``StorageWriter``: before writing, it digests every item of this rank's plan
    (``tensor_digests``, None until a save wrote)."""

    tensor_digests: list[TensorDigest] | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        self.tensor_digests = plan_digests(plan.items, planner.resolve_data)
        return super().write_data(plan, planner)  # type: ignore[misc]  # torch's untyped base method


def read_tensor_digests(directory: str | os.PathLike[str]) -> list[TensorDigest]:
    """Every entry's digest recomputed from a local DCP checkpoint's files, sorted by key and offset.

    Each stored chunk is read where ``.metadata`` says it lies: an object's bytes are hashed as they
    are, a tensor's are loaded with ``weights_only=True``. ``.metadata`` itself is unpickled: call
    this only on a checkpoint whose writer you trust (the platform never does)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(os.fspath(directory)).read_metadata()
    digests = []
    for index, where in metadata.storage_data.items():
        if getattr(where, "transform_descriptors", None):
            raise ValueError(f"{index.fqn} is stored transformed ({where.transform_descriptors}): not supported")
        with open(os.path.join(os.fspath(directory), where.relative_path), "rb") as fh:
            fh.seek(where.offset)
            raw = fh.read(where.length)
        stored = metadata.state_dict_metadata[index.fqn]
        if not isinstance(stored, TensorStorageMetadata):
            digest = hashlib.sha256(object_header(index.fqn))
            digest.update(raw)
            digests.append(TensorDigest(key=index.fqn, offset=[], sha256=digest.hexdigest()))
            continue
        chunk = torch.load(io.BytesIO(raw), weights_only=True)
        digest = hashlib.sha256(tensor_header(index.fqn, index.offset, chunk.dtype, chunk.shape, stored.size))
        if chunk.numel():
            digest.update(little_endian_bytes(chunk).numpy().data)
        digests.append(TensorDigest(key=index.fqn, offset=list(index.offset), sha256=digest.hexdigest()))
    return sorted(digests, key=lambda d: (d.key, d.offset))
