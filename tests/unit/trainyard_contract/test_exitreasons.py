"""ExitReason: each reason declared once, the wire strings unchanged, and the sets every party used to keep."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from trainyard_contract import exitcodes
from trainyard_contract.exitreasons import REASONS, ExitReason, exit_reason, reasons_table

R = ExitReason
ROOT = Path(__file__).resolve().parents[3]

# What the scheduler, health, the coordinator and the agent each kept as its own set before the type.
RETRYABLE_BEFORE = {"error", "killed", "lost", "oom", "hang", "nccl", "preempted", "revoked", "start-timeout",
                    "checkpoint-missing", "signal"}
NODE_WEIGHTS_BEFORE = {"lost": 1.0, "hang": 1.0, "nccl": 1.0, "signal": 1.0, "oom": 0.5, "killed": 0.5,
                       "start-timeout": 0.5}
STOP_REASONS_BEFORE = {"preempted", "revoked", "killed", "lost"}
NOT_MTBF_BEFORE = {"ok", "revoked", "preempted", "config", "data", "nan"}
FROM_EXIT_CODE_BEFORE = {"nan", "oom", "config", "checkpoint", "data"}
# Reasons that go on the wire (WorkerExited.reason, failureReason prefixes): their strings never change.
WIRE = ["ok", "error", "config", "nan", "checkpoint", "data", "oom", "preempted", "killed", "signal", "nccl", "hang",
        "lost", "revoked", "security", "port-in-use", "start-timeout", "checkpoint-missing", "maintenance",
        "control-plane"]


def test_every_reason_is_declared_once_with_its_wire_string() -> None:
    assert set(REASONS) == set(ExitReason)
    assert [r.value for r in ExitReason if r is not R.UNKNOWN] == WIRE
    assert R.OOM == "oom" and f"{R.PORT_IN_USE}" == "port-in-use" and exitcodes.PORT_IN_USE == "port-in-use"


@pytest.mark.parametrize("reason", [r for r in ExitReason if r not in (R.NAN, R.PORT_IN_USE, R.MAINTENANCE,
                                                                      R.CONTROL_PLANE)])
def test_retryable_as_the_scheduler_had_it(reason: ExitReason) -> None:
    # nan (once per step) and the interruptions never reached the retryable set: the scheduler decides them apart
    assert reason.retryable is (reason.value in RETRYABLE_BEFORE)


@pytest.mark.parametrize("reason", list(ExitReason))
def test_node_blame_mtbf_and_stops_as_before(reason: ExitReason) -> None:
    assert reason.blame_weight == NODE_WEIGHTS_BEFORE.get(reason.value, 0.0)
    assert reason.blames_node is (reason.value in NODE_WEIGHTS_BEFORE)
    assert reason.tenant_bounded is (reason is not R.LOST)
    assert reason.stops_on_purpose is (reason.value in STOP_REASONS_BEFORE)
    assert reason.from_exit_code is (reason.value in FROM_EXIT_CODE_BEFORE)
    if reason not in (R.MAINTENANCE, R.CONTROL_PLANE):  # the coordinator never saw the scheduler's interruptions
        assert reason.counts_for_mtbf is (reason.value not in NOT_MTBF_BEFORE)


def test_interruptions_spend_no_budget_and_blame_nobody() -> None:
    interruptions = {r for r in ExitReason if r.interruption}
    assert interruptions == {R.PREEMPTED, R.PORT_IN_USE, R.MAINTENANCE, R.CONTROL_PLANE}
    assert not any(r.blames_node for r in interruptions)


@pytest.mark.parametrize(("text", "reason"), [
    ("oom", R.OOM), ("port-in-use", R.PORT_IN_USE), ("signal-11", R.SIGNAL), ("signal-6", R.SIGNAL),
    ("signal", R.SIGNAL), ("ok", R.OK),
    # no reason at all: unknown (the scheduler records a non-zero exit without one as an error)
    ("", R.UNKNOWN), (None, R.UNKNOWN),
    # unknown strings (a retired reason, a newer producer's): parsed, never retried, nobody blamed
    ("gpu-fell-off-the-bus", R.UNKNOWN), ("OOM", R.UNKNOWN), ("unknown", R.UNKNOWN),
])
def test_parse(text: str | None, reason: ExitReason) -> None:
    assert ExitReason.parse(text) is reason


def test_unknown_reasons_fail_the_job_as_given() -> None:
    unknown = ExitReason.parse("gpu-fell-off-the-bus")
    assert not unknown.retryable and not unknown.interruption and not unknown.blames_node
    assert unknown.counts_for_mtbf  # an unexplained failure, as the coordinator always counted it


def test_exit_codes_agree_with_the_reasons() -> None:
    for name in ("OK", "ERROR", "CONFIG", "NAN", "CHECKPOINT", "DATA", "OOM", "PREEMPTED"):
        assert ExitReason[name].exit_code == getattr(exitcodes, name)
        assert exit_reason(getattr(exitcodes, name)) is ExitReason[name]
    assert exit_reason(77) == "error"
    assert exit_reason(-signal.SIGKILL) == exit_reason(-signal.SIGTERM) == "killed"
    assert exit_reason(-signal.SIGSEGV) == "signal-11"


def test_failures_md_shows_the_generated_table() -> None:
    text = (ROOT / "docs" / "failures.md").read_text()
    assert reasons_table() in text, "regenerate: python -c 'from trainyard_contract.exitreasons import " \
                                    "reasons_table; print(reasons_table())'"
