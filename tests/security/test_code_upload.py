"""An uploaded code archive that would escape its tree (symlinks or hard links out of it, ``..`` or absolute
member names) is refused by the API itself (422 naming the body, nothing stored), before any node agent
sees it; the agent refuses the same archives again at extraction (test_rank_sandbox).

An archive of more entries than ``codetree.MAX_FILES`` (60,001 tiny files: a job that would time out at
start-up) is refused by the API at upload with the limit and the count, nothing stored, and by the node
agent's code cache at extraction (a config failure), which stops at the limit; one at the limit is taken."""

from __future__ import annotations

import functools
import gzip
import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from trainyard_api.app import ApiContext, create_app
from trainyard_api import ApiSettings

from trainyard_runtime.outbox import Outbox
from trainyard_contract import codetree
from trainyard_contract.errors import ConfigError
from trainyard_contract.spec import Code
from trainyard_contract.storage import ArtifactLayout
from trainyard_runtime.store import StateStore
from trainyard_node_agent.codecache import CodeCache

from tests.integration.test_api_code import GZIP, api  # noqa: F401 - fixture
from tests.support.api import TOKEN_A, client_for, seed

pytestmark = [pytest.mark.integration, pytest.mark.security]


def _archive(name: str, kind: bytes, link: str = "", data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        main = tarfile.TarInfo("train.py")
        main.size = 5
        tar.addfile(main, io.BytesIO(b"pass\n"))
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.size = kind, link, len(data)
        tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


@pytest.mark.parametrize("archive", [
    _archive("data", tarfile.SYMTYPE, "/"),
    _archive("up", tarfile.SYMTYPE, "../../.."),
    _archive("nested/up", tarfile.SYMTYPE, "../../etc/passwd"),
    _archive("passwd", tarfile.LNKTYPE, "/etc/passwd"),
    _archive("../escaped.py", tarfile.REGTYPE, data=b"x = 1\n"),
    _archive("/tmp/escaped.py", tarfile.REGTYPE, data=b"x = 1\n"),
    _archive("dev", tarfile.CHRTYPE),
], ids=["absolute-symlink", "symlink-up", "nested-symlink-up", "hardlink", "dot-dot", "absolute-name", "device"])
async def test_an_archive_that_escapes_its_tree_is_refused_at_upload(api, archive: bytes) -> None:  # noqa: F811 - the api fixture
    transport, _, layout = api
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        refused = await c.put(f"/v1/code/{codetree.archive_id(archive)}", content=archive, headers=GZIP)
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["field"] == "body", refused.json()
    assert not list(layout.root.rglob("*.tar.gz"))  # nothing refused was stored


@functools.cache
def _many(count: int) -> bytes:
    """A ``.tar.gz`` of ``count`` tiny files (``train.py`` and ``f/<i>``, one byte each), built in memory."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(count):
            info = tarfile.TarInfo("train.py" if i == 0 else f"f/{i}")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"\n"))
    return buf.getvalue()


OVER = codetree.MAX_FILES + 10_001  # 60,001


@pytest.fixture
async def big_api(env: dict, redis) -> AsyncIterator[tuple[httpx.ASGITransport, ArtifactLayout]]:
    """The bare app over the real Redis with the default size limit (the archives here are ~1 MiB)."""
    store = StateStore(redis)
    await seed(store)
    settings = ApiSettings(**env)
    app = create_app(ApiContext(settings, store, Outbox(redis, "api")))
    yield httpx.ASGITransport(app=app), ArtifactLayout(settings.artifact_root_abs)


async def test_an_archive_of_too_many_entries_is_refused_at_upload_with_the_limit_and_the_count(
        big_api) -> None:
    transport, layout = big_api
    archive = _many(OVER)
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        refused = await c.put(f"/v1/code/{codetree.archive_id(archive)}", content=archive, headers=GZIP)
    assert refused.status_code == 422, refused.text
    (problem,) = refused.json()["detail"]
    assert problem["field"] == "body", problem
    assert f"holds {OVER} files and symlinks" in problem["message"], problem
    assert f"the limit is {codetree.MAX_FILES}" in problem["message"], problem
    assert not list(layout.root.rglob("*.tar.gz"))  # nothing refused was stored


async def test_an_archive_at_the_entry_limit_is_taken_at_upload(big_api) -> None:
    transport, _ = big_api
    archive = _many(codetree.MAX_FILES)
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        taken = await c.put(f"/v1/code/{codetree.archive_id(archive)}", content=archive, headers=GZIP)
    assert taken.status_code == 201, taken.text
    assert taken.json()["files"] == codetree.MAX_FILES


def _stored(layout: ArtifactLayout, data: bytes) -> str:
    """An archive put where the API stores uploads, as an attacker with store access might (past the API)."""
    ident = codetree.archive_id(data)
    path = layout.code_archive("attacker", codetree.archive_hex(ident))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return ident


async def test_the_node_agent_stops_extracting_at_the_entry_limit_as_a_config_failure(tmp_path: Path) -> None:
    layout = ArtifactLayout(tmp_path / "artifacts")
    cache = CodeCache(tmp_path / "cache", layout, max_bytes=2**32)
    over = _stored(layout, _many(OVER))
    with pytest.raises(ConfigError, match=f"at least {codetree.MAX_FILES + 1} files and symlinks, "
                                          f"the limit is {codetree.MAX_FILES}"):
        await cache.acquire("attacker", Code(archive=over, entrypoint=["python", "train.py"]))
    written = sum(1 for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert written <= codetree.MAX_FILES  # it stopped at the limit, and dropped what it had extracted
    at_limit = _stored(layout, _many(codetree.MAX_FILES))
    tree = await cache.acquire("attacker", Code(archive=at_limit, entrypoint=["python", "train.py"]))
    assert tree.materialised and (tree.root / "train.py").is_file()
    assert sum(1 for p in tree.root.rglob("*") if p.is_file()) == codetree.MAX_FILES
    cache.release(tree.hex)
