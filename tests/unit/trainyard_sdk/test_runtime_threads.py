"""A rank's CPU threads: the node agent's share, else OpenMP's setting, else an equal share of the cores."""

from __future__ import annotations

import pytest
import torch

from trainyard.runtime import Runtime, configure_determinism, rank_cpu_threads
from trainyard.settings import RankSettings

RANK = dict(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=29500, job_id="j",
            tenant="t", attempt=1, epoch=1, allocation_id="a", artifact_root="/tmp", allocation_file="/tmp/a.json",
            events_file="/tmp/e.jsonl")


@pytest.mark.parametrize(("cpu_threads", "omp", "local_world", "cores", "threads"), [
    (3, "8", 2, 16, 3),  # TRAINYARD_CPU_THREADS (the agent's share) wins
    (None, "6", 2, 16, 6),  # else OMP_NUM_THREADS
    (None, "4,2", 2, 16, 4),  # a nested OpenMP list: its first level
    (None, None, 2, 16, 8),  # else the agent's rule: the cores shared by the node's ranks
    (None, "", 4, 2, 1),
    (None, "many", 1, 2, 2),  # not a figure: ignored
    (None, "0", 1, 2, 2),
])
def test_rank_cpu_threads(cpu_threads: int | None, omp: str | None, local_world: int, cores: int,
                          threads: int) -> None:
    settings = RankSettings(**RANK, local_world_size=local_world, cpu_threads=cpu_threads, omp_num_threads=omp)
    assert rank_cpu_threads(settings, cores) == threads


def test_deterministic_cpu_ranks_keep_their_threads() -> None:
    before = torch.get_num_threads()
    try:
        configure_determinism(Runtime(torch.device("cpu"), "gloo", None), seed=1, rank=0, deterministic=True,
                              cpu_threads=2)
        assert torch.get_num_threads() == 2 and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(before)
