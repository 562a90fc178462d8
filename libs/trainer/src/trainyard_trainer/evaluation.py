"""The built-in evaluator: held-out loss and perplexity of the checkpoint an evaluation job loaded.

An evaluation job (``spec.evaluation``) starts from the checkpoint its ``initFrom`` names (``run.restore``, weights
only) and trains nothing: it averages the loss over ``evaluation.batches`` held-out batches and reports it with
``run.report_evaluation`` (``loss``, ``perplexity`` = exp(loss)). The held-out batches are the dataset's *last*
``batches x microBatchSize x data`` samples, in order: the same batches for every checkpoint of every evaluation,
whatever the spec's seed, so the points of one job's curve compare. They are held out only in that the evaluation
reads them in a fixed order; a training run over the whole dataset may have seen them (give the trained job a
dataset that leaves them out to be strict).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainyard_contract.errors import ConfigError, DataError

__all__ = ["evaluate", "held_out_samples"]

MAX_LOSS_FOR_PERPLEXITY = 80.0  # exp(80) ~ 5.5e34: a finite float, as the event requires


def held_out_samples(num_samples: int, *, batches: int, rows: int) -> list[list[int]]:
    """The samples of each held-out batch of ``rows`` rows: the last ``batches x rows`` of the dataset, in order
    (fewer batches when the dataset is smaller; DataError when it holds not even one)."""
    count = min(batches, num_samples // rows)
    if count < 1:
        raise DataError(f"the dataset has {num_samples} samples, fewer than one evaluation batch of {rows}")
    start = num_samples - count * rows
    return [list(range(start + b * rows, start + (b + 1) * rows)) for b in range(count)]


def evaluate(pm: Any, dataset: Any, batches: list[list[int]], *, dp_rank: int, micro_batch: int,
             runtime: Any) -> dict[str, float]:
    """The mean loss of the model over ``batches`` (each rank its data-parallel share of every batch, the loss
    reduced over the ranks as a training step's is) and its perplexity. A collective: every rank calls it."""
    if pm.pipeline is not None:
        raise ConfigError("the built-in evaluator runs without pipeline stages: submit the evaluation with "
                          "parallelism.pipeline 1")
    pm.module.eval()
    total = 0.0
    with torch.no_grad():
        for samples in batches:
            mine = samples[dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
            windows = torch.from_numpy(dataset.windows(mine)).to(runtime.device)
            with runtime.autocast():
                _, loss = pm.module(windows[:, :-1], windows[:, 1:])
            total += float(pm.global_mean_loss(loss).wait().item())
    mean = total / len(batches)
    if not math.isfinite(mean):
        raise DataError(f"the held-out loss of the checkpoint is {mean}")
    return {"loss": mean, "perplexity": math.exp(min(mean, MAX_LOSS_FOR_PERPLEXITY))}
