"""Small, well-formed dataset versions on disk (manifest, tokenizer, shards), for tests of what the
registry verifies and who may train on what."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from trainyard_contract import events as ev
from trainyard_contract.records import DatasetRecord
from trainyard_contract.spec import DatasetRef
from trainyard_contract.storage import ArtifactLayout, path_to_uri, sha256_file
from trainyard_runtime.store import StateStore


def write_dataset(layout: ArtifactLayout, name: str, version: str, tenant: str | None = None,
                  *, shards: int = 2) -> Path:
    """A version under its owner's prefix (manifest last); returns the manifest's path."""
    directory = layout.dataset_dir(name, version, tenant)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = json.dumps({"model": {"type": "BPE"}, "name": name}).encode()
    (directory / "tokenizer.json").write_bytes(tokenizer)
    infos = []
    for i in range(shards):
        data = bytes(range(i, i + 64)) * 4
        (directory / f"shard-{i:05d}.bin").write_bytes(data)
        infos.append({"file": f"shard-{i:05d}.bin", "sha256": hashlib.sha256(data).hexdigest(),
                      "sizeBytes": len(data), "numTokens": len(data) // 2})
    manifest = {
        "formatVersion": 1, "name": name, "version": version, "dtype": "uint16", "byteOrder": "little",
        "tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(tokenizer).hexdigest(), "vocabSize": 512,
                      "version": "bpe512-test"},
        "shards": infos, "numTokens": sum(s["numTokens"] for s in infos), "sources": [],
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return directory / "manifest.json"


def copy_dataset(layout: ArtifactLayout, name: str, version: str, tenant: str) -> Path:
    """The platform's ``name@version`` copied byte for byte under ``tenant``'s prefix (a real, trainable
    version that tenant owns); returns the copy's manifest."""
    target = layout.dataset_dir(name, version, tenant)
    shutil.copytree(layout.dataset_dir(name, version), target, dirs_exist_ok=True)
    return target / "manifest.json"


def published(manifest: Path, tenant: str | None = None, **fields: object) -> ev.DatasetVersionPublished:
    """The DatasetVersionPublished that announces the version at ``manifest`` (its name and version from it)."""
    doc = json.loads(manifest.read_text())
    values: dict[str, object] = {"name": doc["name"], "version": doc["version"], "tenant": tenant,
                                 "manifest_uri": path_to_uri(manifest), "sha256": sha256_file(manifest),
                                 "tokenizer": "bpe512-test", "num_tokens": doc["numTokens"]}
    return ev.DatasetVersionPublished(**(values | fields))


async def verified(store: StateStore, ref: str = "tinycorpus@v1") -> DatasetRecord:
    """The registry's record of a verified version ``ref`` (as it writes it after checking the files), for
    tests that publish JobSubmitted straight on the bus: the scheduler places only jobs whose dataset is a
    verified version their tenant may read."""
    tenant, name, version = DatasetRef.parse(ref)
    record = DatasetRecord(name=name, version=version, tenant=tenant, sha256="0" * 64,
                           manifest_uri=f"file:///datasets/{name}/{version}/manifest.json")
    await store.put_dataset(record)
    return record
