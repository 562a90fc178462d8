"""Checkpoint on request, then stop: the step-boundary agreement and decision (pure), the request
(signal and file), the exit code and note, the auto checkpoint interval, refused checkpoints."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainyard_contract import exitcodes
from trainyard_contract.events import CheckpointRefused, GangAllocated
from trainyard_contract.spec import TrainingSpec
from trainyard.checkpoint import Refusal
from trainyard.exits import RankEnd, exit_code_for
from trainyard.preemption import (
    StepPlan,
    StoppedOnRequest,
    Boundary,
    agreed,
    boundary_flags,
    plan_boundary,
    request_matches,
    CheckpointRequest,
)
from trainyard_trainer.training import checkpoint_policy, report_refusals


def all_reduce_max(*ranks: list[int]) -> list[int]:
    return [max(column) for column in zip(*ranks, strict=True)]


# ----------------------------------------------------------------------------- the agreement


def test_one_ranks_request_is_every_ranks_request() -> None:
    asked = boundary_flags(due=False, requested=True, pending_save=0, done=False, failed=False)
    quiet = boundary_flags(due=False, requested=False, pending_save=0, done=False, failed=False)
    b = agreed(all_reduce_max(quiet, asked, quiet))
    assert b.requested and not b.due and b.done_save == 0 and b.failed_save == 0


def test_a_pending_save_is_done_only_when_done_everywhere_and_failed_when_failed_anywhere() -> None:
    done = boundary_flags(due=False, requested=False, pending_save=3, done=True, failed=False)
    busy = boundary_flags(due=False, requested=False, pending_save=3, done=False, failed=False)
    broken = boundary_flags(due=False, requested=False, pending_save=3, done=True, failed=True)
    assert agreed(all_reduce_max(done, done)).completes(3)
    assert not agreed(all_reduce_max(done, busy)).completes(3)
    assert not agreed(all_reduce_max(done, busy, broken)).completes(3)  # failed here, still writing there
    b = agreed(all_reduce_max(done, broken))
    assert b.completes(3) and b.failed(3)


def test_a_late_answer_completes_only_the_save_it_was_sent_about() -> None:
    b = agreed(all_reduce_max(boundary_flags(due=False, requested=False, pending_save=3, done=True, failed=True),
                              boundary_flags(due=False, requested=False, pending_save=3, done=True, failed=False)))
    assert b.completes(3) and b.failed(3)
    assert not b.completes(4) and not b.failed(4)  # a newer save started since: not its answer
    assert not b.completes(0)


def test_no_pending_save_reports_nothing_about_it() -> None:
    flags = boundary_flags(due=True, requested=False, pending_save=0, done=True, failed=True)
    assert flags == [1, 0, 0, 0]
    assert agreed(flags) == Boundary(due=True, requested=False, done_save=0, failed_save=0)


@pytest.mark.parametrize(("step", "due", "requested", "last_saved", "expected"), [
    (3, False, False, None, StepPlan(save=False, stop=False)),
    (4, True, False, 2, StepPlan(save=True, stop=False)),  # the schedule
    (5, False, True, 4, StepPlan(save=True, stop=True)),  # asked: save this step, then stop
    (4, True, True, 2, StepPlan(save=True, stop=True)),  # due and asked: one save
    (4, False, True, 4, StepPlan(save=False, stop=True)),  # this step is saved already: stop at once
    (10, True, True, 8, StepPlan(save=True, stop=False)),  # maxSteps: the run ends anyway, and saves
    (10, True, False, 10, StepPlan(save=False, stop=False)),
])
def test_plan_boundary(step: int, due: bool, requested: bool, last_saved: int | None, expected: StepPlan) -> None:
    assert plan_boundary(step=step, max_steps=10, due=due, requested=requested, last_saved_step=last_saved) == expected


# ----------------------------------------------------------------------------- the request on one rank


@pytest.mark.parametrize(("payload", "why"), [
    ({"allocationId": "a1", "epoch": 3}, None),
    ({"allocationId": "a1", "epoch": 4}, None),  # newer: still this allocation
    ({"allocationId": "a1", "epoch": 2}, "older"),
    ({"allocationId": "a0", "epoch": 3}, "allocation 'a0'"),
    ({"allocationId": "a1", "epoch": "x"}, "not a number"),
])
def test_request_matches(payload: dict[str, Any], why: str | None) -> None:
    found = request_matches(payload, allocation_id="a1", epoch=3)
    assert found is None if why is None else why in (found or "")


def test_the_signal_only_sets_a_flag(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    with CheckpointRequest(tmp_path / "r.json", allocation_id="a1", epoch=1) as request:
        assert not request.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.signalled and request.requested()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_the_request_file_counts_when_it_is_for_this_allocation(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint-request.json"
    request = CheckpointRequest(path, allocation_id="a1", epoch=3)
    assert not request.requested()
    path.write_text(json.dumps({"allocationId": "a1", "epoch": 2, "reason": "stale"}))
    assert not request.requested()
    path.write_text("{not json")
    os.utime(path, ns=(1, 1))  # a new mtime: the file is read again
    assert not request.requested()
    path.write_text(json.dumps({"allocationId": "a1", "epoch": 3, "reason": "preempted by job-b"}))
    os.utime(path, ns=(2, 2))
    assert request.requested() and not request.signalled
    path.unlink()
    assert request.requested(), "once asked, a rank stays asked"


# ----------------------------------------------------------------------------- exit code and note


def test_stopped_on_request_exits_preempted() -> None:
    code = exit_code_for(StoppedOnRequest(5, saved=True))
    assert code == exitcodes.PREEMPTED == 7 and exitcodes.exit_reason(code) == "preempted"


def test_the_exit_note_names_the_step(tmp_path: Path) -> None:
    path = tmp_path / "exit" / "rank-0.note.json"
    RankEnd(global_step=4).write(path, code=exitcodes.NAN, error="NonFiniteError: loss nan")
    assert json.loads(path.read_text()) == {"exitCode": 3, "reason": "nan", "globalStep": 4,
                                            "error": "NonFiniteError: loss nan"}


# ----------------------------------------------------------------------------- auto interval, refusals


def _spec(policy: dict[str, Any]) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "d@v1", "codeRevision": "t",
        "resources": {"gpuType": "cpu", "gpuCount": 1}, "checkpointPolicy": policy,
        "training": {"sequenceLength": 32, "microBatchSize": 1, "globalBatchSize": 1, "maxSteps": 10,
                     "learningRate": 1e-3},
    })


@pytest.mark.parametrize(("policy", "advised", "expected"), [
    ({"everySteps": 5}, None, (5, None, "spec")),
    ({"everyMinutes": 30}, None, (None, 30, "spec")),
    ({"auto": True, "everyMinutes": 30}, 7, (7, None, "auto")),
    ({"auto": True}, 12, (12, None, "auto")),
    ({"auto": True, "everySteps": 5}, None, (5, None, "spec")),  # no advice yet: the starting interval
])
def test_the_allocations_interval_overrides_the_spec(policy: dict[str, Any], advised: int | None,
                                                      expected: tuple[Any, ...]) -> None:
    job = SimpleNamespace(spec=_spec(policy), allocation=SimpleNamespace(checkpoint_every_steps=advised))
    record = checkpoint_policy(job)  # type: ignore[arg-type]  # a stand-in job
    assert (record.every_steps, record.every_minutes) == expected[:2] and record.source.startswith(expected[2])


def test_allocation_carries_the_advice() -> None:
    assert "checkpoint_every_steps" in GangAllocated.model_fields


class ListSpool:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def write(self, event: Any, *, traceparent: str | None = None) -> None:
        self.events.append(event)


def test_every_refused_checkpoint_with_a_step_is_spooled() -> None:
    settings = SimpleNamespace(job_id="j", tenant="t", attempt=3)
    spool = ListSpool()
    refused = [Refusal("file:///c/4/manifest.json", 4, ["shard 1 sha256 differs"], attempt=2),
               Refusal("file:///c/x/manifest.json", None, ["malformed"]),
               Refusal("file:///c/2/manifest.json", 2, ["shard 0 missing"], attempt=1)]
    assert report_refusals(SimpleNamespace(settings=settings), spool, refused) == 2  # type: ignore[arg-type]  # a test double
    assert all(isinstance(e, CheckpointRefused) for e in spool.events)
    assert [(e.global_step, e.checkpoint_attempt, e.attempt, e.problems) for e in spool.events] == [
        (4, 2, 3, ["shard 1 sha256 differs"]), (2, 1, 3, ["shard 0 missing"])]
