"""follow_job: polls until the job ends and turns the end into an exit code."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from trainyard_cli.client import ApiUnreachableError, Job
from trainyard_cli.follow import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_SUCCEEDED,
    EXIT_TIMEOUT,
    follow_job,
    outcome,
    progress_fields,
)


ATTEMPT = {"attempt": 1, "allocationId": "alloc-1", "epoch": 1, "state": "running", "nodes": ["n0"], "worldSize": 2,
           "startCheckpoint": None, "startedAt": "2024-05-01T12:00:00Z", "endedAt": None, "failureReason": None,
           "placementScore": None}


def job(state: str, step: int = 0, **extra: Any) -> Job:
    return Job.model_validate({
        "jobId": "job-1", "state": state, "specHash": "sha256:x",
        "attempts": [ATTEMPT] if state != "queued" else [],
        "progress": {"globalStep": step, "maxSteps": 40, "consumedTokens": step * 2048, "lastLoss": 2.0,
                     "tokensPerSecond": 1234.5},
        **extra,
    })


class ScriptedClient:
    """Answers get_job from a script (each item a Job or an exception to raise)."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)

    def get_job(self, job_id: str) -> Job:
        item = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(item, Exception):
            raise item
        return item


def run(client: ScriptedClient, **kwargs: Any) -> tuple[int, str]:
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, force_terminal=False)
    clock = iter(range(10_000))
    code = follow_job(client, "job-1", console=console, sleep=lambda s: None,  # type: ignore[arg-type]  # a test double
                      clock=lambda: float(next(clock)), **kwargs)
    return code, buffer.getvalue()


def test_follows_to_success_printing_each_state_change() -> None:
    code, text = run(ScriptedClient(
        job("queued", queuedReason="needs 2 devices"), job("running", 10), job("running", 20),
        job("succeeded", 40, checkpoints=[{"checkpointId": "c", "state": "READY", "globalStep": 40, "attempt": 1,
                                          "worldSize": 2, "manifestUri": "file:///m.json", "contentHash": None,
                                          "consumedTokens": 81920, "reason": None,
                                          "createdAt": "2024-05-01T12:01:00Z", "readyAt": None}]),
    ))
    assert code == EXIT_SUCCEEDED
    assert "waiting: needs 2 devices" in text and "running (attempt 1)" in text
    assert "succeeded at step 40" in text and "file:///m.json" in text


def test_failure_and_cancellation_exit_non_zero_with_the_reason() -> None:
    code, text = run(ScriptedClient(job("failed", 12, reason="rank 1 exited 3 (nan)")))
    assert code == EXIT_FAILED and "rank 1 exited 3 (nan)" in text
    code, text = run(ScriptedClient(job("cancelled", 5, reason="cancel requested by alice")))
    assert code == EXIT_CANCELLED and "cancel requested by alice" in text


def test_a_brief_outage_is_ridden_out_and_a_timeout_stops_following() -> None:
    down = ApiUnreachableError("down")
    code, _ = run(ScriptedClient(job("running", 1), down, down, job("succeeded", 40)))
    assert code == EXIT_SUCCEEDED
    code, text = run(ScriptedClient(job("running", 1)), timeout_s=5)
    assert code == EXIT_TIMEOUT and "still running" in text


def test_progress_fields_and_outcome() -> None:
    fields = progress_fields(job("running", 20))
    assert fields["completed"] == 20 and fields["total"] == 40 and fields["step"] == "20/40"
    assert fields["tokens"] == "41.0k" and fields["attempt"] == "1"
    assert outcome(job("running", 20)) is None
