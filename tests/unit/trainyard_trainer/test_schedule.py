import math

import pytest
import torch

from trainyard_contract.spec import LrSchedule
from trainyard_trainer.schedule import build_lr_scheduler, lr_multiplier


def mult(step: int, name: str = "cosine", warmup: int = 5, floor: float = 0.1, max_steps: int = 40) -> float:
    return lr_multiplier(step, schedule=LrSchedule(name=name, warmup_steps=warmup, min_lr_ratio=floor),
                         max_steps=max_steps)


@pytest.mark.parametrize("name", ["cosine", "linear", "constant"])
def test_warmup_is_linear_and_starts_above_zero(name: str) -> None:
    assert [mult(s, name) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


@pytest.mark.parametrize(("name", "step", "expected"), [
    ("cosine", 5, 1.0), ("cosine", 40, 0.1), ("cosine", 22.5, 0.55), ("cosine", 100, 0.1),
    ("linear", 5, 1.0), ("linear", 40, 0.1), ("linear", 22.5, 0.55), ("linear", 30, 1 - 0.9 * 25 / 35),
    ("constant", 5, 1.0), ("constant", 39, 1.0),
])
def test_decay(name: str, step: float, expected: float) -> None:
    assert mult(step, name) == pytest.approx(expected)  # type: ignore[arg-type]  # a str for a Literal name


def test_cosine_is_monotone_after_warmup_and_respects_the_floor() -> None:
    values = [mult(s, floor=0.25) for s in range(5, 41)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert min(values) == pytest.approx(0.25)


def test_no_warmup() -> None:
    assert mult(0, warmup=0) == 1.0
    assert mult(20, warmup=0, floor=0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_lambda_lr_follows_the_rule_and_resumes_from_its_state() -> None:
    schedule = LrSchedule(name="cosine", warmup_steps=3, min_lr_ratio=0.1)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_lr_scheduler(opt, schedule=schedule, max_steps=10)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * lr_multiplier(s, schedule=schedule, max_steps=10) for s in range(6)])

    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    opt2.load_state_dict(opt.state_dict())
    sched2 = build_lr_scheduler(opt2, schedule=schedule, max_steps=10)
    sched2.load_state_dict(sched.state_dict())
    for _ in range(3):
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
