"""Exports under an ``s3://`` artifact root (moto's S3 server), the real Redis and the real conversion command:
the export worker downloads a READY checkpoint (a real one-rank DCP save of gpt-tiny, uploaded as the
trainer would) verifying each object as it streams, converts it, and uploads the Hugging Face directory
object by object with the safetensors index after its shards and ``trainyard-export.json`` last: the
commit point, whose sha256 is the export's hash. The API lists and streams the files from the store. A
corrupted checkpoint object is refused before anything is converted or uploaded."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.distributed as dist

from tests.integration.test_coordinator import SPEC
from tests.objectstore import moto_s3
from tests.support.api import TOKEN_A, client_for, seed
from trainyard.checkpoint import save_checkpoint
from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_contract import events as ev
from trainyard_contract.catalog import resolve_model
from trainyard_contract.manifest import CheckpointManifest, ShardEntry, content_hash
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import ArtifactRecord, DatasetRecord, JobRecord, Lineage
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import (
    EXPORT_LISTING,
    ArtifactLayout,
    ObjectPath,
    commit_bytes,
    export_listing,
    list_children,
    read_bytes,
    sha256_of,
)
from trainyard_runtime.store import StateStore
from trainyard_registry import transfer
from trainyard_registry.exporter import Exporter
from trainyard_registry.settings import RegistrySettings
from trainyard.data import train_tokenizer
from trainyard_trainer.data_import import ImportOptions, import_dataset
from trainyard_trainer.model import build_model

pytestmark = pytest.mark.integration

TENANT = "tenant-a"  # TOKEN_A's
NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)
DOCS = [f"doc {i}: " + " ".join(f"w{(i * 3 + j) % 30}" for j in range(i % 9 + 1)) for i in range(30)]


@pytest.fixture(scope="module")
def s3_root() -> Iterator[str]:
    with moto_s3() as root:
        yield root


@pytest.fixture
async def world(env: dict[str, Any], redis: Any, s3_root: str, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """The dataset (imported to the store), the job and the export worker over the real Redis."""
    store = StateStore(redis)
    await seed(store)
    corpus, tokenizer = tmp_path / "corpus.jsonl", tmp_path / "tokenizer.json"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    tokenizer.write_text(train_tokenizer(DOCS, 260))
    dataset = import_dataset(s3_root, "tinycorpus", "v1", [str(corpus)], tokenizer=str(tokenizer),
                             options=ImportOptions(shard_tokens=500), workers=1)
    await store.put_dataset(DatasetRecord(name="tinycorpus", version="v1", manifest_uri=str(dataset.manifest_path),
                                          sha256=dataset.sha256, tokenizer=dataset.manifest.tokenizer.version))
    settings = RegistrySettings(**(env | {"artifact_root": s3_root}), export_timeout_s=180,
                                export_command=[sys.executable, "-m", "trainyard_trainer.export_cli",
                                                "--max-shard-size", "256KiB"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield {"store": store, "redis": redis, "env": env, "layout": ArtifactLayout(s3_root),
               "exporter": Exporter(redis, Outbox(redis, "registry"), settings, clock=lambda: NOW)}
    finally:
        dist.destroy_process_group()


async def ready_checkpoint(world: dict[str, Any], job_id: str) -> ArtifactRecord:
    """A READY checkpoint of gpt-tiny in the store (DCP's fsspec save, then its manifest last) and its job's
    records."""
    spec = TrainingSpec.model_validate(SPEC)
    store: StateStore = world["store"]
    assert await store.create_job(JobRecord(job_id=job_id, tenant=TENANT, spec=spec, spec_hash=spec.spec_hash(),
                                            state="succeeded"))
    model = build_model(resolve_model("gpt-tiny@v1"), seed=7, device="cpu")
    directory = world["layout"].checkpoint_dir(TENANT, job_id, 1, 40)
    saved = save_checkpoint({"model": model.state_dict()}, directory, rank=0, barrier=dist.barrier)
    shards = [ShardEntry(rank=0, uri=saved.shard.uri, size_bytes=saved.shard.size_bytes, sha256=saved.shard.sha256)]
    manifest = CheckpointManifest(job_id=job_id, tenant=TENANT, attempt=1, epoch=1, global_step=40, world_size=1,
                                  shards=shards, extra_files=saved.extra_files,
                                  content_hash=content_hash(shards, saved.extra_files))
    commit_bytes(directory / "manifest.json", manifest.to_bytes())
    artifact = ArtifactRecord(
        artifact_id=f"{job_id}/checkpoint/step-000000040-a1", job_id=job_id, tenant=TENANT, type="checkpoint",
        uri=str(directory / "manifest.json"), hash=f"sha256:{manifest.content_hash}", producer_attempt=1,
        global_step=40, lineage=Lineage(spec_hash=spec.spec_hash(), dataset="tinycorpus@v1",
                                        code_revision="rev-42", model_config_ref="gpt-tiny@v1"), created_at=NOW)
    assert await store.put_artifact(artifact)
    return artifact


def request(artifact: ArtifactRecord) -> ev.ExportRequested:
    return ev.ExportRequested(export_id=ev.export_id(artifact.artifact_id, "hf"),
                              checkpoint_artifact_id=artifact.artifact_id, job_id=artifact.job_id, tenant=TENANT,
                              format="hf", requested_by="tok_test")


async def test_a_checkpoint_in_the_store_is_exported_object_by_object_with_its_listing_last(
    world: dict[str, Any], s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    artifact = await ready_checkpoint(world, "job-s3-export")
    uploaded: list[str] = []
    real_upload = transfer.upload_file

    def recording(source: Path, dest: ObjectPath, **kw: Any) -> tuple[int, str]:
        uploaded.append(dest.name)
        return real_upload(source, dest, **kw)

    monkeypatch.setattr(transfer, "upload_file", recording)
    asked = request(artifact)
    await world["exporter"].on_export_requested(asked)

    record = await world["store"].get_export(asked.export_id)
    assert record is not None and record.state == "ready", record
    out = world["layout"].export_dir(TENANT, artifact.job_id, "step-000000040-a1", "hf")
    assert record.uri == str(out) and record.uri.startswith(s3_root)
    listing = read_bytes(out / EXPORT_LISTING)
    assert record.hash == f"sha256:{sha256_of(out / EXPORT_LISTING)}"
    listed = export_listing(listing)
    weights = sorted(f.name for f in listed if f.name.startswith("model-"))
    assert len(weights) > 1 and "tokenizer.json" in {f.name for f in listed}  # sharded, with the dataset's tokenizer
    # every file up before the listing, the index after the shards it names; nothing renamed, nothing else
    assert uploaded[-1] == EXPORT_LISTING and sorted(uploaded[:-1]) == sorted(f.name for f in listed)
    assert uploaded.index("model.safetensors.index.json") > max(uploaded.index(w) for w in weights)
    assert sorted(c.name for c in list_children(out)) == sorted(uploaded)
    for f in listed:
        assert sha256_of(out / f.name) == f.sha256, f.name

    # the API lists the export's files from the listing object and streams one from the store
    settings = ApiSettings(**(world["env"] | {"artifact_root": s3_root}))
    app = create_app(ApiContext(settings, world["store"], Outbox(world["redis"], "api")))
    async with client_for("http://api", TOKEN_A, transport=httpx.ASGITransport(app=app)) as api:
        view = await api.get(f"/v1/registry/artifacts/{asked.export_id}")
        assert view.status_code == 200, view.text
        assert [f["name"] for f in view.json()["files"]] == [EXPORT_LISTING, *(f.name for f in listed)]
        got = await api.get(f"/v1/registry/artifacts/{asked.export_id}/files/{weights[0]}")
        assert got.status_code == 200 and got.content == read_bytes(out / weights[0])
        assert got.headers["content-disposition"] == f'attachment; filename="{weights[0]}"'


async def test_a_corrupted_checkpoint_object_is_refused_before_anything_is_converted(
    world: dict[str, Any],
) -> None:
    artifact = await ready_checkpoint(world, "job-s3-corrupt")
    manifest = CheckpointManifest.model_validate_json(read_bytes(ObjectPath.parse(artifact.uri)))
    shard = ObjectPath.parse(manifest.shards[0].uri)
    data = bytearray(read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    commit_bytes(shard, bytes(data))
    asked = request(artifact)
    await world["exporter"].on_export_requested(asked)
    record = await world["store"].get_export(asked.export_id)
    assert record is not None and record.state == "failed"
    assert "failed verification: __0_0.distcp" in record.reason and record.problems == [record.reason]
    assert list_children(world["layout"].exports_dir(TENANT, artifact.job_id)) == []
