"""A tenant's dataset version under an ``s3://`` artifact root, against a real S3 HTTP endpoint (moto's
server): imported with trainyard-data's pipeline, announced by the API with the manifest object's URL,
and verified by the registry's shell from the objects (the manifest's sha256, every object's size and
streamed sha256); a corrupted or missing shard, or a manifest outside the owner's prefix, is refused.
Unit-level: the shell's reads without Redis or a broker (tests/integration/test_registry_datasets.py runs
the whole path on a filesystem root)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.objectstore import moto_s3
from trainyard_api.bodies import DatasetPublishBody
from trainyard_api.datasets import DatasetService
from trainyard_contract.events import DatasetVersionPublished
from trainyard_contract.records import TenantToken
from trainyard_contract.storage import ArtifactLayout, commit_bytes, read_bytes, remove_file
from trainyard_registry.registry import Registry
from trainyard_registry.settings import RegistrySettings
from trainyard.data import train_tokenizer
from trainyard_trainer.data_import import ImportOptions, ImportResult, import_dataset

TENANT = "acme"
DOCS = [f"doc {i}: " + " ".join(f"w{(i * 5 + j) % 40}" for j in range(i % 11 + 1)) for i in range(40)]


class Announced:
    """The API's outbox, keeping what it was given."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def put(self, event: Any) -> None:
        self.events.append(event)


@pytest.fixture(scope="module")
def s3_root() -> Iterator[str]:
    with moto_s3() as root:
        yield root


@pytest.fixture
def registry(s3_root: str) -> Registry:
    return Registry(None, None, RegistrySettings(artifact_root=s3_root))  # type: ignore[arg-type]  # no Redis used


def imported(root: str, tmp_path: Path, version: str) -> ImportResult:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(train_tokenizer(DOCS, 280))
    return import_dataset(root, "wiki", version, [str(corpus)], tokenizer=str(tokenizer),
                          options=ImportOptions(shard_tokens=101), workers=1, tenant=TENANT)


class NothingVerified:
    """The state store as the API's publish reads it: no version of the ref is verified yet."""

    async def get_dataset(self, ref: str) -> None:
        return None


async def announce(root: str, version: str, sha256: str) -> DatasetVersionPublished:
    outbox = Announced()
    service = DatasetService(NothingVerified(), outbox, ArtifactLayout(root))  # type: ignore[arg-type]  # a test double
    token = TenantToken(token_id="tok_a", tenant=TENANT, name="alice")
    await service.publish(token, DatasetPublishBody(name="wiki", version=version, sha256=sha256))
    (event,) = outbox.events
    return event


async def test_an_imported_version_is_announced_by_its_object_url_and_verifies(
    s3_root: str, registry: Registry, tmp_path: Path
) -> None:
    result = imported(s3_root, tmp_path, "v1")
    event = await announce(s3_root, "v1", result.sha256)
    expected = f"{s3_root}/tenants/{TENANT}/datasets/wiki/v1/manifest.json"
    assert event.manifest_uri == str(result.manifest_path) == expected
    problems, manifest = await registry._verify(event)
    assert problems == [] and manifest["shards"] == json.loads(read_bytes(result.manifest_path))["shards"]
    # lineage of a job on an unregistered version reads the same manifest object
    found = registry._dataset_from_disk(f"{TENANT}/wiki@v1")
    assert found is not None and (found.manifest_uri, found.sha256) == (event.manifest_uri, result.sha256)


async def test_a_corrupted_or_missing_shard_and_a_manifest_elsewhere_are_refused(
    s3_root: str, registry: Registry, tmp_path: Path
) -> None:
    result = imported(s3_root, tmp_path, "v2")
    event = await announce(s3_root, "v2", result.sha256)
    directory = result.manifest_path.parent
    shards = [directory / s.file for s in result.manifest.shards]
    data = bytearray(read_bytes(shards[1]))
    data[len(data) // 2] ^= 0xFF  # same size, another sha256
    commit_bytes(shards[1], bytes(data))
    remove_file(shards[2])
    problems, _ = await registry._verify(event)
    assert [p.split(":")[0].split(" ")[0] for p in problems] == [shards[1].name, shards[2].name]
    assert "differs from the manifest's" in problems[0] and problems[1].endswith("is missing")

    # a manifest under another tenant's prefix, or one that climbs out of the owner's, is not the owner's
    other = ArtifactLayout(s3_root).dataset_dir("wiki", "v2", "someone-else") / "manifest.json"
    commit_bytes(other, read_bytes(result.manifest_path))
    for uri in (str(other), f"{s3_root}/tenants/{TENANT}/datasets/wiki/v2/../../../../someone-else/datasets/wiki/v2/"
                            "manifest.json", f"file:///{directory.path}/manifest.json"):
        problems, _ = await registry._verify(event.model_copy(update={"manifest_uri": uri}))
        assert len(problems) == 1 and "is not a file under the owner's dataset directory" in problems[0], uri
