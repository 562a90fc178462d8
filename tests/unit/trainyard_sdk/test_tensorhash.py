"""Each rank's digest of what it saves: real ``dcp.save`` runs in this process (no process group)."""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import TypeAdapter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from trainyard.checkpoint import SavedShard, save_checkpoint
from trainyard.tensorhash import (
    MAX_REPORTED_BYTES,
    entry_digest,
    little_endian_bytes,
    read_tensor_digests,
    reportable,
    tensor_header,
)
from trainyard_contract.events import ShardWritten, TensorDigest
from trainyard_contract.manifest import tensors_hash
from trainyard_contract.spool import MAX_LINE_BYTES
from trainyard_contract.storage import sha256_file, uri_to_path

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Piece:
    """A Stateful holding a plain dict (what the SDK's ModelState, RngState, … hand DCP)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def training_state(seed: int = 0) -> dict[str, Piece]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": Piece({"w": torch.randn(8, 4, generator=generator), "b": torch.zeros(4, dtype=torch.bfloat16),
                        "scale": torch.tensor(0.5)}),
        "progress": Piece({"global_step": 6, "consumed_tokens": 3072}),
        "rng": Piece({"rank_0": {"python": random.Random(seed).getstate(), "torch": generator.get_state()}}),
    }


def save(state: dict[str, Piece], tmp_path: Path, name: str) -> SavedShard:
    return save_checkpoint(state, tmp_path / name / "step-000000006-a1", rank=0, barrier=lambda: None)


def test_two_saves_of_the_same_values_have_the_same_digests_and_different_metadata(tmp_path: Path) -> None:
    first, second = save(training_state(), tmp_path, "a"), save(training_state(), tmp_path, "b")
    assert first.tensors is not None and second.tensors is not None
    keys = {d.key for d in first.tensors}
    assert keys == {"model.w", "model.b", "model.scale", "progress.global_step", "progress.consumed_tokens",
                    "rng.rank_0.python", "rng.rank_0.torch"}
    assert first.tensors == second.tensors
    assert tensors_hash(first.tensors) == tensors_hash(second.tensors)
    # what made contentHash useless for comparing runs: DCP's .metadata differs between the two saves
    (meta_a,), (meta_b,) = first.extra_files, second.extra_files
    assert sha256_file(uri_to_path(meta_a.uri)) == meta_a.sha256 and meta_a.sha256 != meta_b.sha256


def test_one_changed_element_changes_its_entry_and_the_hash(tmp_path: Path) -> None:
    before = save(training_state(), tmp_path, "a")
    changed = training_state()
    raw = changed["model"].state["b"].view(torch.int16)
    raw[2] ^= 1  # the last mantissa bit of one bfloat16 element
    after = save(changed, tmp_path, "b")
    assert before.tensors is not None and after.tensors is not None
    assert {d.key for d in before.tensors if d not in after.tensors} == {"model.b"}
    assert tensors_hash(before.tensors) != tensors_hash(after.tensors)


def test_the_digest_covers_the_values_in_a_fixed_encoding(tmp_path: Path) -> None:
    saved = save(training_state(), tmp_path, "a")
    assert saved.tensors is not None
    w = training_state()["model"].state["w"]
    (entry,) = [d for d in saved.tensors if d.key == "model.w"]
    header = b'{"dtype":"torch.float32","key":"model.w","kind":"tensor","offset":[0,0],"shape":[8,4],"size":[8,4]}\n'
    assert entry.offset == [0, 0]
    assert entry.sha256 == hashlib.sha256(header + w.numpy().astype("<f4").tobytes()).hexdigest()


def item(key: str, tensor: torch.Tensor, offset: tuple[int, ...] | None = None,
         size: tuple[int, ...] | None = None) -> WriteItem:
    offset = offset or (0,) * tensor.dim()
    return WriteItem(index=MetadataIndex(key, torch.Size(offset)), type=WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offset), tensor.shape),
                                                 properties=TensorProperties(dtype=tensor.dtype),
                                                 size=torch.Size(size or tensor.shape)))


BASE = torch.arange(6, dtype=torch.int32).reshape(2, 3)
ONE_MORE = BASE + torch.tensor([[0, 0, 0], [0, 0, 1]], dtype=torch.int32)


@pytest.mark.parametrize(
    ("case", "key", "data", "offset", "size", "equal"),
    [
        ("the same values", "m.w", BASE.clone(), None, None, True),
        ("the same values, not contiguous in memory", "m.w", BASE.t().contiguous().t(), None, None, True),
        ("the same bytes as another dtype", "m.w", BASE.view(torch.float32), None, None, False),
        ("the same values in another shape", "m.w", BASE.reshape(3, 2), None, None, False),
        ("under another key", "m.v", BASE, None, None, False),
        ("one element differs", "m.w", ONE_MORE, None, None, False),
        ("the chunk of a bigger tensor", "m.w", BASE, None, (4, 3), False),
        ("at another offset", "m.w", BASE, (2, 0), (4, 3), False),
    ],
)
def test_entry_digest(case: str, key: str, data: torch.Tensor, offset: tuple[int, ...] | None,
                      size: tuple[int, ...] | None, equal: bool) -> None:
    base = entry_digest(item("m.w", BASE), BASE)
    assert (entry_digest(item(key, data, offset, size), data) == base) is equal, case


def test_an_object_entry_hashes_what_dcp_writes() -> None:
    obj = WriteItem(index=MetadataIndex("progress.global_step"), type=WriteItemType.BYTE_IO)
    one, again, other = io.BytesIO(), io.BytesIO(), io.BytesIO()
    torch.save(6, one), torch.save(6, again), torch.save(7, other)
    assert entry_digest(obj, one) == entry_digest(obj, again)
    assert entry_digest(obj, one).offset == [] and entry_digest(obj, one) != entry_digest(obj, other)


def test_bytes_are_little_endian_row_major() -> None:
    t = torch.tensor([[1, 256]], dtype=torch.int32).t()  # a transposed (non-contiguous) view
    assert bytes(little_endian_bytes(t).numpy()) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert tensor_header("k", [0], torch.int32, [2], [2]).endswith(b"\n")


def test_the_reported_digests_are_what_the_files_hold(tmp_path: Path) -> None:
    saved = save(training_state(), tmp_path, "a")
    assert saved.tensors is not None
    recomputed = read_tensor_digests(saved.directory)
    assert recomputed == sorted(saved.tensors, key=lambda d: (d.key, d.offset))
    assert tensors_hash(recomputed) == tensors_hash(saved.tensors)


def digests(n: int,
            key: str = "optimizer.state.model.layers.{i}.self_attn.q_proj.weight.exp_avg") -> list[TensorDigest]:
    return [TensorDigest(key=key.format(i=i), offset=[1 << 33, 4096], sha256="ab" * 32) for i in range(n)]


@pytest.mark.parametrize(
    ("case", "entries", "reported"),
    [
        ("none reported (a rank that does not digest)", None, False),
        ("nothing saved", [], True),
        ("a small model", digests(200), True),
        ("a 70B dense model with Adam under FSDP, per rank", digests(2_900), True),
        ("a mixture of experts: more than one shard report holds", digests(20_000), False),
    ],
)
def test_reportable(case: str, entries: list[TensorDigest] | None, reported: bool) -> None:
    assert (reportable(entries) is not None) is reported, case
    if entries is not None and reported:
        assert reportable(entries) == entries


def test_what_is_reportable_fits_in_one_spool_line_and_kafka_record() -> None:
    entries = digests(6_000)
    size = len(TypeAdapter(list[TensorDigest]).dump_json(entries, by_alias=True)) / len(entries)
    fits = entries[: int(MAX_REPORTED_BYTES / size)]  # as many as the limit admits
    assert reportable(fits) == fits and reportable(entries[: len(fits) + 2]) is None
    event = ShardWritten(job_id="j" * 40, tenant="t" * 40, attempt=1, epoch=1, global_step=1, rank=0, world_size=1,
                         uri="file:///" + "d" * 200 + "/__0_0.distcp", size_bytes=1, sha256="0" * 64,
                         tensor_digests=fits)
    assert len(event.model_dump_json(by_alias=True)) + 64 * 1024 < MAX_LINE_BYTES  # room for the envelope
