"""The chaos suite: the local stack running real training jobs while ranks, node agents, every service,
the broker and Redis are killed (kill -9) and ranks are frozen (SIGSTOP) at random moments; then the
invariants of docs/design.md §6 (tests/chaos/invariants.py) are checked over the whole history.

* short run (``make test``): one fault of each kind, a couple of minutes;
* long run (``make chaos``, TRAINYARD_LONG_TESTS=1): many faults in random order; its counts are
  printed (kills of each kind, invariant checks, violations) and written to chaos-report.json in
  the run's temporary directory (or $TRAINYARD_CHAOS_REPORT).

A run with a violation keeps its evidence (the stack's logs and Redis data, the Redis state of the
jobs named, their rank logs and spools, the fault timeline) under $TRAINYARD_CHAOS_EVIDENCE, by
default ``.trainyard/chaos-evidence/<test>-<seed>-<time>/``, and prints the path.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from tests.chaos.harness import SERVICES, ChaosRig
from tests.chaos.scenario import ASSEMBLY_KINDS, run_chaos

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
SEED = int(os.environ.get("TRAINYARD_CHAOS_SEED", "0")) or int(time.time())
EXTRA_FAULTS = int(os.environ.get("TRAINYARD_CHAOS_FAULTS", "10"))


def _evidence_dir(name: str) -> Path:
    default = Path(__file__).resolve().parents[2] / ".trainyard" / "chaos-evidence"
    base = os.environ.get("TRAINYARD_CHAOS_EVIDENCE") or default
    return Path(base) / f"{name}-{SEED}-{time.strftime('%Y%m%dT%H%M%S')}"


def _report(report, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001 - report: the harness's
    path = Path(os.environ.get("TRAINYARD_CHAOS_REPORT") or tmp_path / "chaos-report.json")
    report.write(path)
    with capsys.disabled():
        print(f"\n[seed {SEED}] {report.summary()}\n  report: {path}")


def test_short_chaos_run_keeps_every_invariant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One of each: a rank killed, a rank frozen past the hang timeout, a node agent and every service
    killed in one wave, Redis killed, the broker killed and the coordinator killed — these two while
    a checkpoint is being assembled (between its first ShardWritten and READY)."""
    plan = ["rank", "hang", "services", "redis", "broker", "service:checkpoint-coordinator"]
    with ChaosRig.running(tmp_path / ".trainyard", seed=SEED, say=lambda m: None) as rig:
        report = run_chaos(rig, plan, max_steps=100, every=10, tmp=tmp_path, require_assembly=ASSEMBLY_KINDS,
                           evidence_dir=_evidence_dir("short"))
    _report(report, tmp_path, capsys)
    assert {"rank", "hang", "agent", "redis", "broker"} <= set(report.faults), report.summary()
    assert {f"service:{s}" for s in SERVICES} <= set(report.faults), report.summary()
    assert set(ASSEMBLY_KINDS) <= set(report.assembly_faults), report.summary()
    assert report.violation_count == 0, report.summary()


@pytest.mark.long
@pytest.mark.timeout(900 + 30 * EXTRA_FAULTS)  # a soak of 200 faults runs for an hour or two
def test_long_chaos_run_keeps_every_invariant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Many faults of every kind in random order, spread over several jobs."""
    rng = random.Random(SEED)
    kinds = ["rank", "hang", "agent", "redis", "broker", *(f"service:{s}" for s in SERVICES), "services"]
    plan = [k for k in kinds for _ in range(2)] + [rng.choice(kinds) for _ in range(EXTRA_FAULTS)]
    rng.shuffle(plan)
    with ChaosRig.running(tmp_path / ".trainyard", seed=SEED, say=lambda m: None) as rig:
        report = run_chaos(rig, plan, max_steps=150, every=10, tmp=tmp_path, terminal_timeout_s=600,
                           evidence_dir=_evidence_dir("long"))
    _report(report, tmp_path, capsys)
    assert report.violation_count == 0, report.summary()
