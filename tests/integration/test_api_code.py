"""Users' code against the real Redis and a real git: uploads (hash, size, unpackable, idempotent, per
tenant), submissions naming an archive, and code.repo + code.revision resolved to the commit and archived."""

from __future__ import annotations

import gzip
import hashlib
import io
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract import codetree
from trainyard_runtime.outbox import Outbox
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_runtime.store import StateStore
from tests.support.api import TOKEN_A, TOKEN_B, client_for, seed, spec_with

pytestmark = pytest.mark.integration

#: EXAMPLE_SPEC's hash before specs could carry code (computed with the spec module of 051cd0c).
EXAMPLE_SPEC_HASH = "sha256:ac83400f996acc87ff4c9c1b6851b524c5e265247b57d50d1558a76455867afd"
GZIP = {"Content-Type": "application/gzip"}
ENTRYPOINT = ["python", "train.py"]


@pytest.fixture
async def api(env: dict, redis) -> AsyncIterator[tuple[httpx.ASGITransport, StateStore, ArtifactLayout]]:
    """The bare app over the real Redis, a small code limit (4 KiB) and the test's artifact root."""
    store = StateStore(redis)
    await seed(store)
    settings = ApiSettings(**env, api_max_code_bytes=4096, api_git_timeout_s=30,
                           api_git_local_repos=True)
    app = create_app(ApiContext(settings, store, Outbox(redis, "api")))
    yield httpx.ASGITransport(app=app), store, ArtifactLayout(settings.artifact_root_abs)


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def packed(root: Path) -> bytes:
    return codetree.pack(root, [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()])


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@e", "HOME": str(repo), "PATH": "/usr/bin:/bin"}
                          ).stdout.strip()


def code_spec(**code: object) -> dict:
    return spec_with(code={"entrypoint": ENTRYPOINT, **code})


async def test_an_upload_is_checked_stored_per_tenant_and_idempotent(api, tmp_path: Path) -> None:
    transport, _, layout = api
    data = packed(tree(tmp_path / "src", {"train.py": "print('hi')\n", "lib/util.py": "X = 1\n"}))
    archive = codetree.archive_id(data)
    async with client_for("http://api", TOKEN_A, transport=transport) as a, \
            client_for("http://api", TOKEN_B, transport=transport) as b:
        assert (await a.get(f"/v1/code/{archive}")).status_code == 404
        first = await a.put(f"/v1/code/{archive}", content=data, headers=GZIP)
        assert first.status_code == 201, first.text
        assert first.json()["size"] == len(data) and first.json()["files"] == 2
        path = layout.code_archive("tenant-a", codetree.archive_hex(archive))
        assert path.read_bytes() == data
        stamp = path.stat().st_mtime_ns

        again = await a.put(f"/v1/code/{archive}", content=data, headers=GZIP)
        assert again.status_code == 200 and again.json() == first.json()
        assert path.stat().st_mtime_ns == stamp  # nothing rewritten
        assert (await a.get(f"/v1/code/{archive}")).json() == first.json()
        assert (await b.get(f"/v1/code/{archive}")).status_code == 404  # another tenant's archive

        # a job of tenant A may name it, one of tenant B may not
        assert (await a.post("/v1/training-jobs", json=code_spec(archive=archive))).status_code == 202
        refused = await b.post("/v1/training-jobs", json=code_spec(archive=archive))
        assert refused.status_code == 422
        assert [d["field"] for d in refused.json()["detail"]] == ["code.archive"]
        assert "trainyard submit --code" in refused.json()["detail"][0]["message"]


async def test_bad_uploads_are_refused_with_what_to_do(api, tmp_path: Path) -> None:
    transport, _, layout = api
    data = packed(tree(tmp_path / "src", {"train.py": "pass\n"}))
    other = "sha256:" + "0" * 64
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        mismatch = await c.put(f"/v1/code/{other}", content=data, headers=GZIP)
        assert mismatch.status_code == 422
        assert mismatch.json()["detail"][0]["field"] == "path.archive"
        assert codetree.archive_id(data) in mismatch.json()["detail"][0]["message"]

        big = bytes(range(256)) * 17  # 4352 bytes, over the 4 KiB limit
        too_big = await c.put(f"/v1/code/{codetree.archive_id(big)}", content=big, headers=GZIP)
        assert too_big.status_code == 413
        assert "4096 bytes" in too_big.json()["detail"] and "TRAINYARD_API_MAX_CODE_BYTES" in too_big.json()["detail"]

        garbage = b"not a tarball"
        refused = await c.put(f"/v1/code/{codetree.archive_id(garbage)}", content=garbage, headers=GZIP)
        assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "body"
        assert "not a readable code archive" in refused.json()["detail"][0]["message"]

        escaping = _tar_gz([("../evil.py", b"x")])
        refused = await c.put(f"/v1/code/{codetree.archive_id(escaping)}", content=escaping, headers=GZIP)
        assert refused.status_code == 422
        assert "not a path inside the code tree" in refused.json()["detail"][0]["message"]

        wrong_type = await c.put(f"/v1/code/{codetree.archive_id(data)}", content=data,
                                 headers={"Content-Type": "text/plain"})
        assert wrong_type.status_code == 415
        assert (await c.get("/v1/code/sha256:xyz")).status_code == 422
    assert not list(layout.root.rglob("*.tar.gz"))  # nothing refused was stored


