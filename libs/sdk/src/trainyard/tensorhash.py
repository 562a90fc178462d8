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
(:func:`trainyard_common.manifest.tensors_hash`). What it depends on:

* equal for two saves of the same values, whichever files or DCP metadata they were written with,
  and whichever rank wrote a replicated entry (DCP picks one);
* different when one element of one tensor differs (or its dtype, shape or key);
* **not** independent of the number of ranks: every rank saves its own RNG state
  (``rng.rank_<r>``), and FSDP/TP shards are hashed per chunk, whose offsets change with the layout.
  Under pure data parallelism the ``model.*`` and ``optimizer.*`` entries of the manifest's
  ``tensors`` list do not depend on the number of ranks; compare those to compare across world sizes.

Cost: one more pass over the saved bytes (sha256, ~1–2 GB/s per core, in the save's background
thread for an asynchronous save); a tensor still on a GPU (a synchronous save) is copied to the host
for it. Hashing while DCP serializes would avoid the second pass but needs DCP's private
``_write_item``; this uses the public ``StorageWriter.write_data`` and ``SavePlanner.resolve_data``.
"""

from __future__ import annotations

import hashlib
import io
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from trainyard_common.events import TensorDigest
from trainyard_common.spec import canonical_json

__all__ = ["DigestingWriter", "entry_digest", "tensor_header", "plan_digests"]


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


def plan_digests(items: Sequence[WriteItem], resolve: Callable[[WriteItem], Any]) -> list[TensorDigest]:
    """The digest of every item of a rank's final save plan, in the plan's order."""
    return [entry_digest(item, resolve(item)) for item in items]


class DigestingWriter:
    """Mixin for a DCP ``StorageWriter``: before writing, it digests every item of this rank's plan
    (``tensor_digests``, None until a save wrote)."""

    tensor_digests: list[TensorDigest] | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        self.tensor_digests = plan_digests(plan.items, planner.resolve_data)
        return super().write_data(plan, planner)  # type: ignore[misc]
