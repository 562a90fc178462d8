"""Deterministic CPU ranks with more than one intra-op thread still resume bitwise.

torch's CPU kernels chunk a reduction by the thread count, so a fixed count sums in a fixed
order: a rank given 2 threads (``TRAINYARD_CPU_THREADS``, what the node agent passes) trains 6
steps uninterrupted; a second attempt resumed from its step-2 checkpoint with the same count
ends bitwise identical (parameters, Adam moments, schedule, sampler, counters, RNG). The run
record says each rank's count; a resume under another count proceeds and the record says it is
not expected to be bitwise (the world size's policy: reported, not refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainyard_contract.storage import ArtifactLayout, path_to_uri
from trainyard.data import STDLIB_SOURCES, prepare_dataset
from tests.integration.test_trainer_ranks import (
    EVERY,
    MAX_STEPS,
    TENANT,
    RunResult,
    assert_bitwise_equal,
    load_whole,
    losses,
    ref_for,
    run_attempt,
    shards_of,
    write_manifest,
)

THREADS = {"TRAINYARD_CPU_THREADS": "2"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("threads") / "artifacts"
    prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:6])
    return root


@pytest.fixture(scope="module")
def first_run(root: Path) -> RunResult:
    result = run_attempt(root, "job-t", attempt=1, world=1, env=THREADS)
    assert result.codes == [0], "\n".join(result.logs)
    return result


@pytest.fixture(scope="module")
def uninterrupted(root: Path, first_run: RunResult, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = ArtifactLayout(root).checkpoint_dir(TENANT, "job-t", 1, MAX_STEPS)
    return load_whole(directory, tmp_path_factory.mktemp("whole"))


def test_the_run_record_says_each_ranks_threads(first_run: RunResult) -> None:
    assert first_run.record is not None
    assert first_run.record["environment"]["cpuThreads"] == [2]
    assert first_run.record["restore"]["cpuThreads"] is None


def test_two_threads_per_rank_resume_bitwise(root: Path, first_run: RunResult, uninterrupted: dict[str, Any],
                                             tmp_path: Path) -> None:
    manifest = write_manifest(shards_of(first_run, EVERY))
    resumed = run_attempt(root, "job-t", attempt=2, world=1, start=ref_for(manifest), env=THREADS)
    assert resumed.codes == [0], "\n".join(resumed.logs)
    restore = resumed.record["restore"]
    assert restore["manifestUri"] == path_to_uri(manifest) and restore["rng"] == "restored"
    assert restore["cpuThreads"] == [2] and restore["cpuThreadsNote"] is None
    assert resumed.record["environment"]["cpuThreads"] == [2]
    before = losses(first_run)
    assert losses(resumed) == {s: before[s] for s in range(EVERY + 1, MAX_STEPS + 1)}
    after = load_whole(ArtifactLayout(root).checkpoint_dir(TENANT, "job-t", 2, MAX_STEPS), tmp_path)
    assert_bitwise_equal(uninterrupted, after)


def test_a_resume_under_another_thread_count_is_reported_not_refused(root: Path, first_run: RunResult) -> None:
    manifest = write_manifest(shards_of(first_run, MAX_STEPS - EVERY))
    resumed = run_attempt(root, "job-t", attempt=3, world=1, start=ref_for(manifest),
                          env={"TRAINYARD_CPU_THREADS": "1"})
    assert resumed.codes == [0], "\n".join(resumed.logs)
    restore = resumed.record["restore"]
    assert restore["globalStep"] == MAX_STEPS - EVERY and restore["cpuThreads"] == [2]
    assert "written with 2 CPU threads per rank, this attempt runs 1" in restore["cpuThreadsNote"]
    assert resumed.record["environment"]["cpuThreads"] == [1]
    assert "not bitwise identically" in resumed.logs[0]
