"""An uploaded code archive that would escape its tree (symlinks or hard links out of it, ``..`` or absolute
member names) is refused by the API itself (422 naming the body, nothing stored), before any node agent
sees it; the agent refuses the same archives again at extraction (test_rank_sandbox)."""

from __future__ import annotations

import io
import tarfile

import pytest
from trainyard_common import codetree

from tests.integration.test_api_code import GZIP, api  # noqa: F401 - fixture
from tests.support.api import TOKEN_A, client_for

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
async def test_an_archive_that_escapes_its_tree_is_refused_at_upload(api, archive: bytes) -> None:  # noqa: F811
    transport, _, layout = api
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        refused = await c.put(f"/v1/code/{codetree.archive_id(archive)}", content=archive, headers=GZIP)
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["field"] == "body", refused.json()
    assert not list(layout.root.rglob("*.tar.gz"))  # nothing refused was stored
