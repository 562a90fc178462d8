"""A replica killed -9: training goes on (``faultTolerance``) against restart-from-checkpoint, in the same run
(a benchmark: it prints figures, never fails).

    python bench/recovery/replicas.py [--kills 3] [--steps 2400] [--every 100] [--step-pause 0.05] [--settle 8]
                                      [--json out.json]

One local stack (broker, Redis, the services, 2 node agents; free ports, a temporary directory). Two jobs of
``examples/fault-tolerant`` (2 replicas, one CPU rank each, gloo) run one after the other, the same spec but:

    replicas   faultTolerance.minReplicas 1: a failed replica is replaced while the other trains on
    restart    faultTolerance.minReplicas 2: a failure ends the attempt; the next resumes from the latest READY
               checkpoint (what every job without faultTolerance does)

``--kills`` times per job, ``--settle`` seconds after the job is back to 2 replicas (or running again), replica 1's
rank is killed with SIGKILL. Measured per kill, from the replicas' logs (each committed step, its quorum and how
many replicas took it) and the job record:

    lost steps      steps trained before the kill that were trained again after it (replicas: the step the kill
                    interrupted, if a survivor's allreduce failed; restart: back to the latest READY checkpoint)
    stalled         the longest time without a committed step around the kill (the job did not step)
    degraded        replicas: the time the job stepped with 1 replica (kill → the newcomer's first step)
    degraded steps  replicas: the steps committed with 1 replica
    back to 2       kill → the first step committed with 2 replicas again

The goal of the replicas mode: 0 lost steps. Baseline: the restart mode, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.cli import trainyard  # noqa: E402 - after the sys.path set-up
from tests.support.stack import local_stack, rank_entries  # noqa: E402
from trainyard_cli.stack import LocalStack  # noqa: E402

EXAMPLE = REPO / "examples" / "fault-tolerant"
COMMIT = re.compile(r"^(\S+ \S+) rank\d+ INFO trainyard: committed step (\d+) in quorum \S+ with (\d+) of (\d+)")


def commits(log: Path) -> list[tuple[float, int, int]]:
    """(time, step, replicas) of every step the replica committed."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if m := COMMIT.match(line):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((at, int(m.group(2)), int(m.group(3))))
    return out


def submit(stack: LocalStack, tmp: Path, name: str, *, min_replicas: int, steps: int, every: int,
           pause: float) -> str:
    spec = yaml.safe_load((EXAMPLE / "spec.yaml").read_text())
    spec["name"] = name
    spec["code"]["env"] = {"EXAMPLE_STEP_PAUSE_SECONDS": str(pause)}
    spec["faultTolerance"]["minReplicas"] = min_replicas
    spec["training"]["maxSteps"] = steps
    spec["checkpointPolicy"]["everySteps"] = every
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = trainyard(stack, "submit", str(path), "--code", str(EXAMPLE))
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    return done.stdout.split()[1]


def rank_pid(stack: LocalStack, job_id: str, rank: int) -> tuple[int, int] | None:
    """(attempt, pid) of the job's running rank, from the node agents' rank tables."""
    return next(((int(e["attempt"]), int(e["pid"])) for _, e in rank_entries(stack, job_id) if int(e["rank"]) == rank),
                None)


def logs_of(stack: LocalStack, job: dict[str, Any]) -> dict[int, list[Path]]:
    root = stack.s.state_dir / "artifacts" / "tenants" / job["tenant"] / "jobs" / job["jobId"] / "attempts"
    return {int(d.name): sorted((d / "logs").glob("rank-*.log")) for d in root.iterdir() if d.is_dir()}


