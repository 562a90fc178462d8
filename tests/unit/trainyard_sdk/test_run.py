"""The SDK's Run in a world of one (local mode: no process group), with real checkpoints on disk."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import trainyard
from trainyard import Run
from trainyard.environment import local_settings
from trainyard_contract import exitcodes
from trainyard_contract.spec import TrainingSpec


def spec(**policy: Any) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "x",
        "code": {"archive": "sha256:" + "0" * 64, "entrypoint": ["python", "train.py"]},
        "resources": {"gpuType": "cpu", "gpuCount": 1},
        "checkpointPolicy": policy or {"everySteps": 2},
        "training": {"sequenceLength": 8, "microBatchSize": 2, "globalBatchSize": 4, "learningRate": 0.01,
                     "maxSteps": 4, "seed": 3},
    })


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    settings = local_settings(spec=spec(), root=tmp_path, environ={})
    settings = settings.model_copy(update={"exit_note_file": tmp_path / "note.json", "checkpoint_mode": "sync"})
    r = Run.open(settings, local=True)
    yield r
    r.close()


def spooled(run: Run, event_type: str) -> list[dict[str, Any]]:
    lines = run.settings.events_file.read_text().splitlines()
    return [p for p in (json.loads(line)["payload"] for line in lines) if p["eventType"] == event_type]


def model_state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": trainyard.ModelState(model), "optim": trainyard.OptimizerState(model, opt)}


def test_a_run_of_one_knows_its_place(run: Run) -> None:
    assert (run.rank, run.world_size, run.backend, run.max_steps) == (0, 1, "gloo", 4)
    assert run.model_config.n_layers > 0 and run.tokens_per_step == 32


def test_checkpoints_follow_the_policy_and_report_shard_written(run: Run) -> None:
    state = model_state()
    assert run.restore(state) == 0
    saved = []
    for step in range(1, 5):
        run.report(step, loss=1.0 / step)
        saved.append(run.checkpoint(step, state))
    assert saved == [False, True, False, True]  # everySteps 2; maxSteps always
    shards = spooled(run, "ShardWritten")
    assert [s["globalStep"] for s in shards] == [2, 4]
    assert [s["consumedTokens"] for s in shards] == [64, 128]
    metrics = spooled(run, "StepMetrics")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and metrics[-1]["consumedTokens"] == 128
    assert metrics[2]["checkpointSeconds"] > 0  # step 2's save lands in the window of the next report
    assert not run.should_stop() and run.finish() == exitcodes.OK


def test_tokens_are_counted_once_whichever_call_comes_first(run: Run) -> None:
    state = model_state()
    run.checkpoint(1, state)
    run.report(1, loss=1.0)
    run.report(2, loss=1.0, tokens=10)
    run.checkpoint(2, state)
    assert (run.progress.global_step, run.progress.consumed_tokens) == (2, 42)


def test_a_request_stops_at_a_saved_step_and_exits_preempted(run: Run, tmp_path: Path) -> None:
    state = model_state()
    run.restore(state)
    run.request.request_file.write_text(json.dumps({"allocationId": run.settings.allocation_id, "epoch": 1}))
    run.report(1, loss=1.0)
    assert run.checkpoint(1, state) is False and not run.should_stop()  # seen here, agreed at the next boundary
    run.report(2, loss=1.0)
    assert run.checkpoint(2, state) is True and run.should_stop()
    assert run.finish() == exitcodes.PREEMPTED
    note = json.loads((tmp_path / "note.json").read_text())
    assert (note["exitCode"], note["reason"], note["globalStep"]) == (7, "preempted", 2)


def test_a_non_finite_loss_names_its_step(run: Run, tmp_path: Path) -> None:
    run.report(1, loss=2.0)
    with pytest.raises(trainyard.NonFiniteError, match="step 2") as caught:
        run.report(2, loss=math.nan)
    assert run.finish(caught.value) == exitcodes.NAN
    assert json.loads((tmp_path / "note.json").read_text())["globalStep"] == 2


@pytest.mark.parametrize(("exc", "code"), [
    (trainyard.ConfigError("x"), exitcodes.CONFIG), (trainyard.DataError("x"), exitcodes.DATA),
    (trainyard.CheckpointError("x"), exitcodes.CHECKPOINT), (torch.OutOfMemoryError("x"), exitcodes.OOM),
    (ValueError("x"), exitcodes.ERROR),
])
def test_errors_map_to_the_platforms_exit_codes(run: Run, exc: BaseException, code: int) -> None:
    assert run.finish(exc) == code


def test_user_metrics_are_kept_per_rank(run: Run) -> None:
    run.report(1, loss=1.0, grad_norm=0.5)
    lines = (run.attempt_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "grad_norm": 0.5}


def test_async_saves_hold_back_only_the_optimizer_step(tmp_path: Path) -> None:
    settings = local_settings(spec=spec(everySteps=1), root=tmp_path, environ={})
    with Run.open(settings, local=True) as r:
        assert r.settings.checkpoint_mode == "async"
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": trainyard.ModelState(model)}
        before = model.weight.detach().clone()
        r.report(1, loss=1.0)
        assert r.checkpoint(1, state)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()  # the pre-hook waits for the background copy first
        assert r.finish() == exitcodes.OK
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(r.layout.checkpoint_dir("local", r.job_id, 1, 1), tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]["weight"]
    assert torch.equal(saved, before) and not torch.equal(before, model.weight)  # the state of step 1, not 2
