"""One optimizer step in a one-rank world: accumulation, reporting, and NaN handling."""

from pathlib import Path

import pytest
import torch

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.spec import LrSchedule, TrainingSpec
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import CollectiveTimer, apply_ddp
from trainyard.runtime import Runtime
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard_trainer.training import NonFiniteError, build_optimizer, train_step

CPU = Runtime(torch.device("cpu"), "gloo", None)
CONFIG = ModelConfig(vocab_size=30, n_layers=1, n_heads=2, d_model=8, max_seq_len=8)


def spec(optimizer: str = "adamw") -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "d@v1", "codeRevision": "x",
        "resources": {"gpuType": "cpu", "gpuCount": 1},
        "training": {"sequenceLength": 7, "microBatchSize": 2, "globalBatchSize": 4, "learningRate": 0.01,
                     "maxSteps": 3, "optimizer": {"name": optimizer, "weightDecay": 0.1}},
    })


def setup(optimizer: str = "adamw"):
    timer = CollectiveTimer()
    model = apply_ddp(build_model(CONFIG, seed=0, device=CPU.device), device=CPU.device, timer=timer)
    opt = build_optimizer(model.module, spec(optimizer))
    sched = build_lr_scheduler(opt, schedule=LrSchedule(warmup_steps=0), max_steps=3)
    return model, opt, sched, timer


def batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        w = torch.randint(0, 30, (2, 8), generator=g)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def test_weight_decay_only_on_matrices(world_of_one: None) -> None:
    model, opt, _, _ = setup()
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    _, sgd, _, _ = setup("sgd")
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9


def test_step_reports_the_mean_loss_and_updates(world_of_one: None) -> None:
    model, opt, sched, timer = setup()
    data = batches()
    with torch.no_grad():
        expected = sum(model(x, y)[1] for x, y in data).item() / 2
    before = model.module.wte.weight.detach().clone()
    outcome = train_step(model, opt, sched, data, runtime=CPU, timer=timer, grad_clip=1.0, world_size=1)
    assert outcome.loss == pytest.approx(expected, rel=1e-6)
    assert outcome.lr == 0.01 and outcome.grad_norm > 0
    assert outcome.times.compute > 0 and outcome.times.collective >= 0
    assert not torch.equal(before, model.module.wte.weight)


def test_accumulated_gradient_equals_the_full_batch_gradient(world_of_one: None) -> None:
    model, opt, sched, timer = setup()
    data = batches()
    full_x = torch.cat([x for x, _ in data])
    full_y = torch.cat([y for _, y in data])
    reference = build_model(CONFIG, seed=0, device=CPU.device)
    reference(full_x, full_y)[1].backward()
    applied: dict[str, torch.Tensor] = {}  # the gradients the optimizer step sees
    opt.register_step_pre_hook(lambda *_: applied.update(
        {n: p.grad.clone() for n, p in model.module.named_parameters()}))
    train_step(model, opt, sched, data, runtime=CPU, timer=timer, grad_clip=None, world_size=1)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(applied[name], q.grad, msg=name)


def test_non_finite_loss_stops_before_the_update(world_of_one: None) -> None:
    model, opt, sched, timer = setup()
    with torch.no_grad():
        model.module.ln_f.weight[0] = float("nan")
    snapshot = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(NonFiniteError, match="not finite"):
        train_step(model, opt, sched, batches(), runtime=CPU, timer=timer, grad_clip=1.0, world_size=1)
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, snapshot[k]) or torch.isnan(v).any(), k
    assert sched.last_epoch == 0 and not opt.state


def test_time_based_checkpoints_are_agreed_one_boundary_late(world_of_one: None, tmp_path: Path) -> None:
    from trainyard.checkpoint import Checkpointer, CheckpointSchedule
    from trainyard.preemption import CheckpointRequest
    from trainyard_trainer.training import BoundaryAgreement, Context

    ctx = Context(rank=0, world_size=1)
    checkpointer = Checkpointer(rank=0, mode="sync", barrier=lambda: None, agree=ctx.agree)
    request = CheckpointRequest(tmp_path / "none.json", allocation_id="a", epoch=1)
    agreement = BoundaryAgreement(ctx)
    never = CheckpointSchedule(max_steps=10, every_minutes=1e6, last_save_at=float("inf"))
    assert agreement.collect().due is False  # nothing was sent before the first boundary
    agreement.send(never, checkpointer, request)
    assert agreement.collect().due is False
    assert never.due_by_step(10) and not never.due_by_step(3)  # maxSteps always saves, decided at once
    overdue = CheckpointSchedule(max_steps=10, every_minutes=0.001, last_save_at=0.0)
    agreement.send(overdue, checkpointer, request)
    boundary = agreement.collect()
    assert boundary.due is True and boundary.requested is False and boundary.done_save == 0
    assert agreement.collect().due is False  # an answer is used once


def test_dropout_follows_the_micro_batch_seeds_not_the_rank_stream(world_of_one: None) -> None:
    config = ModelConfig(vocab_size=30, n_layers=1, n_heads=2, d_model=8, max_seq_len=8, dropout=0.3)

    def one_step(seeds: list[int], noise: int) -> float:
        timer = CollectiveTimer()
        model = apply_ddp(build_model(config, seed=0, device=CPU.device), device=CPU.device, timer=timer)
        opt = build_optimizer(model.module, spec())
        sched = build_lr_scheduler(opt, schedule=LrSchedule(warmup_steps=0), max_steps=3)
        torch.manual_seed(noise)  # whatever the rank's own stream is
        return train_step(model, opt, sched, batches(), runtime=CPU, timer=timer, grad_clip=1.0, seeds=seeds).loss

    assert one_step([11, 12], noise=1) == one_step([11, 12], noise=2)
    assert one_step([11, 12], noise=1) != one_step([11, 13], noise=1)
