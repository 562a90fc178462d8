"""`trainyard dev down` (make down): drain first — node agents, then (once the scheduler recorded every
drained attempt) the services, then Redis and the broker — and say so. The processes are stubbed."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_cli.stack import Component, LocalStack, StackSettings

NAMES = ("api", "broker", "checkpoint-coordinator", "node-agent-0", "node-agent-1", "redis", "registry", "scheduler")


class Alive(Component):
    @property
    def alive(self) -> bool:
        return True


def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, live: list[list[str]], drain: float = 120.0
          ) -> tuple[LocalStack, list[tuple[str, object]]]:
    said: list[str] = []
    calls: list[tuple[str, object]] = []
    s = LocalStack(StackSettings(state_dir=tmp_path, drain_timeout_s=drain), say=said.append)
    monkeypatch.setattr(s, "components", lambda: [Alive(n, 1000 + i, tmp_path / f"{n}.log")
                                                  for i, n in enumerate(NAMES)])

    def stop(group: list[Component], timeout_s: float) -> list[str]:
        calls.append(("stop", (sorted(c.name for c in group), timeout_s)))
        return [c.name for c in group]

    answers = iter(live)
    monkeypatch.setattr(s, "_stop", stop)
    monkeypatch.setattr(s, "_live_attempts", lambda: next(answers))
    monkeypatch.setattr(s, "_wait_recorded", lambda timeout_s: calls.append(("wait", timeout_s)) or next(answers))
    calls.append(("said", said))
    return s, calls


def test_down_drains_the_agents_first_then_stops_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s, calls = stack(tmp_path, monkeypatch, live=[["job-1", "job-2"], []])
    stopped = s.down(timeout_s=20)
    said = calls.pop(0)[1]
    assert [c[0] for c in calls] == ["stop", "wait", "stop", "stop"]
    assert calls[0][1] == (["node-agent-0", "node-agent-1"], 140.0)  # the drain, plus room to report
    assert calls[2][1][0] == ["api", "checkpoint-coordinator", "registry", "scheduler"]  # type: ignore[index]  # each call is a tuple
    assert calls[3][1][0] == ["broker", "redis"]  # type: ignore[index]  # each call is a tuple
    assert set(stopped) == set(NAMES)
    assert said == ["draining: 2 running attempt(s) checkpoint and stop (waiting up to 120s); they resume from "
                    "that checkpoint after `make up`",
                    "2 attempt(s) interrupted by maintenance (no failure)"]


def test_down_without_running_jobs_or_with_the_drain_off_waits_for_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s, calls = stack(tmp_path, monkeypatch, live=[[]])
    s.down(timeout_s=20)
    assert [c[0] for c in calls[1:]] == ["stop", "stop", "stop"] and calls[1][1][1] == 20  # type: ignore[index]  # each call is a tuple
    off, calls = stack(tmp_path, monkeypatch, live=[], drain=0)
    off.down(timeout_s=20)
    assert [c[0] for c in calls[1:]] == ["stop", "stop", "stop"] and calls[0][1] == []


def test_down_says_which_attempts_the_scheduler_did_not_record_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s, calls = stack(tmp_path, monkeypatch, live=[["job-1"], ["job-1"]])
    s.down(timeout_s=20)
    said = calls[0][1]
    assert said[-1].startswith("0 attempt(s) interrupted by maintenance (no failure); job-1 not recorded in time")  # type: ignore[index]  # each call is a tuple
