"""Recovery time after kill -9 of a rank, on the local stack (a benchmark: it prints figures, never fails).

    python bench/recovery/run.py [--kills 12] [--every 10] [--backoff S] [--warm N] [--json results.json]

One 2-rank job (the chaos suite's small GPT, async checkpoints every ``--every`` steps) runs on the
local stack (LocalStack: broker, Redis, the services, 2 node agents; free ports, a temporary
directory). At a random moment of each attempt a random rank is killed with SIGKILL; measured per
kill, from the ranks' spools, the launcher's files, the rank logs and the job record:

    kill → failed      the node agent reaps the rank, WorkerExited reaches the scheduler, the attempt fails
    failed → placed    retry back-off and the next scheduling tick (a new allocation and epoch)
    placed → spawned   GangAllocated reaches the node agents, which start the ranks
    spawned → ready    interpreter and torch import, rendezvous, model and data set-up (first log line)
    ready → step       restore (verify every shard's sha256, load) and the first training step
    total              kill → first completed step of the next attempt (the goal: median <= 2 s on the default stack)

and the lost work: steps between the furthest step of the killed attempt and the step the next one
resumed from, as a fraction of the checkpoint interval. Baseline, measured in the same run: the
cold start of the first attempt (placement → first step).

Two runs, each on a fresh stack with the local stack's default settings: the baseline with warm
interpreters off (``TRAINYARD_WARM_RANKS=0``: a cold python per rank), then the default stack as
``make up`` starts it (warm interpreters with the trainer imported, one per device, sized to memory;
``--warm N`` sets their number instead); the ratio of the medians is printed. Each attempt runs
``--settle`` seconds (15) before its kill window opens: real failures are hours apart, and the
agents refill their pools only once a new attempt's ranks have made progress (importing torch
beside a starting rank would slow it down); ``--settle 0`` kills back to back.

The scheduler's retry back-off (``TRAINYARD_RETRY_BACKOFF_S``, 0.5 s by default) doubles only with failures
that follow no progress; each kill here follows a READY checkpoint newer than the attempt's start, so every
retry waits the base back-off. ``--backoff``/``--backoff-max`` override them (both runs; said in the report).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.chaos.harness import TENANT, ChaosRig, chaos_spec  # noqa: E402 - after the sys.path set-up


def first_log_time(path: Path) -> float | None:
    """The timestamp of a rank log's first trainer line (logging is configured after the imports)."""
    try:
        for line in path.read_text(errors="replace").splitlines():
            if " rank" in line and line[:4].isdigit():
                return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except OSError:
        return None
    return None


def measure(rig: ChaosRig, job_id: str, attempt: int) -> dict[str, float | None]:
    """Timestamps of attempt ``attempt`` (placed, spawned, ready, first step), from durable traces."""
    record = rig.job(job_id)
    placed = next((a.started_at.timestamp() for a in record.attempts if a.attempt == attempt), None) if record else None
    attempt_dir = rig.layout.attempt_dir(TENANT, job_id, attempt)
    pid_files = list((attempt_dir / "exit").glob("rank-*.pid"))
    spawned = min((p.stat().st_mtime for p in pid_files), default=None)
    ready = [t for p in (attempt_dir / "logs").glob("rank-*.log") if (t := first_log_time(p)) is not None]
    stamps = [datetime.fromisoformat(p["occurredAt"]).timestamp()
              for lines in rig.spool_events(job_id, attempt).values() for p in lines
              if p.get("eventType") == "StepMetrics"]
    return {"placed": placed, "spawned": spawned, "ready": max(ready) if ready else None,
            "step": min(stamps) if stamps else None}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def run(args: argparse.Namespace, warm: int | None) -> dict[str, Any]:
    """One stack with the defaults (``warm``: TRAINYARD_WARM_RANKS, None = the default sizing)."""
    state = Path(tempfile.mkdtemp(prefix="trainyard-bench-recovery-")) / ".trainyard"
    env = {"TRAINYARD_API_MAX_ATTEMPTS": str(args.kills + 5)}  # a budget for the kills; no effect on timing
    if warm is not None:
        env["TRAINYARD_WARM_RANKS"] = str(warm)
    if args.backoff is not None:
        env["TRAINYARD_RETRY_BACKOFF_S"] = str(args.backoff)
    if args.backoff_max is not None:
        env["TRAINYARD_RETRY_BACKOFF_MAX_S"] = str(args.backoff_max)
    rows: list[dict[str, Any]] = []
    with ChaosRig.running(state, seed=args.seed, extra_env=env, base_env={}, say=lambda m: None) as rig:
        warm_now = sorted({n.warm_interpreters for n in rig.stack.nodes()}, key=str)
        job_id = rig.submit(chaos_spec(max_steps=1_000_000, every=args.every, name="bench-recovery"))
        attempt, _ = rig.wait_running(job_id, steps_past_start=1, timeout_s=300)
        cold = measure(rig, job_id, attempt)
        for n in range(args.kills):
            time.sleep(args.settle)  # failures hours apart, not seconds: the warm pool has refilled
            rig.wait_advance(job_id, rig.rng.randint(1, args.every + 2))
            fault = rig.kill_rank(job_id)
            if fault is None:
                continue
            killed_attempt = int(fault.target.split()[1])
            nxt, _ = rig.wait_running(job_id, steps_past_start=1, after_attempt=killed_attempt, timeout_s=300)
            record = rig.job(job_id)
            assert record is not None
            failed = next(a for a in record.attempts if a.attempt == killed_attempt)
            resumed = next(a for a in record.attempts if a.attempt == nxt)
            last = max(rig.attempt_steps(job_id, killed_attempt), default=0)
            start = resumed.start_checkpoint.global_step if resumed.start_checkpoint else 0
            t = measure(rig, job_id, nxt)
            row = {
                "kill": n + 1, "attempt": killed_attempt,
                "kill_to_failed": span(fault.at, failed.ended_at.timestamp() if failed.ended_at else None),
                "failed_to_placed": span(failed.ended_at.timestamp() if failed.ended_at else None, t["placed"]),
                "placed_to_spawned": span(t["placed"], t["spawned"]),
                "spawned_to_ready": span(t["spawned"], t["ready"]),
                "ready_to_step": span(t["ready"], t["step"]),
                "total": span(fault.at, t["step"]),
                "lost_steps": last - start, "lost_fraction": (last - start) / args.every,
                "reason": failed.failure_reason,
            }
            rows.append(row)
            print(f"kill {n + 1:2d}: total {row['total']:.2f}s  lost {row['lost_steps']} steps "
                  f"({row['lost_fraction']:.2f} of the interval)", flush=True)
        with rig.client() as client:
            client.post(f"/v1/training-jobs/{job_id}/cancel")
    return {"rows": rows, "cold": cold, "settings": {**vars(args), "warm": warm, "warm_now": warm_now}}


