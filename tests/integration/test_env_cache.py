"""The environment cache with the real installer (uv) and real wheels from a package index of our own: built once
per lock and reused, verified before every use (a tampered entry is rebuilt, never used), built again over a new
base, shared by agents that never evict each other's live environments, and every bad lock a ``config`` failure
with the installer's words — the lock's fault, never the node's."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.wheels import Wheel, make_wheel, probe_wheel, pylock, requirements_lock, uv_lock
from trainyard_contract.lockfile import LockError
from trainyard_contract.spec import Environment
from trainyard_node_agent.envcache import (
    BUILT,
    BuildRequest,
    EnvPlan,
    REUSED,
    TAMPERED,
    EnvCache,
    EnvironmentBuildError,
    Installer,
    base_environment,
    find_uv,
)

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Wheel]:
    where = tmp_path_factory.mktemp("index")
    return {"probe1": probe_wheel(where, "1.0.0"), "probe2": probe_wheel(where, "2.0.0"),
            "dep": probe_wheel(where, "1.0.0", name="tydep", requires=["typrobe>=1"]),
            "needs2": probe_wheel(where, "1.0.0", name="tyneeds", requires=["typrobe>=2"]),
            "typing": make_wheel(where, "typing", "3.7.4.3", {"typing.py": "BACKPORT = True\n"})}


def cache_at(root: Path, index: dict[str, Wheel], *, max_bytes: int = 10**9) -> EnvCache:
    wheels = index["probe1"].path.parent
    return EnvCache(root, max_bytes=max_bytes, installer=Installer(find_uv(), find_links=(str(wheels),),
                                                                  no_index=True, timeout_s=120),
                    base=base_environment())


def tree_with(tmp_path: Path, name: str, text: str) -> tuple[Path, Environment]:
    tree = tmp_path / f"tree-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    tree.mkdir(exist_ok=True)
    (tree / name).write_text(text)
    return tree, Environment(lock=name, sha256="sha256:" + hashlib.sha256(text.encode()).hexdigest())


def acquire(cache: EnvCache, tree: Path, env: Environment) -> tuple[Path, bool, list[str]]:
    lines: list[str] = []
    plan = cache.plan(env, tree)
    entry = asyncio.run(cache.acquire(plan, lines.append))
    return entry.root, entry.materialised, lines


def imports(env_dir: Path, code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(env_dir)},
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


@pytest.mark.parametrize("fmt", ["requirements.txt", "pylock.toml", "uv.lock"])
def test_each_lock_format_builds_once_and_is_reused(tmp_path: Path, index: dict[str, Wheel], fmt: str) -> None:
    wheels = [index["probe1"], index["dep"]]
    text = {"requirements.txt": requirements_lock(wheels), "pylock.toml": pylock(wheels),
            "uv.lock": uv_lock("proj", wheels)}[fmt]
    tree, env = tree_with(tmp_path, fmt, text)
    cache = cache_at(tmp_path / "cache", index)
    built, reused = BUILT._value.get(), REUSED._value.get()
    root, fresh, lines = acquire(cache, tree, env)
    assert fresh and any("typrobe==1.0.0" in line for line in lines)  # the installer's progress reached us
    assert imports(root, "import typrobe, tydep; print(typrobe.VALUE)") == "typrobe 1.0.0"
    again, fresh_again, _ = acquire(cache, tree, env)
    assert (again, fresh_again) == (root, False)
    assert (BUILT._value.get(), REUSED._value.get()) == (built + 1, reused + 1)
    assert oct(root.stat().st_mode & 0o777) == "0o555"  # sealed
    assert cache.meta(env.sha256.removeprefix("sha256:"))["packages"] == {"typrobe": "1.0.0", "tydep": "1.0.0"}


def test_a_tampered_environment_is_rebuilt_never_used(tmp_path: Path, index: dict[str, Wheel]) -> None:
    tree, env = tree_with(tmp_path, "requirements.txt", requirements_lock([index["probe1"]]))
    cache = cache_at(tmp_path / "cache", index)
    root, _, _ = acquire(cache, tree, env)
    module = root / "typrobe" / "__init__.py"
    os.chmod(module, 0o644)
    module.write_text("VALUE = 'tampered'\n")
    tampered = TAMPERED._value.get()
    again, fresh, _ = acquire(cache, tree, env)
    assert fresh and TAMPERED._value.get() == tampered + 1
    assert imports(again, "import typrobe; print(typrobe.VALUE)") == "typrobe 1.0.0"
    assert (tmp_path / "cache" / ".quarantine").is_dir()  # moved aside: a rank still running from it keeps it


def test_an_environment_built_over_another_base_is_built_again(tmp_path: Path, index: dict[str, Wheel]) -> None:
    tree, env = tree_with(tmp_path, "requirements.txt", requirements_lock([index["probe1"]]))
    first = cache_at(tmp_path / "cache", index)
    acquire(first, tree, env)
    upgraded = cache_at(tmp_path / "cache", index)
    upgraded.base = replace(upgraded.base, protected={**upgraded.base.protected, "torch": "9.9.9"})
    tampered = TAMPERED._value.get()
    _, fresh, _ = acquire(upgraded, tree, env)
    assert fresh and TAMPERED._value.get() == tampered  # out of date is not tampered: no alarm


@pytest.mark.parametrize(("lock", "says"), [
    ("nonexistent-pkg==1.0 --hash=sha256:" + "0" * 64 + "\n",
     "Because nonexistent-pkg was not found in the provided package locations"),
    ("typrobe==1.0.0 --hash=sha256:{probe1}\ntyprobe==2.0.0 --hash=sha256:{probe2}\n",
     "Because you require typrobe==1.0.0 and typrobe==2.0.0"),
    ("typrobe==1.0.0 --hash=sha256:" + "0" * 64 + "\n", "Hash mismatch for `typrobe==1.0.0`"),
    ("tyneeds==1.0.0 --hash=sha256:{needs2}\ntyprobe==1.0.0 --hash=sha256:{probe1}\n",
     "is not complete: tyneeds 1.0.0 needs typrobe>=2 (1.0.0 found)"),
    ("pydantic==1.10.13 --hash=sha256:" + "1" * 64 + "\n", "would replace the node's own pydantic==1.10.13"),
    ("torch==2.0.0 --hash=sha256:" + "1" * 64 + "\n", "would replace the node's own torch==2.0.0"),
    ("typing==3.7.4.3 --hash=sha256:{typing}\n", "installs typing, which would shadow the standard library's"),
])
def test_a_bad_lock_is_the_jobs_fault_in_the_installers_words(tmp_path: Path, index: dict[str, Wheel],
                                                              lock: str, says: str) -> None:
    text = lock.format(**{k: w.sha256 for k, w in index.items()})
    tree, env = tree_with(tmp_path, "requirements.txt", text)
    cache = cache_at(tmp_path / "cache", index)
    with pytest.raises(EnvironmentBuildError, match=says.replace("(", r"\(").replace(")", r"\)")):
        acquire(cache, tree, env)
    assert [p.name for p in (tmp_path / "cache").glob("*") if not p.name.startswith(".")] == []  # nothing kept


def test_a_lock_that_is_not_the_one_pinned_or_not_a_file_is_refused(tmp_path: Path, index: dict[str, Wheel]) -> None:
    tree, env = tree_with(tmp_path, "requirements.txt", requirements_lock([index["probe1"]]))
    cache = cache_at(tmp_path / "cache", index)
    with pytest.raises(LockError, match="not the sha256:" + "f" * 64):
        cache.plan(env.model_copy(update={"sha256": "sha256:" + "f" * 64}), tree)
    (tree / "shadow.txt").symlink_to("/etc/shadow")
    with pytest.raises(LockError, match="symbolic link"):
        cache.plan(Environment(lock="shadow.txt"), tree)
    with pytest.raises(LockError, match="is not a file of the code tree"):
        cache.plan(Environment(lock="missing.txt"), tree)


def test_agents_sharing_the_cache_never_evict_each_others_live_environments(tmp_path: Path,
                                                                           index: dict[str, Wheel]) -> None:
    trees = [tree_with(tmp_path, "requirements.txt", requirements_lock([index[k]])) for k in ("probe1", "probe2")]
    a, b = cache_at(tmp_path / "cache", index, max_bytes=0), cache_at(tmp_path / "cache", index, max_bytes=0)
    root_a, _, _ = acquire(a, *trees[0])  # agent a's rank runs this one (held until a lets it go)
    root_b, _, _ = acquire(b, *trees[1])
    hex_a, hex_b = (env.sha256.removeprefix("sha256:") for _, env in trees)
    a.release(hex_a)  # launched: a's rank runs from it now (collect is told so through in_use)
    b.release(hex_b)
    assert b.collect(in_use=[hex_b]).evicted == []  # over the limit, but a holds a's and b's rank runs b's
    assert root_a.is_dir() and root_b.is_dir()
    assert a.collect(in_use=[]).evicted == [hex_a]  # a's rank ended: a may evict its own, never b's
    assert not root_a.exists() and root_b.is_dir()
    b.close()
    assert a.collect(in_use=[]).evicted == [hex_b]  # b went away (its holds with it)


def test_agents_racing_on_one_lock_end_with_one_intact_environment(tmp_path: Path, index: dict[str, Wheel]) -> None:
    tree, env = tree_with(tmp_path, "requirements.txt", requirements_lock([index["probe1"], index["dep"]]))
    caches = [cache_at(tmp_path / "cache", index) for _ in range(3)]
    plan = caches[0].plan(env, tree)
    barrier, roots, errors = threading.Barrier(3), [], []

    def run(cache: EnvCache) -> None:
        barrier.wait()
        try:
            roots.append(cache.prepare(plan.hex, _build(plan)))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and {r.root for r in roots} == {caches[0].tree_dir(plan.hex)}
    assert caches[0].problems(plan.hex) == []
    assert imports(roots[0].root, "import tydep, typrobe; print(typrobe.VALUE)") == "typrobe 1.0.0"


def _build(plan: EnvPlan) -> BuildRequest:
    return BuildRequest(plan, lambda _line: None)
