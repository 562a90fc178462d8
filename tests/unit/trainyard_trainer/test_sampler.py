import numpy as np
import pytest
import torch

from trainyard_contract.errors import DataError
from trainyard.sampler import BatchLoader, GlobalSampler, SampleOrder, sample_position


def sampler(dp: int, rank: int, *, n: int = 1000, seed: int = 3, global_batch: int = 32,
            micro: int = 8) -> GlobalSampler:
    return GlobalSampler(n, seed=seed, global_batch=global_batch, micro_batch=micro, dp=dp, dp_rank=rank)


def step_ids(samplers: list[GlobalSampler]) -> list[list[list[int]]]:
    """Per rank, per micro step, the ids of one optimizer step; then advance every rank."""
    out = [s.step_sample_ids() for s in samplers]
    for s in samplers:
        s.advance()
    return out


def test_position_rule() -> None:
    # g + (k*dp + r)*micro + i
    assert sample_position(64, 1, 1, 3, micro_batch=8, dp=2) == 64 + (1 * 2 + 1) * 8 + 3


def test_order_is_deterministic_and_a_permutation_per_epoch() -> None:
    a, b = SampleOrder(100, seed=9), SampleOrder(100, seed=9)
    first = [a.sample_id(p) for p in range(100)]
    assert first == [b.sample_id(p) for p in range(100)]
    assert sorted(first) == list(range(100))
    second = [a.sample_id(p) for p in range(100, 200)]
    assert sorted(second) == list(range(100)) and second != first  # re-permuted with seed + epoch
    assert first != [SampleOrder(100, seed=10).sample_id(p) for p in range(100)]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_ranks_read_disjoint_rows_covering_the_global_batch(dp: int) -> None:
    samplers = [sampler(dp, r, micro=32 // (dp * 2)) for r in range(dp)]
    for _ in range(3):
        ids = [i for rank in step_ids(samplers) for micro in rank for i in micro]
        assert len(ids) == 32 and len(set(ids)) == 32


def test_each_step_sees_the_same_samples_whatever_the_number_of_ranks() -> None:
    one = [sampler(1, 0, micro=8)]  # grad accumulation 4
    two = [sampler(2, r, micro=8) for r in range(2)]  # grad accumulation 2
    four = [sampler(4, r, micro=4) for r in range(4)]  # grad accumulation 2
    for _ in range(40):  # crosses the 1000-sample epoch boundary
        contents = [sorted(i for rank in step_ids(group) for micro in rank for i in micro)
                    for group in (one, two, four)]
        assert contents[0] == contents[1] == contents[2]


def test_dp1_and_dp2_rows_follow_the_documented_layout() -> None:
    (single,) = step_ids([sampler(1, 0)])
    ranks = step_ids([sampler(2, r) for r in range(2)])
    # dp=1 micro steps 0..3 are dp=2 (k=0,r=0), (k=0,r=1), (k=1,r=0), (k=1,r=1)
    assert single == [ranks[0][0], ranks[1][0], ranks[0][1], ranks[1][1]]


def test_state_is_the_global_position_and_resumes() -> None:
    s = sampler(2, 1)
    for _ in range(5):
        s.advance()
    state = s.state_dict()
    assert state["position"] == 5 * 32
    other = sampler(2, 1)
    other.load_state_dict(state)
    assert other.step_sample_ids() == s.step_sample_ids()
    # the same state restores onto a different layout (elastic resume later builds on this)
    elastic = sampler(1, 0)
    elastic.load_state_dict(state)
    assert elastic.position == 160


def test_state_from_another_dataset_or_seed_is_refused() -> None:
    state = sampler(2, 0).state_dict()
    with pytest.raises(DataError, match="different dataset"):
        sampler(2, 0, n=999).load_state_dict(state)
    with pytest.raises(DataError):
        sampler(2, 0, seed=4).load_state_dict(state)


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(DataError):
        sampler(3, 0, micro=8)
    with pytest.raises(DataError):
        sampler(2, 2)


class FakeDataset:
    def windows(self, ids: list[int]) -> np.ndarray:
        return np.stack([np.arange(i, i + 5) for i in ids]).astype(np.int64)


def test_loader_yields_shifted_targets_and_advances() -> None:
    s = sampler(2, 0, global_batch=8, micro=2)
    loader = BatchLoader(FakeDataset(), s, torch.device("cpu"))
    batches = loader.next_step()
    assert len(batches) == 2 and s.position == 8
    inputs, targets = batches[0]
    assert inputs.shape == targets.shape == (2, 4)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_batch_layout_states_what_it_runs() -> None:
    from trainyard.sampler import batch_layout

    same = batch_layout(global_batch=16, micro_batch=4, dp=2, spec_dp=2, sequence_length=32)
    assert same.grad_accumulation == 2 and same.tokens_per_step == 512
    assert same.statement() == ("micro batch 4 x data-parallel 2 x gradient accumulation 2 = global batch 16 "
                                "sequences (512 tokens per optimizer step)")
    fewer = batch_layout(global_batch=16, micro_batch=4, dp=1, spec_dp=2, sequence_length=32)
    assert fewer.grad_accumulation == 4
    assert "the spec asked for parallelism.data 2 (accumulation 2): this attempt runs data-parallel 1 with " \
           "accumulation 4" in fewer.statement()


def test_batch_layout_refuses_with_the_numbers() -> None:
    from trainyard_contract.errors import ConfigError
    from trainyard.sampler import batch_layout

    with pytest.raises(ConfigError, match="globalBatchSize 16 is not a multiple of microBatchSize 4 x "
                                          "data-parallel size 3 = 12"):
        batch_layout(global_batch=16, micro_batch=4, dp=3, spec_dp=2, sequence_length=8)


def test_micro_batches_and_their_seeds_do_not_depend_on_the_number_of_ranks() -> None:
    """A micro batch holds the same rows whatever dp is, so its dropout seed can be the data's."""
    from trainyard.sampler import micro_batch_seed

    def micro_batches(dp: int) -> dict[int, list[int]]:
        out = {}
        for rank in range(dp):
            s = sampler(dp, rank, micro=4)
            for k, ids in enumerate(s.step_sample_ids()):
                out[sample_position(s.position, k, rank, 0, micro_batch=4, dp=dp)] = ids
        return out

    assert micro_batches(1) == micro_batches(2) == micro_batches(4)
    assert len({micro_batch_seed(7, p) for p in micro_batches(1)}) == 8
    assert micro_batch_seed(7, 4) != micro_batch_seed(8, 4)


class _Windows:
    def windows(self, ids):
        return np.array([[i] * 5 for i in ids], dtype=np.int64)


def test_loader_reports_the_positions_it_read() -> None:
    s = sampler(2, 1, micro=4)
    loader = BatchLoader(_Windows(), s, torch.device("cpu"))
    batches = loader.next_step()
    assert loader.last_start == 0 and loader.last_positions == [4, 12, 20, 28]  # (k*2 + 1)*4
    assert len(batches) == 4 and s.position == 32
    loader.next_step()
    assert loader.last_start == 32 and loader.last_positions[0] == 36
