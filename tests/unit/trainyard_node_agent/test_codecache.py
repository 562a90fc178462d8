"""The node's code cache: materialised once per hash, read-only, verified before every launch
(tampered → moved aside into quarantine, extracted again, deleted once no rank runs it), a wrong
archive refused, concurrent materialisation safe, and the eviction and purge choices (pure,
table-tested)."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from pathlib import Path

import pytest
from trainyard_contract.codetree import CodeTreeError, archive_id, pack
from trainyard_contract.events import GangAllocated, NodeAssignment, RankAssignment
from trainyard_contract.spec import Code, TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_node_agent.admission import rank_env
from trainyard_node_agent.codecache import (
    TAMPERED,
    CacheEntry,
    CodeCache,
    Collection,
    Quarantined,
    choose_evictions,
    choose_purges,
    parse_quarantined,
    quarantine_name,
    rank_paths,
    remove_tree,
)

TENANT = "t1"


def make_tree(root: Path) -> list[str]:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("import pkg.util\nprint('hi')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "util.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\nexec python train.py\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "latest.py").symlink_to("train.py")
    return ["train.py", "pkg/__init__.py", "pkg/util.py", "run.sh", "latest.py"]


@pytest.fixture
def layout(tmp_path: Path) -> ArtifactLayout:
    return ArtifactLayout(tmp_path / "artifacts")


@pytest.fixture
def archive(tmp_path: Path, layout: ArtifactLayout) -> str:
    """A packed tree stored where the API stores uploads; returns its sha256:<hex>."""
    src = tmp_path / "src"
    data = pack(src, make_tree(src))
    ident = archive_id(data)
    path = layout.code_archive(TENANT, ident.removeprefix("sha256:"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return ident


def cache_of(tmp_path: Path, layout: ArtifactLayout, max_bytes: int = 10 * 2**30) -> CodeCache:
    return CodeCache(tmp_path / "cache", layout, max_bytes=max_bytes)


def entries_in(cache_dir: Path) -> list[str]:
    """The cache's entries and leftovers (not its ``.holds`` lock files)."""
    return sorted(p.name for p in cache_dir.iterdir() if p.name != ".holds")


def code(archive: str) -> Code:
    return Code(archive=archive, entrypoint=["python", "train.py"])


def modes(tree: Path) -> dict[str, int]:
    return {p.relative_to(tree).as_posix(): stat.S_IMODE(p.lstat().st_mode)
            for p in [tree, *tree.rglob("*")] if not p.is_symlink()}


async def test_materialises_once_read_only_and_reuses_the_entry(tmp_path: Path, layout: ArtifactLayout,
                                                                archive: str) -> None:
    cache = cache_of(tmp_path, layout)
    first = await cache.acquire(TENANT, code(archive))
    cache.release(first.hex)
    assert first.materialised and first.root == tmp_path / "cache" / first.hex / "tree"
    assert (first.root / "pkg" / "util.py").read_text() == "X = 1\n"
    assert os.readlink(first.root / "latest.py") == "train.py"
    assert modes(first.root) == {".": 0o555, "pkg": 0o555, "train.py": 0o444, "pkg/__init__.py": 0o444,
                                 "pkg/util.py": 0o444, "run.sh": 0o555}
    again = await cache.acquire(TENANT, code(archive))
    cache.release(again.hex)
    assert not again.materialised and again.root == first.root
    assert entries_in(tmp_path / "cache") == [first.hex]  # no staging left behind


@pytest.mark.parametrize("tamper", [
    lambda tree: (os.chmod(tree / "train.py", 0o644), (tree / "train.py").write_text("print('evil')\n")),
    lambda tree: (os.chmod(tree / "pkg", 0o755), (tree / "pkg" / "extra.py").write_text("")),
    lambda tree: (os.chmod(tree / "pkg", 0o755), (tree / "pkg" / "util.py").unlink()),
    lambda tree: (os.chmod(tree, 0o755), (tree / "latest.py").unlink(), (tree / "latest.py").symlink_to("run.sh")),
], ids=["changed", "added", "removed", "relinked"])
async def test_a_tampered_entry_is_extracted_again_before_it_runs(tmp_path: Path, layout: ArtifactLayout,
                                                                  archive: str, tamper: object) -> None:
    cache = cache_of(tmp_path, layout)
    tree = (await cache.acquire(TENANT, code(archive))).root
    cache.release(tree.parent.name)
    tamper(tree)  # type: ignore[operator]  # a tampering function
    assert cache.problems(tree.parent.name)
    before = TAMPERED._value.get()
    again = await cache.acquire(TENANT, code(archive))
    cache.release(again.hex)
    assert again.materialised and TAMPERED._value.get() == before + 1
    assert cache.problems(again.hex) == []
    assert (again.root / "train.py").read_text().startswith("import pkg.util")
    assert entries_in(tmp_path / "cache") == [".quarantine", again.hex]
    assert [p.name for p in (tmp_path / "cache" / ".quarantine").iterdir()] == [f"{again.hex}-1"]
    assert cache.collect(in_use=set()) == Collection(evicted=[], purged=[f"{again.hex}-1"])
    assert list((tmp_path / "cache" / ".quarantine").iterdir()) == []


