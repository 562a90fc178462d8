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

import contextlib
import os
import random
import signal
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


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_replica_kills_keep_one_quorum_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fault-tolerant job (3 replicas, minReplicas 1) whose replicas are killed -9 at random moments, any of
    them, several times: every step is applied by one quorum, the job ends, its READY checkpoints verify and
    its leases are never double-booked or left held."""
    import json

    import yaml

    from tests.chaos import invariants as inv
    from trainyard_contract.manifest import local_sha256, local_stat_size
    from tests.support.cli import trainyard
    from trainyard_contract.storage import uri_to_path

    rng = random.Random(SEED)
    example = Path(__file__).resolve().parents[2] / "examples" / "fault-tolerant"
    spec = yaml.safe_load((example / "spec.yaml").read_text())
    spec["resources"]["gpuCount"] = spec["parallelism"]["data"] = spec["faultTolerance"]["replicas"] = 3
    spec["training"].update(globalBatchSize=24, maxSteps=2000)
    spec["checkpointPolicy"]["everySteps"] = 100
    spec["code"]["env"] = {"EXAMPLE_STEP_PAUSE_SECONDS": "0.03"}  # steps long enough for newcomers to rejoin
    spec_file = tmp_path / "ft.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    kills = 4 + EXTRA_FAULTS // 5
    with ChaosRig.running(tmp_path / ".trainyard", seed=SEED, say=lambda m: None) as rig:
        done = trainyard(rig.stack, "submit", str(spec_file), "--code", str(example))
        assert done.returncode == 0, done.stdout + done.stderr
        job_id = done.stdout.split()[1]
        rig.jobs.append(job_id)
        killed = 0
        while killed < kills:
            record = rig.job(job_id)
            if record is None or record.state in ("succeeded", "failed", "cancelled"):
                break
            attempt = record.attempts[-1].attempt if record.attempts else 1
            pids = rig.rank_pids(job_id, attempt)
            if record.state == "running" and len(pids) == 3 and rig.progress(job_id)[1] >= 20:
                time.sleep(rng.uniform(0.5, 4.0))
                pids = rig.rank_pids(job_id, attempt)
                if pids:
                    rank = rng.choice(sorted(pids))
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pids[rank], signal.SIGKILL)
                    killed += 1
                    time.sleep(3.0)  # let the platform notice before looking again
            time.sleep(0.5)
        final = rig.wait_terminal([job_id], timeout_s=600)[job_id]
        jobs, checkpoints, audit = rig.history()
        problems = inv.check_terminal(jobs.values()) + inv.check_no_double_booking(audit) \
            + inv.check_leases_released(audit, jobs.values())
        ready = [c for c in checkpoints.get(job_id, []) if c.state == "READY"]

        def read(uri: str) -> bytes | None:
            try:
                return uri_to_path(uri).read_bytes()
            except OSError:
                return None

        problems += inv.check_ready_checkpoints(ready, read_manifest=read, stat_size=local_stat_size,
                                                file_sha256=local_sha256)
        for attempt in final.attempts:
            logs = sorted((rig.layout.attempt_dir(final.tenant, job_id, attempt.attempt) / "logs").glob("rank-*.log"))
            problems += [f"attempt {attempt.attempt}: {p}" for p in inv.check_one_quorum_per_step(
                [inv.ReplicaLog.parse(log.name, log.read_text(errors="replace")) for log in logs])]
        replaced = sum(len(a.replacements) for a in final.attempts)
    with capsys.disabled():
        print(f"\n[seed {SEED}] {killed} replica kills: {len(final.attempts)} attempt(s), {replaced} replica(s) "
              f"replaced, job {final.state}; violations: {json.dumps(problems)[:2000]}")
    assert final.state == "succeeded", (final.state, final.reason)
    assert killed >= 1 and problems == [], problems