def run_job(stack: LocalStack, client: httpx.Client, tmp: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    job_id = submit(stack, tmp, f"bench-{mode}", min_replicas=1 if mode == "replicas" else 2, steps=args.steps,
                    every=args.every, pause=args.step_pause)
    kills: list[float] = []  # wall-clock times (the logs' clock)
    deadline = time.monotonic() + args.timeout
    last_pid, settled_since = None, None
    while len(kills) < args.kills and time.monotonic() < deadline:
        job = client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            break
        found = rank_pid(stack, job_id, 1)
        ready = [c["globalStep"] for c in job["checkpoints"] if c["state"] == "READY"]
        # settled: the job steps with both replicas again (replicas) or runs again (restart), for --settle seconds
        healthy = job["state"] == "running" and found is not None and found[1] != last_pid and bool(ready) \
            and (mode == "restart" or not kills or both_since(stack, job, kills[-1]) is not None)
        settled_since = (settled_since or time.monotonic()) if healthy else None
        if healthy and found is not None and time.monotonic() - (settled_since or 0) >= args.settle:
            os.kill(found[1], signal.SIGKILL)
            kills.append(time.time())
            last_pid, settled_since = found[1], None
            step = (job.get("progress") or {}).get("globalStep", 0)
            print(f"  {mode}: kill {len(kills)} of replica 1 (pid {found[1]}, attempt {found[0]}) near step {step}",
                  flush=True)
        time.sleep(0.2)
    while True:
        job = client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        if job["state"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {"mode": mode, "job": job_id, "state": job["state"], "attempts": len(job["attempts"]),
            "kills": kills, "measures": measure(stack, job, kills)}


def both_since(stack: LocalStack, job: dict[str, Any], since: float) -> float | None:
    """When replica 0 first committed a step with both replicas after ``since`` (None: not yet)."""
    logs = [log for logs in logs_of(stack, job).values() for log in logs if log.name.startswith("rank-0")]
    return min((at for log in logs for at, _, n in commits(log) if at > since and n == 2), default=None)


def measure(stack: LocalStack, job: dict[str, Any], kills: list[float]) -> list[dict[str, float | None]]:
    """Per kill, from replica 0's committed steps (every attempt, in time order)."""
    timeline: list[tuple[float, int, int]] = []
    for _, logs in sorted(logs_of(stack, job).items()):
        for log in logs:
            if log.name.startswith("rank-0"):
                timeline += commits(log)
    timeline.sort()
    out = []
    for kill in kills:
        before = [c for c in timeline if c[0] <= kill]
        after = [c for c in timeline if c[0] > kill]
        if not before or not after:
            out.append({"lost_steps": None})
            continue
        last_step = before[-1][1]
        first_after = after[0]
        times = [before[-1][0]] + [c[0] for c in after[:200]]
        back = next((c for c in after if c[2] == 2), None)
        single = [c for c in after if c[2] < 2 and (back is None or c[0] < back[0])]
        out.append({
            "lost_steps": float(max(0, last_step - first_after[1] + 1)),
            "stalled_s": max(b - a for a, b in zip(times, times[1:], strict=False)),
            "degraded_s": (back[0] - kill) if back and single else 0.0,
            "degraded_steps": float(len(single)),
            "back_to_2_s": (back[0] - kill) if back else None,
        })
    return out


def summary(result: dict[str, Any]) -> dict[str, float | None]:
    def med(key: str) -> float | None:
        values = [m[key] for m in result["measures"] if m.get(key) is not None]
        return statistics.median(values) if values else None

    return {k: med(k) for k in ("lost_steps", "stalled_s", "degraded_s", "degraded_steps", "back_to_2_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3, help="kills of replica 1 per job")
    parser.add_argument("--steps", type=int, default=2400, help="maxSteps of each job")
    parser.add_argument("--every", type=int, default=100, help="checkpoint interval (steps)")
    parser.add_argument("--step-pause", type=float, default=0.05,
                        help="seconds each step waits (the example's EXAMPLE_STEP_PAUSE_SECONDS): a step time closer "
                             "to a real model's than the tiny model's ~15 ms")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds between a recovery and the next kill")
    parser.add_argument("--timeout", type=float, default=900.0, help="per job")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-replicas-") as tmp:
        print("starting the local stack…", flush=True)
        with local_stack(Path(tmp) / ".trainyard") as stack:
            token = stack.token_file.read_text().strip()
            with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"},
                              timeout=30) as client:
                results = [run_job(stack, client, Path(tmp), mode, args) for mode in ("replicas", "restart")]
    print(f"\n{args.kills} kill(s) of one of 2 replicas per job, checkpoint every {args.every} steps, steps of "
          f"~{args.step_pause * 1000:.0f} ms + compute (medians):")
    print(f"  {'mode':<10}{'attempts':>9}{'lost steps':>12}{'stalled s':>11}{'degraded s':>12}"
          f"{'degraded steps':>16}{'back to 2 s':>13}")
    for r in results:
        s = summary(r)

        def fmt(v: float | None, spec: str = ".2f") -> str:
            return "-" if v is None else format(v, spec)

        print(f"  {r['mode']:<10}{r['attempts']:>9}{fmt(s['lost_steps'], '.0f'):>12}{fmt(s['stalled_s']):>11}"
              f"{fmt(s['degraded_s']):>12}{fmt(s['degraded_steps'], '.0f'):>16}{fmt(s['back_to_2_s']):>13}")
        r["summary"] = s
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