async def test_a_lost_digest_counts_as_tampered(tmp_path: Path, layout: ArtifactLayout, archive: str) -> None:
    cache = cache_of(tmp_path, layout)
    tree = await cache.acquire(TENANT, code(archive))
    cache.release(tree.hex)
    (cache.entry_dir(tree.hex) / "digest.json").unlink()
    again = await cache.acquire(TENANT, code(archive))
    cache.release(again.hex)
    assert again.materialised and cache.problems(again.hex) == []


async def test_an_archive_that_is_not_the_one_named_is_refused(tmp_path: Path, layout: ArtifactLayout,
                                                               archive: str) -> None:
    hex_digest = archive.removeprefix("sha256:")
    other = tmp_path / "other"
    files = make_tree(other)
    (other / "train.py").write_text("print('replaced')\n")
    layout.code_archive(TENANT, hex_digest).write_bytes(pack(other, files))  # replaced after upload
    cache = cache_of(tmp_path, layout)
    with pytest.raises(CodeTreeError, match=f"not the sha256:{hex_digest}.*not running it"):
        await cache.acquire(TENANT, code(archive))
    assert not cache.entry_dir(hex_digest).exists()
    assert cache._pins == {}  # a failed acquire pins nothing


async def test_a_missing_archive_and_an_unresolved_repo_are_config_errors(tmp_path: Path,
                                                                         layout: ArtifactLayout) -> None:
    cache = cache_of(tmp_path, layout)
    with pytest.raises(CodeTreeError, match="not in the artifact store"):
        await cache.acquire(TENANT, code("sha256:" + "ab" * 32))
    with pytest.raises(CodeTreeError, match="code.archive is not set"):
        await cache.acquire(TENANT, Code(repo="https://example.com/r.git", revision="main", entrypoint=["x"]))


def test_agents_racing_on_one_hash_end_with_one_intact_entry(tmp_path: Path, layout: ArtifactLayout,
                                                             archive: str) -> None:
    hex_digest = archive.removeprefix("sha256:")
    caches = [cache_of(tmp_path, layout) for _ in range(4)]  # four agents sharing the directory
    barrier = threading.Barrier(len(caches))
    results, errors = [], []

    def run(cache: CodeCache) -> None:
        barrier.wait()
        try:
            results.append(cache.prepare(hex_digest, TENANT))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {r.root for r in results} == {caches[0].tree_dir(hex_digest)}
    assert caches[0].problems(hex_digest) == []
    assert entries_in(tmp_path / "cache") == [hex_digest]


def test_the_loser_of_the_rename_drops_its_copy(tmp_path: Path, layout: ArtifactLayout, archive: str) -> None:
    hex_digest = archive.removeprefix("sha256:")
    winner, loser = cache_of(tmp_path, layout), cache_of(tmp_path, layout)
    winner.materialise(hex_digest, TENANT)
    loser.materialise(hex_digest, TENANT)  # extracts, fails to rename onto the winner's entry, cleans up
    assert entries_in(tmp_path / "cache") == [hex_digest]
    assert loser.problems(hex_digest) == []


async def test_one_agent_materialises_a_hash_once_for_concurrent_launches(tmp_path: Path, layout: ArtifactLayout,
                                                                         archive: str) -> None:
    cache = cache_of(tmp_path, layout)
    trees = await asyncio.gather(*(cache.acquire(TENANT, code(archive)) for _ in range(3)))
    assert sum(t.materialised for t in trees) == 1
    assert cache._pins[trees[0].hex] == 3
    for t in trees:
        cache.release(t.hex)
    assert cache._pins == {}


