"""The built-in evaluator: the same held-out batches for every evaluation, a finite loss and its perplexity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainyard.reporting import evaluation_numbers
from trainyard.runtime import Runtime
from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import DataError
from trainyard_trainer.evaluation import evaluate, held_out_samples
from trainyard_trainer.model import build_model
from trainyard_trainer.training import as_parallel_model

CPU = Runtime(torch.device("cpu"), "gloo", None)
CONFIG = ModelConfig(vocab_size=30, n_layers=1, n_heads=2, d_model=8, max_seq_len=8)


class Windows:
    """A dataset of ``n`` samples of 8 tokens (sample i: tokens i, i+1, …, mod 30)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def windows(self, samples: list[int]) -> np.ndarray:
        return np.array([[(s + k) % 30 for k in range(9)] for s in samples], dtype=np.int64)


def test_the_held_out_batches_are_the_datasets_last_samples_in_order() -> None:
    assert held_out_samples(100, batches=2, rows=4) == [[92, 93, 94, 95], [96, 97, 98, 99]]
    assert held_out_samples(10, batches=8, rows=4) == [[2, 3, 4, 5], [6, 7, 8, 9]]  # as many as there are
    with pytest.raises(DataError):
        held_out_samples(3, batches=1, rows=4)


def test_an_evaluation_is_deterministic_and_reports_loss_and_perplexity() -> None:
    pm = as_parallel_model(build_model(CONFIG, seed=0, device=CPU.device), None, 1, CPU.device)
    batches = held_out_samples(64, batches=3, rows=4)
    first = evaluate(pm, Windows(64), batches, dp_rank=0, micro_batch=4, runtime=CPU)
    again = evaluate(pm, Windows(64), batches, dp_rank=0, micro_batch=4, runtime=CPU)
    assert first == again and set(first) == {"loss", "perplexity"}
    assert math.isfinite(first["loss"]) and first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    assert not any(p.grad is not None for p in pm.module.parameters())  # nothing trained
    assert evaluation_numbers(first) == first  # what the SDK reports


@pytest.mark.parametrize("metrics", [{}, {"loss": float("nan")}, {"bad name": 1.0},
                                     {f"m{i}": 1.0 for i in range(33)}])
def test_the_sdk_refuses_what_the_platform_would(metrics: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        evaluation_numbers(metrics)