def report(result: dict[str, Any]) -> float | None:
    rows, cold, s = result["rows"], result["cold"], result["settings"]
    if not rows:
        print("no kill was measured")
        return None
    warm_now = "/".join(map(str, s["warm_now"]))
    how = ("warm interpreters off (TRAINYARD_WARM_RANKS=0: a new python per rank)" if s["warm"] == 0 else
           f"the default stack ({warm_now} warm interpreters per node, "
           f"{'TRAINYARD_WARM_RANKS' if s['warm'] is not None else 'sized by default'})")
    backoff = ("default retry back-off" if s["backoff"] is None and s["backoff_max"] is None else
               f"retry back-off {s['backoff']} s (max {s['backoff_max']} s)")
    print(f"\nrecovery after kill -9 of a rank, {how}: {len(rows)} kills, 2 ranks, checkpoint every {s['every']} "
          f"steps (async), {backoff}")
    print(f"{'phase':<22}{'median':>9}{'p95':>9}{'max':>9}")
    for key in ("kill_to_failed", "failed_to_placed", "placed_to_spawned", "spawned_to_ready", "ready_to_step",
                "total"):
        values = [r[key] for r in rows if r[key] is not None]
        if values:
            print(f"{key.replace('_', ' '):<22}{statistics.median(values):>8.2f}s{percentile(values, 0.95):>8.2f}s"
                  f"{max(values):>8.2f}s")
    totals = [r["total"] for r in rows if r["total"] is not None]
    cold_start = span(cold["placed"], cold["step"])
    if cold_start:
        print(f"baseline: cold start of the first attempt (placed → first step) {cold_start:.2f}s; "
              f"recovery median / cold start = {statistics.median(totals) / cold_start:.2f}")
    print(f"goal: median <= 2 s on the default stack; {sum(t <= 2.0 for t in totals)} of {len(totals)} "
          f"recoveries took <= 2 s, {sum(t <= 5.0 for t in totals)} <= 5 s")
    fractions = [r["lost_fraction"] for r in rows]
    print(f"lost work: median {statistics.median(fractions):.2f}, max {max(fractions):.2f} of the interval "
          f"(> 1 only while an asynchronous save was in flight: {sum(f > 1 for f in fractions)} of {len(fractions)})")
    return statistics.median(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval in steps")
    parser.add_argument("--backoff", type=float, help="scheduler retry back-off (s); default: the stack's (0.5)")
    parser.add_argument("--backoff-max", type=float, help="its cap (s); default: the stack's (60)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--warm", type=int,
                        help="warm interpreters per node agent for the second run (default: the stack's own "
                             "sizing; 0: the cold run only)")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds each attempt runs before its kill window opens (real failures are hours "
                             "apart; the node agents refill their warm pools once the ranks have made progress; "
                             "0: back-to-back kills, a stress test of the refill)")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args()
    started = time.monotonic()
    results = [run(args, warm=0)] + ([run(args, warm=args.warm)] if args.warm != 0 else [])
    medians = [report(r) for r in results]
    if len(medians) == 2 and all(medians):
        print(f"\ndefault (warm) / cold median recovery: {medians[1] / medians[0]:.2f} "  # type: ignore[operator]  # both medians exist here
              f"({medians[1]:.2f}s vs {medians[0]:.2f}s)")
    print(f"({time.monotonic() - started:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