async def test_agents_sharing_a_cache_never_evict_a_tree_another_agents_ranks_run(
        tmp_path: Path, layout: ArtifactLayout, archive: str) -> None:
    runs, tidy = cache_of(tmp_path, layout), cache_of(tmp_path, layout, max_bytes=0)  # two agents, one directory
    tree = await runs.acquire(TENANT, code(archive))
    runs.release(tree.hex)  # launched: from now on "in use" is the agent's live ranks, not a pin
    assert runs.collect([tree.hex]) == Collection(evicted=[], purged=[])

    assert tidy.collect([]) == Collection(evicted=[], purged=[])  # over its limit, but the other agent runs it
    assert runs.problems(tree.hex) == []
    runs.quarantine(tree.hex)  # tampered meanwhile: moved aside, the ranks keep running from the moved tree
    assert tidy.collect([]) == Collection(evicted=[], purged=[])
    assert (tmp_path / "cache" / ".quarantine" / f"{tree.hex}-1" / "tree" / "train.py").is_file()

    assert runs.collect([]) == Collection(evicted=[], purged=[f"{tree.hex}-1"])  # its ranks ended
    again = await runs.acquire(TENANT, code(archive))
    runs.release(again.hex)
    runs.collect([])  # nothing of it runs: the hold goes
    assert tidy.collect([]) == Collection(evicted=[again.hex], purged=[])
    runs.close()
    tidy.close()


def test_an_agent_that_ends_drops_its_holds(tmp_path: Path, layout: ArtifactLayout, archive: str) -> None:
    hex_digest = archive.removeprefix("sha256:")
    ended, tidy = cache_of(tmp_path, layout), cache_of(tmp_path, layout, max_bytes=0)
    ended.prepare(hex_digest, TENANT)
    assert tidy.collect([]).evicted == []
    ended.close()  # what the kernel does when the agent process dies
    assert tidy.collect([]).evicted == [hex_digest]


def entry(hex_digest: str, size: int, used: float) -> CacheEntry:
    return CacheEntry(hex_digest, size, used)


@pytest.mark.parametrize(("entries", "in_use", "max_bytes", "evicted"), [
    ([], set(), 0, []),
    ([entry("a", 5, 1), entry("b", 5, 2)], set(), 10, []),  # at the limit: nothing
    ([entry("a", 5, 1), entry("b", 5, 2), entry("c", 5, 3)], set(), 10, ["a"]),  # oldest first
    ([entry("c", 5, 3), entry("a", 5, 1), entry("b", 5, 2)], set(), 5, ["a", "b"]),  # order of input is irrelevant
    ([entry("a", 5, 1), entry("b", 5, 2), entry("c", 5, 3)], {"a"}, 10, ["b"]),  # in use: skipped
    ([entry("a", 8, 1), entry("b", 8, 2)], {"a", "b"}, 1, []),  # everything in use: over the limit, kept
    ([entry("a", 1, 1), entry("big", 20, 2), entry("c", 1, 3)], set(), 10, ["a", "big"]),
    ([entry("y", 5, 1), entry("x", 5, 1)], set(), 5, ["x"]),  # a tie: by hash, deterministic
    ([entry("a", 5, 1)], set(), 0, ["a"]),  # limit 0: keep only what is in use
])
def test_eviction_choice(entries: list[CacheEntry], in_use: set[str], max_bytes: int, evicted: list[str]) -> None:
    assert choose_evictions(entries, in_use=in_use, max_bytes=max_bytes) == evicted


async def test_collect_keeps_what_runs_and_what_is_being_launched(tmp_path: Path, layout: ArtifactLayout,
                                                                  archive: str) -> None:
    cache = cache_of(tmp_path, layout, max_bytes=0)
    tree = await cache.acquire(TENANT, code(archive))  # pinned: a launch in progress
    assert cache.collect(in_use=set()) == Collection([], [])
    cache.release(tree.hex)
    assert cache.collect(in_use={tree.hex}) == Collection([], [])  # a live rank runs it
    (tmp_path / "cache" / ".trash-leftover" / "x").mkdir(parents=True)
    assert cache.collect(in_use=set()) == Collection([tree.hex], [])
    assert entries_in(tmp_path / "cache") == []


