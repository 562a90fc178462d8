"""Users' code archives under an ``s3://`` artifact root (moto's S3 server) and the real Redis: an upload
through the API lands as one object named by its sha256, then its record (written last, it makes the
archive known); a node agent's code cache fetches it from the store and checks its sha256 before
extracting, and refuses an object replaced since."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.objectstore import moto_s3
from tests.support.api import TOKEN_A, TOKEN_B, client_for, seed
from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_contract import codetree
from trainyard_runtime.outbox import Outbox
from trainyard_contract.spec import Code
from trainyard_contract.storage import ArtifactLayout, ObjectPath, commit_bytes, read_bytes, sha256_of
from trainyard_runtime.store import StateStore
from trainyard_node_agent.codecache import CodeCache

pytestmark = pytest.mark.integration

GZIP = {"Content-Type": "application/gzip"}


@pytest.fixture(scope="module")
def s3_root() -> Iterator[str]:
    with moto_s3() as root:
        yield root


@pytest.fixture
async def api(env: dict[str, Any], redis: Any, s3_root: str
              ) -> AsyncIterator[tuple[httpx.ASGITransport, ArtifactLayout]]:
    store = StateStore(redis)
    await seed(store)
    settings = ApiSettings(**(env | {"artifact_root": s3_root}), api_max_code_bytes=4096)
    assert isinstance(settings.artifact_root_abs, ObjectPath)
    app = create_app(ApiContext(settings, store, Outbox(redis, "api")))
    yield httpx.ASGITransport(app=app), ArtifactLayout(settings.artifact_root_abs)


def packed(root: Path, files: dict[str, str]) -> bytes:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return codetree.pack(root, sorted(files))


async def test_an_upload_lands_in_the_store_by_its_sha256_and_the_code_cache_fetches_and_checks_it(
    api: tuple[httpx.ASGITransport, ArtifactLayout], tmp_path: Path
) -> None:
    transport, layout = api
    data = packed(tmp_path / "src", {"train.py": "print('hi')\n", "lib/util.py": "X = 1\n"})
    archive = codetree.archive_id(data)
    hex_digest = codetree.archive_hex(archive)
    async with client_for("http://api", TOKEN_A, transport=transport) as a, \
            client_for("http://api", TOKEN_B, transport=transport) as b:
        first = await a.put(f"/v1/code/{archive}", content=data, headers=GZIP)
        assert first.status_code == 201, first.text
        stored = layout.code_archive("tenant-a", hex_digest)
        assert str(stored).startswith("s3://") and read_bytes(stored) == data and sha256_of(stored) == hex_digest
        assert read_bytes(layout.code_archive_meta("tenant-a", hex_digest))  # its record, written after it
        again = await a.put(f"/v1/code/{archive}", content=data, headers=GZIP)
        assert again.status_code == 200 and again.json() == first.json()  # known: not stored again
        assert (await a.get(f"/v1/code/{archive}")).json() == first.json()
        assert (await b.get(f"/v1/code/{archive}")).status_code == 404  # another tenant's

    # a node agent's cache: fetched from the store, sha256 checked, extracted, verified
    cache = CodeCache(tmp_path / "cache", layout, max_bytes=2**30)
    tree = await cache.acquire("tenant-a", Code(archive=archive, entrypoint=["python", "train.py"]))
    assert tree.materialised and (tree.root / "lib" / "util.py").read_text() == "X = 1\n"
    cache.release(hex_digest)

    # the object replaced behind the API's back: another node refuses to run it
    commit_bytes(stored, data[:-1] + bytes([data[-1] ^ 1]))
    other = CodeCache(tmp_path / "other-cache", layout, max_bytes=2**30)
    with pytest.raises(codetree.CodeTreeError, match=f"is sha256:[0-9a-f]{{64}}, not the sha256:{hex_digest}"):
        await other.acquire("tenant-a", Code(archive=archive, entrypoint=["python", "train.py"]))
    cache.close()
    other.close()