def _tar_gz(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


async def test_repo_and_branch_resolve_to_the_commit_whose_archive_the_stored_spec_names(
    api, tmp_path: Path
) -> None:
    transport, store, layout = api
    repo = tree(tmp_path / "repo", {"train.py": "print(1)\n", ".gitignore": "data/\n"})
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    first = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "-b", "experiment")
    (repo / "train.py").write_text("print(2)\n")
    git(repo, "commit", "-q", "-am", "two")
    second = git(repo, "rev-parse", "HEAD")
    git(repo, "tag", "v1", first)

    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        resp = await c.post("/v1/training-jobs", json=code_spec(repo=str(repo), revision="experiment"))
        assert resp.status_code == 202, resp.text
        job = (await c.get(f"/v1/training-jobs/{resp.json()['jobId']}")).json()
        code = job["spec"]["code"]
        assert (code["repo"], code["revision"], code["commit"]) == (str(repo), "experiment", second)
        stored = await store.get_job(job["jobId"])
        assert stored is not None and stored.spec.code is not None
        assert stored.spec.code.archive == code["archive"] and stored.spec_hash == stored.spec.spec_hash()
        assert stored.spec_hash == resp.json()["specHash"]  # the hash covers the commit and the archive
        path = layout.code_archive("tenant-a", codetree.archive_hex(code["archive"]))
        assert hashlib.sha256(path.read_bytes()).hexdigest() == codetree.archive_hex(code["archive"])
        digest = codetree.extract(path.read_bytes(), tmp_path / "out")
        assert set(digest.files) == {"train.py", ".gitignore"}
        assert (tmp_path / "out" / "train.py").read_text() == "print(2)\n"

        # a tag and a short commit resolve too; the same commit archives to the same address
        by_tag = await c.post("/v1/training-jobs", json=code_spec(repo=str(repo), revision="v1"))
        by_sha = await c.post("/v1/training-jobs", json=code_spec(repo=str(repo), revision=first[:10]))
        tagged = (await c.get(f"/v1/training-jobs/{by_tag.json()['jobId']}")).json()["spec"]["code"]
        shaed = (await c.get(f"/v1/training-jobs/{by_sha.json()['jobId']}")).json()["spec"]["code"]
        assert tagged["commit"] == shaed["commit"] == first and tagged["archive"] == shaed["archive"] != code["archive"]

        # a file:// URL goes through ls-remote and fetch, and gets the same archive for the same commit
        remote = await c.post("/v1/training-jobs", json=code_spec(repo=repo.as_uri(), revision="experiment"))
        assert remote.status_code == 202, remote.text
        fetched = (await c.get(f"/v1/training-jobs/{remote.json()['jobId']}")).json()["spec"]["code"]
        assert (fetched["commit"], fetched["archive"]) == (second, code["archive"])


async def test_unknown_revisions_and_unusable_repos_are_422_naming_the_field(api, tmp_path: Path) -> None:
    transport, _, _ = api
    repo = tree(tmp_path / "repo", {"train.py": "pass\n"})
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    (tmp_path / "plain").mkdir()

    async def fields(**code: object) -> dict[str, str]:
        resp = await c.post("/v1/training-jobs", json=code_spec(**code))
        assert resp.status_code == 422, resp.text
        return {d["field"]: d["message"] for d in resp.json()["detail"]}

    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        assert "no-such-branch" in (await fields(repo=str(repo), revision="no-such-branch"))["code.revision"]
        assert "code.revision" in await fields(repo=repo.as_uri(), revision="no-such-branch")
        assert "not a git repository" in (await fields(repo=str(tmp_path / "plain"), revision="main"))["code.repo"]
        assert "no directory" in (await fields(repo=str(tmp_path / "missing"), revision="main"))["code.repo"]
        assert "code.repo" in await fields(repo=(tmp_path / "missing").as_uri(), revision="main")
        assert "absolute path" in (await fields(repo="relative/repo", revision="main"))["code.repo"]
        assert "code.revision" in await fields(repo=str(repo), revision="--output=/tmp/x")
        assert "code.commit" in await fields(repo=str(repo), revision="main", commit="0" * 40)
        # the spec's own rules name the field they are about
        assert "needs code.revision" in (await fields(repo=str(repo)))["code.repo"]
        assert "needs code.repo" in (await fields(archive="sha256:" + "0" * 64, revision="main"))["code.revision"]
        assert "code.archive" in await fields()


async def test_specs_without_code_keep_their_hash(api) -> None:
    transport, _, _ = api
    assert TrainingSpec.model_validate(EXAMPLE_SPEC).spec_hash() == EXAMPLE_SPEC_HASH
    async with client_for("http://api", TOKEN_A, transport=transport) as c:
        resp = await c.post("/v1/training-jobs", json=EXAMPLE_SPEC)
        assert resp.status_code == 202 and resp.json()["specHash"] == EXAMPLE_SPEC_HASH
        job = (await c.get(f"/v1/training-jobs/{resp.json()['jobId']}")).json()
        assert "code" not in job["spec"]