async def test_a_tampered_tree_stays_whole_for_the_ranks_running_from_it_until_they_end(
        tmp_path: Path, layout: ArtifactLayout, archive: str) -> None:
    """Attempt 1 runs from the tree (its working directory, the modules it imports later); someone edits a
    file; attempt 2's launch moves the entry aside and extracts a fresh one. Attempt 1 still finds every
    file where it was, until collection sees no live rank of the archive."""
    cache = cache_of(tmp_path, layout)
    first = await cache.acquire(TENANT, code(archive))
    cache.release(first.hex)
    cwd = os.open(first.root, os.O_RDONLY | os.O_DIRECTORY)  # what a running rank holds: its working directory
    try:
        os.chmod(first.root / "pkg", 0o755)
        (first.root / "pkg" / "extra.py").write_text("")  # tampered
        second = await cache.acquire(TENANT, code(archive))  # attempt 2 is being launched: pinned
        assert second.materialised and second.root == first.root and cache.problems(second.hex) == []
        assert cache.collect(in_use=set()) == Collection([], [])  # pinned by the launch in progress
        cache.release(second.hex)
        assert cache.collect(in_use={first.hex}) == Collection([], [])  # ranks of the archive still run
        module = os.open("pkg/util.py", os.O_RDONLY, dir_fd=cwd)  # attempt 1 imports a module now
        assert os.read(module, 64) == b"X = 1\n"
        os.close(module)
        assert cache.collect(in_use=set()) == Collection([], [f"{first.hex}-1"])  # the last rank ended
        with pytest.raises(FileNotFoundError):
            os.open("pkg/util.py", os.O_RDONLY, dir_fd=cwd)
    finally:
        os.close(cwd)
    assert cache.problems(first.hex) == []  # the fresh entry is untouched by the purge


async def test_each_tampering_is_quarantined_under_its_own_name(tmp_path: Path, layout: ArtifactLayout,
                                                                archive: str) -> None:
    cache = cache_of(tmp_path, layout)
    for _ in range(2):
        tree = await cache.acquire(TENANT, code(archive))
        cache.release(tree.hex)
        os.chmod(tree.root, 0o755)
        (tree.root / "extra.py").write_text("")
    again = await cache.acquire(TENANT, code(archive))
    cache.release(again.hex)
    assert sorted(p.name for p in (tmp_path / "cache" / ".quarantine").iterdir()) == [f"{again.hex}-1",
                                                                                      f"{again.hex}-2"]
    assert cache.quarantine("0" * 64) is None  # an entry moved already (by another agent): nothing to do


@pytest.mark.parametrize(("quarantined", "in_use", "purged"), [
    ([], set(), []),
    ([Quarantined("a-1", "a")], set(), ["a-1"]),
    ([Quarantined("a-1", "a")], {"a"}, []),  # a live rank of the archive may run from it
    ([Quarantined("a-2", "a"), Quarantined("b-1", "b"), Quarantined("a-1", "a")], {"b"}, ["a-1", "a-2"]),
    ([Quarantined("a-1", "a"), Quarantined("b-1", "b")], {"a", "b", "c"}, []),
])
def test_purge_choice(quarantined: list[Quarantined], in_use: set[str], purged: list[str]) -> None:
    assert choose_purges(quarantined, in_use=in_use) == purged


@pytest.mark.parametrize(("taken", "name"), [
    ([], "ab-1"),
    (["ab-1"], "ab-2"),
    (["ab-1", "ab-7", "cd-9", "stray", "ab-x"], "ab-8"),
])
def test_quarantine_names(taken: list[str], name: str) -> None:
    assert quarantine_name("ab", taken) == name


def test_quarantine_names_parse() -> None:
    assert parse_quarantined("ab-3") == Quarantined("ab-3", "ab")
    assert parse_quarantined("stray") is None and parse_quarantined("ab-x") is None and parse_quarantined("-1") is None


def test_entries_report_size_and_last_use(tmp_path: Path, layout: ArtifactLayout, archive: str) -> None:
    cache = cache_of(tmp_path, layout)
    tree = cache.prepare(archive.removeprefix("sha256:"), TENANT)
    os.utime(cache.entry_dir(tree.hex) / "last-used", (1000, 1000))
    [found] = cache.entries()
    size = sum(p.stat().st_size for p in tree.root.rglob("*") if p.is_file() and not p.is_symlink())
    assert found == CacheEntry(tree.hex, size, 1000.0)


def test_remove_tree_removes_a_sealed_tree(tmp_path: Path, layout: ArtifactLayout, archive: str) -> None:
    cache = cache_of(tmp_path, layout)
    tree = cache.prepare(archive.removeprefix("sha256:"), TENANT)
    remove_tree(cache.entry_dir(tree.hex))
    assert not cache.entry_dir(tree.hex).exists()


def test_rank_paths_name_everything_a_rank_of_user_code_touches(layout: ArtifactLayout) -> None:
    paths = rank_paths(layout, tenant="t1", job_id="j", attempt=2, rank=3, dataset="tinycorpus@v1",
                       code_dir=Path("/cache/abc/tree"), working_dir="src/train")
    attempt = layout.root / "tenants/t1/jobs/j/attempts/2"
    assert paths.code_dir == Path("/cache/abc/tree")
    assert paths.cwd == Path("/cache/abc/tree/src/train")
    assert paths.datasets == (layout.root / "datasets/tinycorpus/v1",)
    assert paths.checkpoints == layout.root / "tenants/t1/jobs/j/checkpoints"
    assert paths.scratch == attempt / "scratch/rank-3"
    assert paths.attempt_dir == attempt
    assert rank_paths(layout, tenant="t1", job_id="j", attempt=2, rank=3, dataset="d@v", code_dir=Path("/c"),
                      working_dir=None).cwd == Path("/c")


def test_the_environment_of_a_rank_of_user_code(layout: ArtifactLayout) -> None:
    spec = TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "test",
        "resources": {"gpuType": "cpu", "gpuCount": 1}, "parallelism": {"data": 1},
        "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 1, "learningRate": 0.001,
                     "maxSteps": 2},
        "code": {"archive": "sha256:" + "ab" * 32, "entrypoint": ["python", "train.py"], "env": {"GREETING": "hello"}},
    })
    assert spec.code is not None
    slot = RankAssignment(rank=0, local_rank=0, device_index=0)
    share = NodeAssignment(node_id="n", host="127.0.0.1", ranks=[slot])
    event = GangAllocated(job_id="j", tenant="t1", attempt=1, allocation_id="j-a1", epoch=3, world_size=1,
                          nodes=[share], master_addr="10.0.0.1", master_port=29500, spec=spec,
                          spec_hash=spec.spec_hash())
    env = rank_env(event, share, slot, base_env={"PATH": "/bin", "TRAINYARD_NODE_ID": "n", "GREETING": "agent's"},
                   backend="gloo", artifact_root=layout.root, allocation_file=Path("/a.json"),
                   events_file=Path("/e.jsonl"), traceparent=None,
                   code_env={**spec.code.env, "RANK": "7"},  # the spec refuses RANK; the contract wins anyway
                   code_dir=Path("/cache/abc/tree"), scratch_dir=Path("/scratch/rank-0"))
    assert (env["GREETING"], env["RANK"], env["PATH"]) == ("hello", "0", "/bin")
    assert (env["TRAINYARD_CODE_DIR"], env["TRAINYARD_SCRATCH_DIR"]) == ("/cache/abc/tree", "/scratch/rank-0")
    assert "TRAINYARD_NODE_ID" not in env
    builtin = rank_env(event, share, slot, base_env={}, backend="gloo", artifact_root=layout.root,
                       allocation_file=Path("/a.json"), events_file=Path("/e.jsonl"), traceparent=None)
    assert "TRAINYARD_CODE_DIR" not in builtin and "TRAINYARD_SCRATCH_DIR" not in builtin


def test_a_cache_the_node_cannot_write_is_the_nodes_trouble_not_the_jobs(tmp_path: Path, layout: ArtifactLayout,
                                                                         archive: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    cache = cache_of(tmp_path, layout)
    monkeypatch.setattr("trainyard_contract.codetree.os.chmod", full)  # the first write after a file's data
    with pytest.raises(OSError, match="No space left") as caught:
        cache.prepare(archive.removeprefix("sha256:"), TENANT)
    assert not isinstance(caught.value, CodeTreeError)
    assert entries_in(tmp_path / "cache") == []  # the staging directory is gone


def test_the_rank_table_remembers_which_code_a_rank_runs(tmp_path: Path) -> None:
    """An agent restarted while user code runs adopts the rank and keeps its tree out of eviction."""
    from trainyard_contract.spool import SpoolReader
    from trainyard_node_agent.ranks import RankProcess

    rank = RankProcess(job_id="j", tenant="t1", attempt=1, allocation_id="a", epoch=1, rank=0, local_rank=0, pid=5,
                       log_path=tmp_path / "log", spool=SpoolReader(tmp_path / "spool"), traceparent=None,
                       exit_file=tmp_path / "exit.json", code_archive="sha256:" + "cd" * 32)
    assert RankProcess.from_persisted(rank.persisted("boot")).code_archive == "sha256:" + "cd" * 32
    rank.code_archive = None
    assert "codeArchive" not in rank.persisted("boot")  # the built-in trainer's entries are unchanged
    assert RankProcess.from_persisted(rank.persisted("boot")).code_archive is None
